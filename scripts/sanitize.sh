#!/usr/bin/env bash
# Sanitizer lanes (issue [faults] part 4): the whole suite under
# AddressSanitizer + UndefinedBehaviorSanitizer, the runtime, engine and
# pool tests under ThreadSanitizer. Each lane has a build folder of its own
# (PMSNAP_SANITIZE, top-level CMakeLists.txt) beside the normal build.
#
#   scripts/sanitize.sh asan [ctest-args...]   build-asan: address,undefined
#   scripts/sanitize.sh tsan [ctest-args...]   build-tsan: thread
#   scripts/sanitize.sh all                    both, one after the other
#
# asan builds everything but the benchmarks and the CUDA device, torch hooks
# and the Python binding included, and runs it in two passes: the C++ tests
# (leak checking on), then the Python tests (python_tests,
# python_ddp_resume_test and gpu_check_script_test, whose CPU smoke run of
# bench/gpu imports the extension, python_lowdiff_test, python_interop_test
# whose peak-memory test skips itself under ASan, python_cpr_test and
# python_cpr_ranks_test) with libasan preloaded into the interpreter, since
# the extension module is instrumented and CPython is not, and with leak
# checking off: CPython and torch keep their interned objects, arenas and
# thread pools until exit on purpose, which LeakSanitizer would list in
# thousands. python_package_test (pip builds a second, uninstrumented copy)
# and fuzz_smoke (scripts/fuzz.sh, its own clang sanitizer build) are left
# out. tsan builds the tests of tests/runtime.cmake and
# tests/pmem_layout.cmake (no libtorch, no Python) and runs them.
#
# Suppressions (tests/sanitizers/): lsan.supp names libpmemobj's own leaks,
# tsan.supp third-party libraries only; neither names pmsnap code.
# Undefined behaviour aborts the test (-fno-sanitize-recover=undefined).
#
# Environment: PMSNAP_SANITIZE_JOBS (build jobs, default 2: the build is
# niced and kept small so a shared machine stays usable), PMSNAP_TEST_JOBS
# (ctest -j, default 2), PMSNAP_DDP_KILLS (torchrun kills of
# python_ddp_resume_test, default 5 here against 20 in the normal suite: each
# launch starts two sanitized interpreters; every kill runs the same code),
# PMSNAP_CRASH_TRIALS (passed on: the crash tests' own defaults otherwise),
# PMSNAP_VENV as for scripts/pmsnap.sh.
# Each lane writes its ctest log to <build>/sanitize-<lane>.log and, per
# sanitizer report, a file <build>/sanitizer-reports/<tool>.<pid>.
#
# Exit status: 0 when every test of the lane passed with no sanitizer report.
set -euo pipefail

lane="${1:-all}"
shift || true
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${PMSNAP_SANITIZE_JOBS:-2}"
test_jobs="${PMSNAP_TEST_JOBS:-2}"
supp="$root/tests/sanitizers"
export PMSNAP_DDP_KILLS="${PMSNAP_DDP_KILLS:-5}"
export PMEM_IS_PMEM_FORCE="${PMEM_IS_PMEM_FORCE:-1}"

# The runtime, engine and pool tests: the TSan lane.
# Every test of tests/runtime.cmake and tests/pmem_layout.cmake but the CUDA
# one (no GPU; the lane builds no CUDA).
tsan_tests=(runtime_engine_test runtime_device_test runtime_epoch_agreement_test
            runtime_engine_ranks_test runtime_sharding_test common_cpu_affinity_test
            runtime_copy_hold_budget_test runtime_engine_power_loss_test
            runtime_async_device_test runtime_staging_ring_test runtime_engine_fork_test
            runtime_engine_staging_test
            manifest_test pool_roundtrip_test pool_bad_input_test
            pool_crash_test cli_test checksum_test pool_prefault_test pool_bad_env_test
            manifest_golden_test pool_power_loss_test pool_pm_bandwidth_test)

