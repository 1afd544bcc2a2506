#!/usr/bin/env bash
# scripts/gpu_check.sh's logic on a machine without a GPU (issues [gpu],
# [gpu2]): clean under shellcheck; without a GPU it stops with exit code 2
# and says why; `deps` unpacks the bundled packages and finds PMDK, oneTBB,
# xxHash and GoogleTest in them alone, and fails naming a .deb taken away;
# its rehearsal builds against the bundle and passes its CPU-runnable items;
# and the GPU stall benchmark's code runs end to end on the CPU at a tiny
# size, writing one CSV row per method.
#   gpu_check_script_test.sh <python> <PYTHONPATH of the built package>
set -euo pipefail
python="$1"
pythonpath="$2"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
script="$root/scripts/gpu_check.sh"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
fail() {
  echo "gpu_check_script_test: $*" >&2
  exit 1
}

if command -v shellcheck >/dev/null 2>&1; then
  shellcheck "$script" "${BASH_SOURCE[0]}" || fail "shellcheck reports the lines above"
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "a GPU is present: the no-GPU path is not exercised here"
else
  status=0
  PMSNAP_GPU_PYTHON="$python" PMSNAP_GPU_BUILD_DIR="$out/build" "$script" >"$out/no-gpu.log" 2>&1 ||
    status=$?
  [[ $status -eq 2 ]] || fail "without a GPU: exit code $status, expected 2 ($(cat "$out/no-gpu.log"))"
  grep -q "no GPU visible on this machine" "$out/no-gpu.log" || fail "no clear message: $(cat "$out/no-gpu.log")"
  [[ ! -d "$out/build" ]] || fail "without a GPU it still unpacked or built something"
fi

PMSNAP_GPU_BUILD_DIR="$out/build" "$script" deps >"$out/deps.log" 2>&1 ||
  fail "deps failed: $(cat "$out/deps.log")"
for module in libpmem libpmemobj libxxhash tbb gtest gmock; do
  grep -q "^found $module .* in $out/build/deps/usr/lib/x86_64-linux-gnu\$" "$out/deps.log" ||
    fail "$module not taken from the bundled packages: $(cat "$out/deps.log")"
done

# The bundle alone must hold every package, whatever this machine has
# installed: without one .deb that libpmemobj.pc requires, `deps` fails and
# names it (the first GPU run stopped on exactly that).
mkdir -p "$out/debs-missing-one"
cp "$root"/third_party/debs/*.deb "$out/debs-missing-one/"
rm "$out"/debs-missing-one/libndctl-dev_*.deb
status=0
PMSNAP_DEBS_DIR="$out/debs-missing-one" PMSNAP_GPU_BUILD_DIR="$out/build-missing" "$script" deps \
  >"$out/deps-missing.log" 2>&1 || status=$?
[[ $status -eq 3 ]] || fail "a bundle without libndctl-dev: exit $status, expected 3 ($(cat "$out/deps-missing.log"))"
grep -q "libndctl" "$out/deps-missing.log" ||
  fail "a bundle without libndctl-dev: the message does not name it: $(cat "$out/deps-missing.log")"

# The rehearsal (no GPU): the build against the bundle alone, nvcc warnings
# as errors, the CUDA and ordering tests (the CUDA ones skip) and the
# extension's symbol checks, each reported as an item.
status=0
PMSNAP_GPU_CHECK_REHEARSAL=1 PMSNAP_GPU_PYTHON="$python" PMSNAP_GPU_BUILD_DIR="$out/build" \
  PMSNAP_GPU_REPORT_DIR="$out/report" PMSNAP_GPU_ITEMS=cuda-tests,extension PMSNAP_GPU_WERROR=ON \
  "$script" >"$out/rehearsal.log" 2>&1 || status=$?
[[ $status -eq 0 ]] || fail "the rehearsal failed (exit $status): $(tail -n 40 "$out/rehearsal.log")"
for item in cuda-tests extension; do
  grep -q "^| $item | passed |" "$out/report/report.md" ||
    fail "the rehearsal's report lacks a passed $item: $(cat "$out/report/report.md")"
done
grep -q "not a GPU check" "$out/report/report.md" || fail "the rehearsal's report does not say so"

csv="$out/gpu_stall.csv"
PYTHONPATH="$pythonpath" PMSNAP_POOL_DIR="${PMSNAP_POOL_DIR:-/dev/shm}" "$python" \
  "$root/bench/gpu/gpu_stall.py" --device cpu --tiny --steps 2 --warmup 1 --every 1 \
  --csv "$csv" >"$out/bench.log" 2>&1 || fail "benchmark smoke run failed: $(cat "$out/bench.log")"
# One row per method; those that checkpoint report checkpoints.
column() { head -n 1 "$csv" | tr ',' '\n' | grep -nx "$1" | cut -d: -f1; }
method_col="$(column method)"
checkpoints_col="$(column checkpoints)"
for method in none pmsnap pmsnap-continuous pmsnap-staged dcp_async checkfreq; do
  awk -F, -v c="$method_col" -v m="$method" '$c == m { found = 1 } END { exit !found }' "$csv" ||
    fail "no $method row in $(cat "$csv")"
done
for method in pmsnap pmsnap-continuous pmsnap-staged dcp_async checkfreq; do
  awk -F, -v c="$method_col" -v k="$checkpoints_col" -v m="$method" \
    '$c == m && $k > 0 { found = 1 } END { exit !found }' "$csv" ||
    fail "$method's row reports no checkpoint: $(cat "$csv")"
done
# A budget spent before the first round ends stops it between runs and keeps
# what it measured (a caller's timeout would have lost it all): here the
# baseline, which runs whatever the budget.
PYTHONPATH="$pythonpath" PMSNAP_POOL_DIR="${PMSNAP_POOL_DIR:-/dev/shm}" "$python" \
  "$root/bench/gpu/gpu_stall.py" --device cpu --tiny --steps 2 --warmup 1 --every 1 \
  --methods none,pmsnap --time-budget 1e-9 --csv "$csv" >"$out/budget.log" 2>&1 ||
  fail "benchmark run with a spent budget failed: $(cat "$out/budget.log")"
grep -q "round 1 stopped every 1, before pmsnap" "$out/budget.log" ||
  fail "the spent budget's stop is not reported: $(cat "$out/budget.log")"
method_col="$(column method)"
[[ "$(awk -F, -v c="$method_col" 'NR > 1 { print $c }' "$csv")" == none ]] ||
  fail "the stopped round should keep only its baseline row: $(cat "$csv")"
echo "gpu_check_script_test: ok"
