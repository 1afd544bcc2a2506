#!/usr/bin/env bash
# The wheel a user installs: scripts/build_wheel.sh builds it (`pip wheel .`,
# then auditwheel copies PMDK, oneTBB and their dependencies into it), it is
# installed into a fresh virtual environment, and a short checkpoint, SIGKILL
# and restore run, plus the `pmsnap` command, use the installed package with
# the system's copies of those libraries hidden (bind-mounted over in a user
# and mount namespace), as on a machine without the Debian packages.
#
#   tests/python_package_test.sh PYTHON
#
# PYTHON is the project's environment (scripts/pmsnap.sh's venv): the fresh
# venv borrows its torch through a .pth file, so nothing is downloaded; the
# package itself is built from this checkout.
set -euo pipefail
project_python="$1"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() { echo "python_package_test: $*" >&2; exit 1; }

base_python="$("$project_python" -c 'import sys; print(sys._base_executable)')"
"$base_python" -m venv "$work/venv"
venv_site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$project_python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' \
  >"$venv_site/borrowed-project-env.pth"

echo "python_package_test: building the wheel of $root"
wheel="$("$root/scripts/build_wheel.sh" "$project_python" "$work/dist" | tail -n 1)" \
  || fail "scripts/build_wheel.sh failed"
[[ "$wheel" == *manylinux*.whl ]] || fail "no manylinux wheel: '$wheel'"
"$work/venv/bin/python" -m pip install -q --no-input --no-deps --no-index "$wheel" </dev/null \
  || fail "pip install $wheel failed"

# The extension needs nothing beyond the C and C++ runtimes that the wheel
# does not carry itself (hashed names in pmsnap.libs/, found through its RPATH).
extension="$(ls "$venv_site"/pmsnap/_pmsnap*.so)"
while read -r library; do
  case "$library" in
    libc.so.*|libm.so.*|libgcc_s.so.*|libstdc++.so.*|ld-linux*|libpthread.so.*|libdl.so.*|librt.so.*) ;;
    *) [[ -f "$venv_site/pmsnap.libs/$library" ]] \
         || fail "$extension needs $library, which the wheel does not carry" ;;
  esac
done < <(readelf -d "$extension" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
readelf -d "$extension" | grep -q 'R.*PATH.*\$ORIGIN/\.\./pmsnap\.libs' \
  || fail "$extension has no RPATH to pmsnap.libs"

# The system's PMDK, oneTBB, ndctl and xxHash, hidden for what follows.
hidden=()
for library in /usr/lib/x86_64-linux-gnu/lib{pmem,pmemobj,tbb,ndctl,daxctl,xxhash}*.so*; do
  [[ -e "$library" ]] && hidden+=("$library")
done
if unshare -rm true 2>/dev/null; then
  run_hidden() {
    unshare -rm bash -c 'for f in "${@:2:$1}"; do mount --bind /dev/null "$f"; done
                         shift $(($1 + 1)); exec "$@"' hide "${#hidden[@]}" "${hidden[@]}" "$@"
  }
  run_hidden "$work/venv/bin/python" -c 'import ctypes; ctypes.CDLL("libpmemobj.so.1")' \
    2>/dev/null && fail "hiding the system's libpmemobj did not work"
  echo "python_package_test: running with ${#hidden[@]} system libraries hidden"
else
  run_hidden() { "$@"; }
  echo "python_package_test: no user namespaces here: the system libraries stay visible"
fi

cd "$work"   # away from the checkout: the import must find the installed package
installed="$(run_hidden "$work/venv/bin/python" -c 'import pmsnap; print(pmsnap.__file__)')"
[[ "$installed" == "$venv_site"/pmsnap/* ]] || fail "imported $installed, not the installed package"

export PMEM_IS_PMEM_FORCE=1
pool="${PMSNAP_POOL_DIR:-/dev/shm}/pmsnap-package-test-$$.pool"
trap 'rm -rf "$work" "$pool"' EXIT
cat >"$work/train.py" <<'PY'
import os, signal, sys
import torch, pmsnap

pool, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = pmsnap.CheckpointedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), pool,
                                   model=model, every=1)
start = opt.restore()[0] if mode == "resume" else 0
for k in range(start + 1, 11):
    g = torch.Generator().manual_seed(k)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if mode == "kill" and k == 6:
        opt.flush()  # iteration 6 is committed; then the process dies
        os.kill(os.getpid(), signal.SIGKILL)
opt.close()
print("resumed-from", start)
torch.save([p.detach() for p in model.parameters()], sys.argv[3])
PY
py="$work/venv/bin/python"
run_hidden "$py" train.py "$pool" plain "$work/plain.pt" >/dev/null
rm -f "$pool"
set +e
run_hidden "$py" train.py "$pool" kill "$work/unused.pt"
status=$?
set -e
[[ $status -eq 137 ]] || fail "the killed run ended with $status, expected 137 (SIGKILL)"
run_hidden "$py" -m pmsnap verify "$pool" >/dev/null || fail "python -m pmsnap verify: pool not consistent"
resumed="$(run_hidden "$py" train.py "$pool" resume "$work/resumed.pt")"
[[ "$resumed" == "resumed-from 6" ]] || fail "expected to resume from iteration 6, got '$resumed'"
"$py" - "$work/plain.pt" "$work/resumed.pt" <<'PY' || fail "resumed run differs from the uninterrupted one"
import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
sys.exit(0 if all(torch.equal(x, y) for x, y in zip(a, b)) else 1)
PY
listed="$(run_hidden "$work/venv/bin/pmsnap" list "$pool")" || fail "the installed pmsnap list failed"
[[ "$listed" == *"2 retained checkpoint"* ]] \
  || fail "the installed pmsnap command does not list the pool's checkpoints: $listed"
run_hidden "$work/venv/bin/pmsnap" export "$pool" --to "$work/exported.pt" --quiet >/dev/null \
  || fail "the installed pmsnap command could not export the pool"
"$py" - "$work/resumed.pt" "$work/exported.pt" <<'PY' || fail "the export differs from the run"
import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2], weights_only=True)["model"]
sys.exit(0 if all(torch.equal(x, y) for x, y in zip(a, b.values())) else 1)
PY
echo "python_package_test: the installed wheel checkpointed, was killed, resumed bit-exact, exported"
