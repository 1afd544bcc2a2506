#!/usr/bin/env bash
# scripts/gpu_check.sh's logic on a machine without a GPU (issue [gpu]):
# clean under shellcheck; without a GPU it stops with exit code 2 and says why;
# `deps` unpacks the bundled packages and finds PMDK, oneTBB and xxHash in
# them; and the GPU stall benchmark's code runs end to end on the CPU at a
# tiny size, writing one CSV row per method.
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
for module in libpmem libpmemobj libxxhash tbb; do
  grep -q "^found $module .* in $out/build/deps/usr/lib/x86_64-linux-gnu\$" "$out/deps.log" ||
    fail "$module not taken from the bundled packages: $(cat "$out/deps.log")"
done

csv="$out/gpu_stall.csv"
PYTHONPATH="$pythonpath" PMSNAP_POOL_DIR="${PMSNAP_POOL_DIR:-/dev/shm}" "$python" \
  "$root/bench/gpu/gpu_stall.py" --device cpu --tiny --steps 2 --warmup 1 --every 1 \
  --csv "$csv" >"$out/bench.log" 2>&1 || fail "benchmark smoke run failed: $(cat "$out/bench.log")"
# columns: device,method,step_ms,overhead_pct,gpu_step_ms,gpu_stall_ms,checkpoints,...
for method in none pmsnap dcp_async checkfreq; do
  grep -q "^cpu smoke test (not a GPU),$method," "$csv" || fail "no $method row in $(cat "$csv")"
done
for method in pmsnap dcp_async checkfreq; do
  awk -F, -v m="$method" '$2 == m && $7 > 0 { found = 1 } END { exit !found }' "$csv" ||
    fail "$method's row reports no checkpoint: $(cat "$csv")"
done
echo "gpu_check_script_test: ok"