configure() {
  local dir="$1"
  shift
  local werror=OFF
  if [[ -n "${CI:-}" ]]; then werror=ON; fi
  cmake -S "$root" -B "$dir" -G Ninja -DPMSNAP_WERROR="$werror" -DPMSNAP_BUILD_BENCH=OFF \
    -DPMSNAP_WITH_CUDA=OFF "$@" >"$dir/configure.log" 2>&1 ||
    { cat "$dir/configure.log" >&2; return 1; }
}

# report_summary DIR: the sanitizer reports written this run (a file with an
# error in it), and which suppressions matched (files with only those).
report_summary() {
  local reports="$1/sanitizer-reports"
  local errors
  errors="$(grep -l -E '^(SUMMARY|ERROR): |WARNING: ThreadSanitizer|runtime error:' \
    "$reports"/* 2>/dev/null || true)"
  local suppressed
  suppressed="$(cat "$reports"/* 2>/dev/null | grep -E '^ *[0-9]+ +[0-9]* *(leak|race|called_from_lib|deadlock|signal|mutex|thread|vptr):' |
    awk '{print $NF}' | sort | uniq -c || true)"
  if [[ -n "$suppressed" ]]; then
    echo "sanitize.sh: suppressions that matched (hits, pattern):"
    echo "$suppressed"
  fi
  if [[ -z "$errors" ]]; then
    echo "sanitize.sh: no sanitizer reports in $reports"
    return 0
  fi
  echo "sanitize.sh: $(echo "$errors" | wc -l) sanitizer report file(s):" >&2
  for f in $errors; do
    echo "== $f" >&2
    head -n 60 "$f" >&2
  done
  return 1
}

run_asan() {
  local dir="$root/build-asan"
  local python
  python="$("$root/scripts/pmsnap.sh" env | tail -1)"
  local torch_cmake
  torch_cmake="$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  mkdir -p "$dir"
  configure "$dir" -DPMSNAP_SANITIZE=address,undefined -DCMAKE_PREFIX_PATH="$torch_cmake" \
    -DPython_EXECUTABLE="$python"
  nice -n 10 cmake --build "$dir" -j "$jobs"
  rm -rf "$dir/sanitizer-reports"
  mkdir -p "$dir/sanitizer-reports"
  local common="log_path=$dir/sanitizer-reports/asan:symbolize=1:print_summary=1"
  local ubsan="print_stacktrace=1:halt_on_error=1:log_path=$dir/sanitizer-reports/ubsan"
  local status=0
  local start=$SECONDS

  echo "sanitize.sh: asan+ubsan, C++ tests ($dir)"
  ASAN_OPTIONS="$common:detect_leaks=1:strict_init_order=1:check_initialization_order=1" \
    LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=1" \
    UBSAN_OPTIONS="$ubsan" \
    nice -n 5 ctest --test-dir "$dir" -j "$test_jobs" --output-on-failure --timeout 1800 \
    -E '^(python_|gpu_check_script_test$|fuzz_smoke$)' "$@" 2>&1 | tee "$dir/sanitize-asan.log" || status=1
  echo "sanitize.sh: C++ tests took $((SECONDS - start)) s"

  start=$SECONDS
  echo "sanitize.sh: asan+ubsan, Python tests with libasan preloaded, leak checking off"
  # libasan first; libstdc++ with it: the interpreter does not link it, and
  # ASan looks up the real __cxa_throw once, at start-up, so a C++ exception
  # thrown by the extension would otherwise abort in ASan's interceptor.
  local preload
  preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
  LD_PRELOAD="$preload" \
    ASAN_OPTIONS="$common:detect_leaks=0" \
    UBSAN_OPTIONS="$ubsan" \
    nice -n 5 ctest --test-dir "$dir" -j "$test_jobs" --output-on-failure \
    -R '^(python_(tests|ddp_resume_test|lowdiff_test|interop_test|cpr_test|cpr_ranks_test)|gpu_check_script_test)$' \
    2>&1 | tee "$dir/sanitize-asan-python.log" ||
    status=1
  echo "sanitize.sh: Python tests took $((SECONDS - start)) s"
  report_summary "$dir" || status=1
  return "$status"
}

