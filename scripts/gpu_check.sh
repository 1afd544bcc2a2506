#!/usr/bin/env bash
# The GPU checks in one command, for a GPU machine without network access
# (ours: an H100/H200, CUDA 13, torch 2.11 in /opt/torch/.venv, Python 3.12,
# no PMDK or oneTBB installed). README.md, "Checking the GPU path", says what
# it checks. Budget: at most 8 minutes on a 16-core GPU machine, build
# included (PMSNAP_GPU_BENCH_ARGS trims the benchmark where time is short).
#
#   scripts/gpu_check.sh         build, run every GPU item, write the report
#   scripts/gpu_check.sh deps    only unpack the bundled packages and print
#                                the environment a build would use
#
# 1. Stops with exit code 2 and says so when no GPU is visible (nvidia-smi,
#    else torch.cuda): there is nothing to check on such a machine; the
#    CUDA rules are modelled by the simulated device in the normal suite.
# 2. Unpacks PMDK, oneTBB, xxHash, GoogleTest, pybind11 and pkgconf from
#    third_party/debs/*.deb (Debian 12 packages, fetched with `apt-get
#    download`; no root, no network) into the build folder, and finds every
#    package there alone (PKG_CONFIG_LIBDIR), so a missing .deb fails.
# 3. Builds the CUDA device, its tests, the libtorch hooks against the
#    wheel's libtorch, and the Python extension (nvcc warnings as errors).
# 4. Items, each passed or FAILED in the report:
#    - cuda-tests: the CUDA C++ tests (runtime_cuda_test: bit-exact resume
#      under each strategy, pools opened and closed in one process, no CUDA
#      error left behind; the staging ring) and the event-ordering and
#      registration tests that also run without a GPU;
#    - cuda-tests-launch-blocking: runtime_cuda_test and runtime_device_test
#      again with CUDA_LAUNCH_BLOCKING=1 (a hang fails after 120 s);
#    - hooks: the libtorch hooks' tests, built against the wheel's libtorch;
#    - extension: the Python extension owns its C++ runtime, and `python -m
#      pmsnap verify|info|list|export` run after `import torch`;
#    - python-cuda: SIGKILL/resume bit-exact on CUDA for SGD, Adam, AdamW
#      (foreach, fused, capturable, single-tensor), Adagrad and RMSprop,
#      every=1 and continuous, each conflict strategy, updates inside
#      backward, `python -m pmsnap verify` after each kill; pools opened,
#      closed and reopened beside pinned-memory work, forward/backward after;
#    - benchmark: bench/gpu/gpu_stall.py (pmsnap against no checkpoint, DCP
#      async_save and a CheckFreq-style snapshot; GPU-side stall from CUDA
#      events; D2H rate against the card's pinned D2H bandwidth).
# 5. Writes the report, $report_dir/report.md (one line per item, the
#    benchmark table), with every log beside it; exits 1 if any item failed.
#
# Environment: PMSNAP_GPU_PYTHON (default /opt/torch/.venv/bin/python, else
# python3), PMSNAP_GPU_BUILD_DIR (default build-gpu), PMSNAP_GPU_REPORT_DIR
# (default bench/results/gpu_check), PMSNAP_DEBS_DIR (default
# third_party/debs), PMSNAP_POOL_DIR (default /dev/shm), PMSNAP_GPU_WERROR
# (default ON), PMSNAP_GPU_BENCH_ARGS (extra benchmark arguments),
# PMSNAP_GPU_JOBS (build jobs, default nproc), PMSNAP_GPU_ITEMS (the items to
# run, comma-separated; default all), PMSNAP_GPU_DEADLINE_S (default 480: the
# benchmark gets what is left of these seconds, counted from the start, as
# its --time-budget, less a margin for the report, and runs as many rounds as
# fit); PMSNAP_GPU_CHECK_REHEARSAL=1 runs every step without a GPU (to test
# this script; the report says so).
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
deadline_s="${PMSNAP_GPU_DEADLINE_S:-480}"

say() { echo "gpu_check: $*" >&2; }
die() {
  say "$2"
  exit "$1"
}

