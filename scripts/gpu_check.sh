#!/usr/bin/env bash
# The GPU checks in one command, for a GPU machine without network access
# (ours: an H100, CUDA 13, torch 2.11 in /opt/torch/.venv, Python 3.12, no
# PMDK or oneTBB installed). README.md, "Checking the GPU path", says what it
# checks.
#
#   scripts/gpu_check.sh         build, run the CUDA tests and the GPU stall
#                                benchmark, write the report
#   scripts/gpu_check.sh deps    only unpack the bundled packages and print
#                                the environment a build would use
#
# 1. Stops with exit code 2 and says so when no GPU is visible (nvidia-smi,
#    else torch.cuda): there is nothing to check on such a machine; the
#    event ordering itself is tested without a GPU by the normal suite.
# 2. Unpacks PMDK, oneTBB, xxHash, GoogleTest, pybind11 and pkgconf from
#    third_party/debs/*.deb (Debian 12 packages, fetched with `apt-get
#    download`; no root, no network) into the build folder.
# 3. Configures and builds with the CUDA device, nvcc warnings as errors.
# 4. Runs the CUDA tests (runtime_cuda_test: bit-exact resume with a
#    conflict under each strategy, the staging-ring fallback) and the
#    ordering tests that also run without a GPU.
# 5. Runs bench/gpu/gpu_stall.py: a GPT-2-small-sized transformer, pmsnap
#    against torch.distributed.checkpoint.async_save and a CheckFreq-style
#    snapshot (step time overhead and GPU-side stall).
# 6. Writes the report, $report_dir/report.md, with every log beside it.
#
# Environment: PMSNAP_GPU_PYTHON (default /opt/torch/.venv/bin/python, else
# python3), PMSNAP_GPU_BUILD_DIR (default build-gpu), PMSNAP_GPU_REPORT_DIR
# (default bench/results/gpu_check), PMSNAP_DEBS_DIR (default
# third_party/debs), PMSNAP_POOL_DIR (default /dev/shm), PMSNAP_GPU_WERROR
# (default ON), PMSNAP_GPU_BENCH_ARGS (extra benchmark arguments),
# PMSNAP_GPU_JOBS (build jobs, default nproc); PMSNAP_GPU_CHECK_REHEARSAL=1
# runs every step without a GPU (to test this script; the report says so).
set -euo pipefail

mode="${1:-all}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${PMSNAP_GPU_BUILD_DIR:-$root/build-gpu}"
report_dir="${PMSNAP_GPU_REPORT_DIR:-$root/bench/results/gpu_check}"
debs_dir="${PMSNAP_DEBS_DIR:-$root/third_party/debs}"
deps="$build_dir/deps"
pool_dir="${PMSNAP_POOL_DIR:-/dev/shm}"
werror="${PMSNAP_GPU_WERROR:-ON}"
jobs="${PMSNAP_GPU_JOBS:-$(nproc)}"

say() { echo "gpu_check: $*" >&2; }
die() {
  say "$2"
  exit "$1"
}

case "$mode" in
  all | deps) ;;
  -h | --help | help)
    sed -n '2,33p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  *) die 64 "unknown mode '$mode' (expected no argument, or 'deps')" ;;
esac

python="${PMSNAP_GPU_PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x /opt/torch/.venv/bin/python ]]; then
    python=/opt/torch/.venv/bin/python
  else
    python="$(command -v python3 || true)"
  fi
fi

# --- 1. a GPU? ---------------------------------------------------------------
gpu_name=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpu_name="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader |
    head -n 1)"
elif [[ -n "$python" ]] &&
  "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    >/dev/null 2>&1; then
  gpu_name="$("$python" -c 'import torch; print(torch.cuda.get_device_name(0))')"
fi
if [[ -z "$gpu_name" && -n "${PMSNAP_GPU_CHECK_REHEARSAL:-}" ]]; then
  # Runs every step on a machine without a GPU to check the script itself:
  # the CUDA tests skip and the report says it is no GPU check.
  gpu_name="none: a rehearsal of this script without a GPU (PMSNAP_GPU_CHECK_REHEARSAL), not a GPU check"