# build_tsan_tbb DIR: oneTBB built with -fsanitize=thread into DIR/tbb-install.
# The engine hands work to TBB's workers (task_arena, parallel_for); with
# Debian's uninstrumented libtbb, TSan cannot see the synchronization inside
# it and reports every handoff as a race in the task's own code, which no
# suppression could tell from a real one. So the lane links an instrumented
# oneTBB of the same version as the installed headers (Debian 12: 2021.8.0),
# from PMSNAP_TBB_SOURCE (a oneTBB checkout) or cloned from GitHub.
build_tsan_tbb() {
  local dir="$1"
  local version
  version="$(dpkg-query -W -f='${Version}' libtbb-dev 2>/dev/null | sed 's/-.*//')"
  version="${PMSNAP_TBB_VERSION:-${version:-2021.8.0}}"
  local src="$dir/tbb-src-$version"
  if [[ -f "$dir/tbb-install/.pmsnap-tbb-$version" ]]; then
    return
  fi
  if [[ -n "${PMSNAP_TBB_SOURCE:-}" ]]; then
    rm -rf "$src"
    git clone -q --depth 1 --branch "v$version" "$PMSNAP_TBB_SOURCE" "$src"
  elif [[ ! -d "$src" ]]; then
    git clone -q --depth 1 --branch "v$version" https://github.com/oneapi-src/oneTBB.git "$src"
  fi
  cmake -S "$src" -B "$dir/tbb-build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DTBB_SANITIZE=thread -DTBB_TEST=OFF -DTBB_EXAMPLES=OFF -DTBB_STRICT=OFF \
    -DTBBMALLOC_BUILD=OFF -DCMAKE_INSTALL_PREFIX="$dir/tbb-install" >"$dir/tbb.configure.log" 2>&1 ||
    { cat "$dir/tbb.configure.log" >&2; return 1; }
  nice -n 10 cmake --build "$dir/tbb-build" -j "$jobs"
  cmake --install "$dir/tbb-build" >/dev/null
  touch "$dir/tbb-install/.pmsnap-tbb-$version"
}

run_tsan() {
  local dir="$root/build-tsan"
  mkdir -p "$dir"
  build_tsan_tbb "$dir"
  local tbb_config
  tbb_config="$(dirname "$(find "$dir/tbb-install" -name TBBConfig.cmake | head -1)")"
  configure "$dir" -DPMSNAP_SANITIZE=thread -DPMSNAP_WITH_TORCH=OFF -DPMSNAP_BUILD_PYTHON=OFF \
    -DTBB_DIR="$tbb_config"
  nice -n 10 cmake --build "$dir" -j "$jobs" --target "${tsan_tests[@]}" pmsnap
  rm -rf "$dir/sanitizer-reports"
  mkdir -p "$dir/sanitizer-reports"
  local regex
  regex="^($(IFS='|'; echo "${tsan_tests[*]}"))\\."
  local status=0
  local start=$SECONDS
  echo "sanitize.sh: tsan, runtime, engine and pool tests ($dir)"
  # halt_on_error=0: every race of a test is listed; the test still fails
  # (TSan's exit code 66).
  TSAN_OPTIONS="suppressions=$supp/tsan.supp:print_suppressions=1:halt_on_error=0:second_deadlock_stack=1:log_path=$dir/sanitizer-reports/tsan" \
    nice -n 5 ctest --test-dir "$dir" -j "$test_jobs" --output-on-failure --timeout 3600 \
    -R "$regex" "$@" 2>&1 | tee "$dir/sanitize-tsan.log" || status=1
  echo "sanitize.sh: TSan tests took $((SECONDS - start)) s"
  report_summary "$dir" || status=1
  return "$status"
}

case "$lane" in
  asan) run_asan "$@" ;;
  tsan) run_tsan "$@" ;;
  all)
    status=0
    run_tsan || status=1
    run_asan || status=1
    exit "$status"
    ;;
  *)
    echo "usage: scripts/sanitize.sh asan|tsan|all [ctest-args...]" >&2
    exit 2
    ;;
esac
