#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/) with clang in their own build
# folder, seeds their corpora from real pools, replays the regression corpus
# (tests/fuzz/regressions/<target>/: every input that ever found a bug), and
# runs each target.
#
#   scripts/fuzz.sh [seconds-per-target] [target...]   open-ended fuzzing
#   scripts/fuzz.sh --smoke [target...]                what CI runs
#
# Open-ended (default 600 seconds for each of pool_open_fuzz, manifest_fuzz,
# chunk_payload_fuzz and extra_state_fuzz, one after the other): a random
# libFuzzer seed, a corpus that grows across runs. A finding lands in
# findings/<target>/; fix it, then copy the input into
# tests/fuzz/regressions/<target>/ (named after the bug) so every later run
# replays it.
#
# --smoke (CTest's fuzz_smoke, tests/fuzz.cmake): the regression corpus, then
# a fixed number of inputs per target from the seed corpus alone with
# libFuzzer's -seed=$PMSNAP_TEST_SEED (fixed default): the same inputs on
# every machine, so it finds nothing new by chance; new findings are the
# open-ended run's job. Inputs: $PMSNAP_FUZZ_SMOKE_RUNS, else 3000 for
# pool_open_fuzz (each opens a pool: about 45 s on a 2-vCPU VM) and 100000
# for the others (about a second each).
#
# Environment: PMSNAP_FUZZ_BUILD_DIR (default build-fuzz), PMSNAP_FUZZ_JOBS
# (targets run at once, default 1), PMSNAP_POOL_DIR (default /dev/shm).
# Layout under the build folder: corpus/<target>/ grows across runs (kept),
# seeds/<target>/ is regenerated each run, findings/<target>/ receives
# crashing inputs, logs/<target>.log libFuzzer's output, summary.txt one line
# per target.
#
# Exit status: 0 when every target ran clean, 1 on a finding or a build
# failure, 77 when clang with libFuzzer is missing (CTest reports a skip).
set -euo pipefail

smoke=0
if [[ "${1:-}" == --smoke ]]; then
  smoke=1
  shift
fi
seconds=600
if ((!smoke)) && [[ "${1:-}" =~ ^[0-9]+$ ]]; then
  seconds="$1"
  shift
fi
test_seed="${PMSNAP_TEST_SEED:-20261127}"  # tests/testutil/test_seed.h's default
regressions="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tests/fuzz/regressions"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${PMSNAP_FUZZ_BUILD_DIR:-$root/build-fuzz}"
jobs="${PMSNAP_FUZZ_JOBS:-1}"
targets=("$@")
if ((${#targets[@]} == 0)); then
  targets=(pool_open_fuzz manifest_fuzz chunk_payload_fuzz extra_state_fuzz)
fi
export PMEM_IS_PMEM_FORCE="${PMEM_IS_PMEM_FORCE:-1}"

probe_dir="$(mktemp -d)"
trap 'rm -rf "$probe_dir"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' \
  >"$probe_dir/probe.cc"
if ! command -v clang++ >/dev/null ||
  ! clang++ -fsanitize=fuzzer,address,undefined "$probe_dir/probe.cc" -o "$probe_dir/probe" \
    2>"$probe_dir/probe.log"; then
  echo "fuzz.sh: SKIP: clang++ with libFuzzer is not installed (scripts/pmsnap.sh installs" \
    "clang and libclang-rt-dev)" >&2
  exit 77
fi

werror=OFF
if [[ -n "${CI:-}" ]]; then werror=ON; fi
cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DPMSNAP_FUZZ=ON -DPMSNAP_WERROR="$werror" -DPMSNAP_WITH_TORCH=OFF -DPMSNAP_WITH_CUDA=OFF \
  -DPMSNAP_BUILD_TESTS=OFF -DPMSNAP_BUILD_BENCH=OFF -DPMSNAP_BUILD_PYTHON=OFF >/dev/null
cmake --build "$build_dir" --target pmsnap_fuzz -j "$(nproc)"

rm -rf "$build_dir/seeds"
"$build_dir/tests/fuzz/pmsnap-fuzz-seeds" "$build_dir/seeds"
mkdir -p "$build_dir/logs"
: >"$build_dir/summary.txt"
touch "$build_dir/logs/run-start"  # findings newer than this are this run's

# Replays the regression corpus of one target (each input once); prints the
# inputs that fail.
replay_regressions() {
  local target="$1"
  local dir="$regressions/$target"
  [[ -d "$dir" ]] || return 0
  local inputs=()
  mapfile -t inputs < <(find "$dir" -type f | sort)
  ((${#inputs[@]} > 0)) || return 0
  local log="$build_dir/logs/$target.regressions.log"
  if ! "$build_dir/tests/fuzz/$target" -runs=1 "${inputs[@]}" >"$log" 2>&1; then
    echo "fuzz.sh: $target fails on its regression corpus ($dir); last lines of $log:" >&2
    tail -n 40 "$log" >&2
    return 1
  fi
  echo "$target: replayed ${#inputs[@]} regression input(s)" | tee -a "$build_dir/summary.txt"
}

# Runs one target; prints its summary line. libFuzzer's exit status is
# nonzero on a finding (the input lands in findings/<target>/).
run_target() {
  local target="$1"
  mkdir -p "$build_dir/corpus/$target" "$build_dir/findings/$target"
  replay_regressions "$target" || return 1
  local log="$build_dir/logs/$target.log"
  local status=0
  local budget=(-max_total_time="$seconds")
  local corpus="$build_dir/corpus/$target"
  if ((smoke)); then
    # A fresh corpus each time: what a fixed seed explores must not depend
    # on what earlier runs on this machine added.
    corpus="$build_dir/smoke-corpus/$target"
    rm -rf "$corpus"
    mkdir -p "$corpus"
    local runs=100000
    if [[ "$target" == pool_open_fuzz ]]; then runs=3000; fi
    runs="${PMSNAP_FUZZ_SMOKE_RUNS:-$runs}"
    budget=(-runs="$runs" -seed="$test_seed")
  fi
  "$build_dir/tests/fuzz/$target" "${budget[@]}" -timeout=30 -rss_limit_mb=4096 \
    -print_final_stats=1 -artifact_prefix="$build_dir/findings/$target/" \
    "$corpus" "$build_dir/seeds/${target%_fuzz}" >"$log" 2>&1 || status=$?
  local execs cov ft corpus_files
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
  cov="$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)"
  ft="$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)"
  corpus_files="$(find "$corpus" -type f | wc -l)"
  local findings
  findings="$(find "$build_dir/findings/$target" -type f -newer "$build_dir/logs/run-start" | wc -l)"
  local what="${seconds}s"
  if ((smoke)); then what="smoke ${budget[0]#-} seed=$test_seed"; fi
  local line="$target: $what execs=${execs:-?} cov=${cov:-?} ft=${ft:-?} corpus=$corpus_files findings=$findings exit=$status"
  echo "$line" | tee -a "$build_dir/summary.txt"
  if ((status != 0)); then
    echo "fuzz.sh: $target failed; last lines of $log:" >&2
    tail -n 40 "$log" >&2
  fi
  return "$status"
}

failed=0
running=0
for target in "${targets[@]}"; do
  run_target "$target" &
  running=$((running + 1))
  if ((running >= jobs)); then
    wait -n || failed=1
    running=$((running - 1))
  fi
done
while ((running > 0)); do
  wait -n || failed=1
  running=$((running - 1))
done
exit "$failed"