fi
if [[ "$mode" == all && -z "$gpu_name" ]]; then
  die 2 "no GPU visible on this machine (nvidia-smi lists none and torch.cuda is unavailable): \
nothing to check here. Run this script on a GPU machine; without one, the event ordering is \
tested by the normal suite (runtime_async_device_test, conflict_async_ordering_test)."
fi

# --- 2. the bundled packages -------------------------------------------------
unpack_debs() {
  shopt -s nullglob
  local debs=("$debs_dir"/*.deb)
  shopt -u nullglob
  if ((${#debs[@]} == 0)); then
    die 3 "no .deb files in $debs_dir (PMSNAP_DEBS_DIR): fetch them on a machine with network \
with 'apt-get download' (the list is in third_party/debs/README.md)"
  fi
  local stamp="$deps/.unpacked"
  local want
  want="$(cat "${debs[@]}" | sha256sum | cut -d' ' -f1)"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    return
  fi
  rm -rf "$deps"
  mkdir -p "$deps"
  local deb
  for deb in "${debs[@]}"; do
    if command -v dpkg-deb >/dev/null 2>&1; then
      dpkg-deb -x "$deb" "$deps"
    else
      # No dpkg: a .deb is an ar archive holding data.tar.*.
      local tmp
      tmp="$(mktemp -d)"
      (cd "$tmp" && ar x "$deb" && tar -xf data.tar.* -C "$deps")
      rm -rf "$tmp"
    fi
  done
  # pkg-config files name /usr (prefix, and some libdir and includedir
  # outright): point every such path at the unpacked tree.
  local pc
  while IFS= read -r -d '' pc; do
    sed -i -e "s|^prefix=/usr\$|prefix=$deps/usr|" -e "s|=/usr/|=$deps/usr/|g" "$pc"
  done < <(find "$deps" -name '*.pc' -print0)
  echo "$want" >"$stamp"
}

unpack_debs
multiarch="$deps/usr/lib/x86_64-linux-gnu"
export PKG_CONFIG_PATH="$multiarch/pkgconfig:$deps/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export LD_LIBRARY_PATH="$multiarch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
pkg_config="$(command -v pkg-config || true)"
if [[ -z "$pkg_config" && -x "$deps/usr/bin/pkgconf" ]]; then
  pkg_config="$deps/usr/bin/pkgconf"
fi
prefix_path="$deps/usr;$multiarch/cmake;$deps/usr/share/cmake;$deps/usr/lib/cmake"

if [[ "$mode" == deps ]]; then
  echo "PKG_CONFIG_PATH=$PKG_CONFIG_PATH"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo "CMAKE_PREFIX_PATH=$prefix_path"
  echo "PKG_CONFIG=${pkg_config:-none}"
  for module in libpmem libpmemobj libxxhash tbb; do
    if [[ -n "$pkg_config" ]] && "$pkg_config" --exists "$module"; then
      echo "found $module $("$pkg_config" --modversion "$module") in $("$pkg_config" --variable=libdir "$module")"
    else
      die 3 "$module not found in $deps after unpacking"
    fi
  done
  exit 0
fi

# --- 3. build ------------------------------------------------------------------
missing=()
for tool in cmake c++; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
[[ -n "$pkg_config" ]] || missing+=("pkg-config")
nvcc="$(command -v nvcc || true)"
[[ -n "$nvcc" || ! -x /usr/local/cuda/bin/nvcc ]] || nvcc=/usr/local/cuda/bin/nvcc
[[ -n "$nvcc" ]] || missing+=("nvcc (the CUDA toolkit)")
[[ -n "$python" ]] || missing+=("python3")
if ((${#missing[@]} > 0)); then
  die 3 "missing on this machine: ${missing[*]} (not bundled: install them, or put them on PATH)"
fi
generator=(-G "Unix Makefiles")
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
mkdir -p "$report_dir"
log="$report_dir/build.log"
say "building in $build_dir (log: $log)"
{
  cmake -S "$root" -B "$build_dir" "${generator[@]}" \
    -DPMSNAP_WITH_CUDA=ON -DPMSNAP_WITH_TORCH=OFF -DPMSNAP_BUILD_BENCH=OFF \
    -DPMSNAP_WERROR="$werror" -DCMAKE_CUDA_COMPILER="$nvcc" \
    -DCMAKE_PREFIX_PATH="$prefix_path" -DPKG_CONFIG_EXECUTABLE="$pkg_config" \
    -DPython_EXECUTABLE="$python"
  cmake --build "$build_dir" -j "$jobs" --target runtime_cuda_test runtime_device_test \
    runtime_async_device_test runtime_staging_ring_test conflict_async_ordering_test
  # The Python package, for the benchmark's pmsnap row (needs Python.h).
  cmake --build "$build_dir" -j "$jobs" --target pmsnap_python || echo "gpu_check: no Python binding"
} >"$log" 2>&1 || die 4 "build failed (a compiler other than CI's may warn where CI does not: \
PMSNAP_GPU_WERROR=OFF builds anyway); the last lines of $log:
$(tail -n 30 "$log")"

# --- 4. tests ------------------------------------------------------------------
export PMSNAP_POOL_DIR="$pool_dir" PMEM_IS_PMEM_FORCE=1
failed=0
test_rows=()
for test in runtime_cuda_test runtime_device_test runtime_async_device_test \
  runtime_staging_ring_test conflict_async_ordering_test; do
  binary="$(find "$build_dir/tests" -maxdepth 2 -type f -name "$test" | head -n 1)"
  test_log="$report_dir/$test.log"
  status=passed
  if ! "$binary" >"$test_log" 2>&1; then
    status=FAILED
    failed=1
  fi
  summary="$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?[,.]' "$test_log" |
    tr '\n' ' ')"
  test_rows+=("| $test | $status | $summary |")
  say "$test: $status"
done
if [[ -z "${PMSNAP_GPU_CHECK_REHEARSAL:-}" ]] &&
  grep -q '^\[  SKIPPED \]' "$report_dir/runtime_cuda_test.log"; then
  say "runtime_cuda_test skipped tests although a GPU is visible; see its log"
  failed=1
fi

# --- 5. benchmark --------------------------------------------------------------
bench_log="$report_dir/gpu_stall.log"
bench_status=skipped
if [[ -f "$build_dir/python/pmsnap/__init__.py" ]]; then
  # shellcheck disable=SC2086 # PMSNAP_GPU_BENCH_ARGS is a list of arguments
  if PYTHONPATH="$build_dir/python" "$python" "$root/bench/gpu/gpu_stall.py" \
    --csv "$report_dir/gpu_stall.csv" ${PMSNAP_GPU_BENCH_ARGS:-} >"$bench_log" 2>&1; then
    bench_status=ran
  else
    bench_status=FAILED
    failed=1
  fi
else
  echo "no Python binding was built (see build.log): benchmark not run" >"$bench_log"
fi
say "benchmark: $bench_status"

# --- 6. report -----------------------------------------------------------------
report="$report_dir/report.md"
{
  echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "- GPU: $gpu_name"
  echo "- CUDA: $("$nvcc" --version | tail -n 1)"
  echo "- torch: $("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')"
  echo "- commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "- command: scripts/gpu_check.sh (build: $build_dir, nvcc warnings as errors: $werror)"
  echo
  echo "## Tests"
  echo
  echo "| test | result | gtest summary |"
  echo "|---|---|---|"
  printf '%s\n' "${test_rows[@]}"
  echo
  echo "## GPU stall benchmark ($bench_status)"
  echo
  echo '```'
  cat "$bench_log"
  echo '```'
} >"$report"
say "report: $report"
exit "$failed"
