#!/usr/bin/env bash
# `pip install .` into a fresh virtual environment, then a short checkpoint,
# SIGKILL and restore run with the installed package (not the build tree).
#
#   tests/python_package_test.sh PYTHON
#
# PYTHON is the project's environment (scripts/pmsnap.sh's venv): the fresh
# venv borrows its torch, scikit-build-core and pybind11 through a .pth file,
# so nothing is downloaded; the package itself is built from this checkout.
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

echo "python_package_test: pip install $root"
"$work/venv/bin/python" -m pip install -q --no-input --no-deps --no-build-isolation "$root" </dev/null \
  || fail "pip install . failed"

cd "$work"   # away from the checkout: the import must find the installed package
installed="$("$work/venv/bin/python" -c 'import pmsnap; print(pmsnap.__file__)')"
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
"$py" train.py "$pool" plain "$work/plain.pt" >/dev/null
rm -f "$pool"
set +e
"$py" train.py "$pool" kill "$work/unused.pt"
status=$?
set -e
[[ $status -eq 137 ]] || fail "the killed run ended with $status, expected 137 (SIGKILL)"
"$py" -m pmsnap verify "$pool" >/dev/null || fail "python -m pmsnap verify: pool not consistent"
resumed="$("$py" train.py "$pool" resume "$work/resumed.pt")"
[[ "$resumed" == "resumed-from 6" ]] || fail "expected to resume from iteration 6, got '$resumed'"
"$py" - "$work/plain.pt" "$work/resumed.pt" <<'PY' || fail "resumed run differs from the uninterrupted one"
import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
sys.exit(0 if all(torch.equal(x, y) for x, y in zip(a, b)) else 1)
PY
listed="$("$work/venv/bin/pmsnap" list "$pool")" || fail "the installed pmsnap list failed"
[[ "$listed" == *"2 retained checkpoint"* ]] \
  || fail "the installed pmsnap command does not list the pool's checkpoints: $listed"
"$work/venv/bin/pmsnap" export "$pool" --to "$work/exported.pt" --quiet >/dev/null \
  || fail "the installed pmsnap command could not export the pool"
"$py" - "$work/resumed.pt" "$work/exported.pt" <<'PY' || fail "the export differs from the run"
import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2], weights_only=True)["model"]
sys.exit(0 if all(torch.equal(x, y) for x, y in zip(a, b.values())) else 1)
PY
echo "python_package_test: installed package checkpointed, was killed, resumed bit-exact, exported"