case "$mode" in
  all | deps) ;;
  -h | --help | help)
    sed -n '2,54p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
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
# The bundle only: PKG_CONFIG_LIBDIR replaces pkg-config's system folders,
# so a package missing from third_party/debs fails here on every machine,
# also on one that has it installed (libpmemobj.pc requires libndctl.pc and
# libdaxctl.pc: the first GPU run stopped on that).
export PKG_CONFIG_LIBDIR="$multiarch/pkgconfig:$deps/usr/share/pkgconfig"
unset PKG_CONFIG_PATH
export LD_LIBRARY_PATH="$multiarch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
pkg_config="$(command -v pkg-config || true)"
if [[ -z "$pkg_config" && -x "$deps/usr/bin/pkgconf" ]]; then
  pkg_config="$deps/usr/bin/pkgconf"
fi
prefix_path="$deps/usr;$multiarch/cmake;$deps/usr/share/cmake;$deps/usr/lib/cmake"

if [[ "$mode" == deps ]]; then
  echo "PKG_CONFIG_LIBDIR=$PKG_CONFIG_LIBDIR"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo "CMAKE_PREFIX_PATH=$prefix_path"
  echo "PKG_CONFIG=${pkg_config:-none}"
  for module in libpmem libpmemobj libxxhash tbb gtest gmock; do
    # --cflags --libs: resolves every module the .pc requires, private too.
    if [[ -n "$pkg_config" ]] && why="$("$pkg_config" --cflags --libs --static "$module" 2>&1)"; then
      echo "found $module $("$pkg_config" --modversion "$module") in $("$pkg_config" --variable=libdir "$module")"
    else
      die 3 "$module not found in the bundle ($deps, from $debs_dir): ${why:-no pkg-config}"
    fi
  done
  for config in TBB/TBBConfig.cmake GTest/GTestConfig.cmake; do
    [[ -f "$multiarch/cmake/$config" ]] || die 3 "$config not found in $multiarch/cmake"
    echo "found $config in $multiarch/cmake"
  done
  for header in libpmemobj.h libpmem.h xxhash.h oneapi/tbb.h gtest/gtest.h pybind11/pybind11.h; do
    [[ -f "$deps/usr/include/$header" ]] || die 3 "$header not found in $deps/usr/include"
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
items="${PMSNAP_GPU_ITEMS:-cuda-tests,cuda-tests-launch-blocking,hooks,extension,python-cuda,benchmark}"
wanted() { [[ ",$items," == *",$1,"* ]]; }
# The wheel's libtorch for the hooks, where the interpreter has torch.
torch_prefix=""
if wanted hooks; then
  torch_prefix="$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' \
    2>/dev/null || true)"
fi
with_torch=OFF
if [[ -n "$torch_prefix" ]]; then with_torch=ON; fi
cuda_tests=(runtime_cuda_test runtime_device_test runtime_async_device_test
  runtime_staging_ring_test runtime_registration_test conflict_async_ordering_test)
hooks_tests=(hooks_checkpointed_optimizer_test hooks_resume_test)
failed=0
item_rows=()
# Records one item: name, passed|FAILED|skipped, what it ran.
record() {
  item_rows+=("| $1 | $2 | $3 |")
  say "$1: $2"
  if [[ "$2" == FAILED ]]; then failed=1; fi
}
configure() {
  cmake -S "$root" -B "$build_dir" "${generator[@]}" \
    -DPMSNAP_WITH_CUDA=ON -DPMSNAP_WITH_TORCH="$with_torch" -DPMSNAP_BUILD_BENCH=OFF \
    -DPMSNAP_WERROR="$1" -DCMAKE_CUDA_COMPILER="$nvcc" \
    -DCMAKE_PREFIX_PATH="$prefix_path${torch_prefix:+;$torch_prefix}" \
    -DPKG_CONFIG_EXECUTABLE="$pkg_config" -DPython_EXECUTABLE="$python"
}
build() { cmake --build "$build_dir" -j "$jobs" --target "$@"; }
# The library and the CUDA tests, configured with warnings as errors ON|OFF.
build_core() { configure "$1" && build "${cuda_tests[@]}" pmsnap; }
say "building in $build_dir (log: $log)"
# The library and the CUDA tests are needed by every item; a compiler that
# warns where CI's does not is reported, and the build goes on without
# warnings as errors so that the items still run.
if ! build_core "$werror" >"$log" 2>&1; then
  if [[ "$werror" != ON ]]; then
    die 4 "build failed; the last lines of $log:
