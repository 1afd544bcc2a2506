#!/usr/bin/env bash
# Hunts flaky tests before users meet them: runs the randomized and
# multi-process tests ROUNDS times, each round with a fresh PMSNAP_TEST_SEED,
# while a CPU hog keeps every core busy beside them (a loaded CI machine),
# and reports each failure with its seed and log.
#
#   scripts/flake_hunt.sh [rounds] [ctest -R regex]
#
# Needs a build (scripts/pmsnap.sh build). Defaults: 20 rounds; the tests
# below (crash and SIGKILL trials, power-loss images, fork and rank tests,
# the torchrun suites: DDP, FSDP2, torchrec; the Lightning and HF Trainer
# kill tests). Seeds are drawn from /dev/urandom here, on purpose; a failing
# seed reproduces with
#   PMSNAP_TEST_SEED=<seed> ctest --test-dir build -R '<test>'
#
# Environment: PMSNAP_BUILD_DIR (default build), PMSNAP_FLAKE_HOGS (busy
# processes beside the tests, default: one per core; 0 for none),
# PMSNAP_FLAKE_LOG (default build/flake_hunt). Writes summary.txt there:
# one line per round (seed, seconds, failures) and a last line with totals.
# Exit status: 0 when every round passed, 1 otherwise.
set -euo pipefail

rounds="${1:-20}"
default_regex='crash|power_loss|resume|ranks|agreement|fork|c10d|lowdiff|cpr|ddp|staging|registration|training_state|lightning|python_hf|sharded|torchrec'
regex="${2:-$default_regex}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${PMSNAP_BUILD_DIR:-$root/build}"
log_dir="${PMSNAP_FLAKE_LOG:-$build_dir/flake_hunt}"
hogs="${PMSNAP_FLAKE_HOGS:-$(nproc)}"

if [[ ! -f "$build_dir/CTestTestfile.cmake" ]]; then
  echo "flake_hunt.sh: no build in $build_dir (run scripts/pmsnap.sh build first)" >&2
  exit 2
fi
mkdir -p "$log_dir"
summary="$log_dir/summary.txt"
: >"$summary"

hog_pids=()
stop_hogs() {
  for pid in "${hog_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap stop_hogs EXIT
for ((i = 0; i < hogs; i++)); do
  # A busy loop at normal priority: the tests compete for every core.
  bash -c 'while :; do :; done' &
  hog_pids+=("$!")
done

listed="$( (cd "$build_dir" && ctest -N -R "$regex") | grep -c 'Test *#')" || listed=0
echo "flake_hunt: $rounds rounds of $listed tests matching '$regex', $hogs CPU hog(s)" |
  tee -a "$summary"

failed_rounds=0
for ((round = 1; round <= rounds; round++)); do
  seed="$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')"
  round_log="$log_dir/round-$round-seed-$seed.log"
  start=$SECONDS
  status=0
  (cd "$build_dir" && PMSNAP_TEST_SEED="$seed" ctest -R "$regex" -j "$(nproc)" \
    --output-on-failure --timeout 1800) >"$round_log" 2>&1 || status=$?
  failures="$(sed -n 's/^ *[0-9]* - \(.*\) (.*)$/\1/p' "$round_log" | tr '\n' ' ')"
  line="round $round seed=$seed $((SECONDS - start))s"
  if ((status == 0)); then
    line+=" passed"
    rm -f "$round_log"
  else
    failed_rounds=$((failed_rounds + 1))
    line+=" FAILED: ${failures:-ctest exit $status} (log: $round_log)"
  fi
  echo "$line" | tee -a "$summary"
done
echo "flake_hunt: $((rounds - failed_rounds)) of $rounds rounds passed, $failed_rounds failed" |
  tee -a "$summary"
((failed_rounds == 0))