$(tail -n 30 "$log")"
  fi
  record build-warnings-as-errors FAILED \
    "$(grep -m 3 -E 'error|warning' "$log" | tr '\n|' ';/' | cut -c1-600) (log: $log)"
  werror=OFF
  if ! build_core OFF >>"$log" 2>&1; then
    die 4 "build failed also without warnings as errors; the last lines of $log:
$(tail -n 30 "$log")"
  fi
fi
if wanted extension || wanted python-cuda || wanted benchmark; then
  build pmsnap_python >>"$log" 2>&1 ||
    record extension-build FAILED "the Python extension did not build (log: $log)"
fi
hooks_built=no
if [[ "$with_torch" == ON ]] &&
  build "${hooks_tests[@]}" hooks_resume_trainer >>"$log" 2>&1; then
  hooks_built=yes
fi

# --- 4. items --------------------------------------------------------------------
export PMSNAP_POOL_DIR="$pool_dir" PMEM_IS_PMEM_FORCE=1
gtest_binary() { find "$build_dir/tests" -maxdepth 2 -type f -name "$1" | head -n 1; }
# Runs gtest binaries with `timeout` seconds each (extra env before them);
# prints what ran; returns 1 if any failed or hung.
run_gtests() {
  local tag="$1" timeout_s="$2"
  shift 2
  local status=0 test binary test_log
  for test in "$@"; do
    binary="$(gtest_binary "$test")"
    test_log="$report_dir/$test$tag.log"
    if [[ -z "$binary" ]] || ! timeout "$timeout_s" "$binary" >"$test_log" 2>&1; then
      status=1
      echo "$test FAILED (log: $test_log)"
    else
      echo "$test: $(grep -E '^\[  (PASSED|SKIPPED) +\] [0-9]+ tests?' "$test_log" | tr '\n' ' ')"
    fi
  done
  return "$status"
}

if wanted cuda-tests; then
  status=passed
  summary="$(run_gtests "" 150 "${cuda_tests[@]}")" || status=FAILED
  if [[ -z "${PMSNAP_GPU_CHECK_REHEARSAL:-}" ]] &&
    grep -q '^\[  SKIPPED \]' "$report_dir/runtime_cuda_test.log" 2>/dev/null; then
    summary+=" (runtime_cuda_test skipped tests although a GPU is visible)"
    status=FAILED
  fi
  record cuda-tests "$status" "$(echo "$summary" | tr '\n' ';')"
fi
if wanted cuda-tests-launch-blocking; then
  status=passed
  summary="$(CUDA_LAUNCH_BLOCKING=1 run_gtests .launch-blocking 120 runtime_cuda_test \
    runtime_device_test)" || status=FAILED
  record cuda-tests-launch-blocking "$status" "$(echo "$summary" | tr '\n' ';')"
fi
if wanted hooks; then
  if [[ "$hooks_built" == yes ]]; then
    status=passed
    summary="$(run_gtests "" 150 "${hooks_tests[@]}")" || status=FAILED
    record hooks "$status" "$(echo "$summary" | tr '\n' ';')"
  elif [[ "$with_torch" == ON ]]; then
    record hooks FAILED "the hooks did not build against $torch_prefix (log: $log)"
  else
    record hooks FAILED "no torch in $python: the hooks were not built"
  fi
fi
# Runs pytest on tests/python files against the built package; extra env first.
run_pytest() {
  local tag="$1"
  shift
  local test_log="$report_dir/pytest-$tag.log"
  if PYTHONPATH="$build_dir/python" PMSNAP_CLI="$build_dir/tools/pmsnap" timeout 300 \
    "$python" -m pytest -q -p no:cacheprovider "$@" >"$test_log" 2>&1; then
    tail -n 1 "$test_log"
  else
    echo "FAILED: $(tail -n 1 "$test_log") (log: $test_log)"
    return 1
  fi
}
if wanted extension; then
  status=passed
  summary="$(run_pytest extension "$root/tests/python/test_extension_symbols.py")" ||
    status=FAILED
  record extension "$status" "$summary"
fi
if wanted python-cuda; then
  status=passed
  device=cuda
  if [[ -n "${PMSNAP_GPU_CHECK_REHEARSAL:-}" && -z "$("$python" -c \
    'import torch; print(torch.cuda.is_available() or "")' 2>/dev/null)" ]]; then
    device=cpu  # a rehearsal: the same tests on the CPU
  fi
  # The crash/resume cases in shards at once (PMSNAP_TEST_SHARD; one per
  # two cores, 2 to 8), the lifetime tests beside them.
  shards=$(($(nproc) / 2))
  ((shards >= 2)) || shards=2
  ((shards <= 8)) || shards=8
  pids=()
  for ((shard = 0; shard < shards; shard++)); do
    PMSNAP_TEST_DEVICE="$device" PMSNAP_TEST_SHARD="$shard/$shards" \
      run_pytest "python-cuda-$shard" "$root/tests/python/test_crash_resume.py" \
      >"$report_dir/python-cuda-$shard.summary" &
    pids+=("$!")
  done
  PMSNAP_TEST_DEVICE="$device" run_pytest python-cuda-lifetime \
    "$root/tests/python/test_gpu_lifetime.py" >"$report_dir/python-cuda-lifetime.summary" ||
    status=FAILED
  for pid in "${pids[@]}"; do wait "$pid" || status=FAILED; done
  summary="$(cat "$report_dir"/python-cuda-*.summary | tr '\n' ';')"
  record python-cuda "$status" "device $device: $summary"
fi

bench_log="$report_dir/gpu_stall.log"
bench_status=skipped
if wanted benchmark; then
  bench_status=passed
  # What is left of the deadline, less 15 s for the report; a benchmark
  # that overruns its budget by more than a minute is stopped.
  budget_s=$((deadline_s - SECONDS - 15))
  if ((budget_s < 30)); then
    bench_status=FAILED
    bench_note="not run: ${budget_s} s left of PMSNAP_GPU_DEADLINE_S=$deadline_s"
  else
    bench_note="time budget $budget_s s; log: $bench_log"
    # shellcheck disable=SC2086 # PMSNAP_GPU_BENCH_ARGS is a list of arguments
    if ! PYTHONPATH="$build_dir/python" timeout $((budget_s + 60)) "$python" \
      "$root/bench/gpu/gpu_stall.py" --csv "$report_dir/gpu_stall.csv" \
      --time-budget "$budget_s" ${PMSNAP_GPU_BENCH_ARGS:-} >"$bench_log" 2>&1; then
      bench_status=FAILED
    fi
  fi
  record benchmark "$bench_status" "$bench_note"
fi

# --- 5. report -----------------------------------------------------------------
report="$report_dir/report.md"
{
  echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "- GPU: $gpu_name"
  echo "- CUDA: $("$nvcc" --version | tail -n 1)"
  echo "- torch: $("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')"
  echo "- commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "- command: scripts/gpu_check.sh (build: $build_dir, nvcc warnings as errors: $werror," \
    "hooks against the wheel's libtorch: $with_torch)"
  echo "- result: $([[ $failed -eq 0 ]] && echo 'every item passed' || echo 'FAILED')," \
    "in $SECONDS s"
  echo
  echo "## Items"
  echo
  echo "| item | result | what ran |"
  echo "|---|---|---|"
  printf '%s\n' "${item_rows[@]}"
  echo
  echo "## GPU stall benchmark ($bench_status)"
  echo
  echo '```'
  [[ -f "$bench_log" ]] && cat "$bench_log"
  echo '```'
} >"$report"
say "report: $report"
exit "$failed"
