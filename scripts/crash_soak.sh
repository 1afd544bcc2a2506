#!/usr/bin/env bash
# SIGKILL soak: N kill trials across the pool, the embedding policies, the
# libtorch engine front end and the Python front end, each trial checked
# bit-exact by the crash test that runs it (README, "Testing crash
# consistency"). Not part of CI: N = 10,000 takes about two hours here.
#
#   scripts/crash_soak.sh N [build-dir]
#
# PMSNAP_SOAK_ONLY="python hooks" runs only those components (still sized as
# their share of N); the CSV keeps the other components' rows of an earlier run.
#
# N is split: 55% pool_crash_test (half on the PM path, half on msync),
# 30% diff_crash_test (all five policies), 10% hooks_resume_test (engine and
# hooks, six optimizers), 5% the Python crash-resume test (two optimizers).
# The tests run in chunks with fresh random seeds, so one failing trial costs
# its chunk, not the soak; every chunk's log is kept. Prints one table row
# per component and writes bench/results/crash_soak.csv and the logs beside it.
set -euo pipefail

total="${1:?usage: scripts/crash_soak.sh N [build-dir]}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${2:-$root/build}"
results="$root/bench/results"
logs="$results/crash_soak_logs"
mkdir -p "$logs"
python="$root/.venv/bin/python"

for binary in pool_crash_test diff_crash_test hooks_resume_test; do
  if [[ ! -x "$build/tests/$binary" ]]; then
    echo "crash_soak: $build/tests/$binary is missing; build first (scripts/pmsnap.sh build)" >&2
    exit 2
  fi
done

only="${PMSNAP_SOAK_ONLY:-pool diff hooks python}"
selected() { [[ " $only " == *" $1 "* ]]; }
for component in $only; do rm -f "$logs/$component"-*.log; done

csv="$results/crash_soak.csv"
previous_rows=""
if [[ -f "$csv" ]]; then
  previous_rows="$(tail -n +2 "$csv")"
fi
echo "component,trials,chunks,failed_chunks,seconds,commit" >"$csv"
while IFS= read -r row; do
  if [[ -n "$row" ]] && ! selected "${row%%,*}"; then echo "$row" >>"$csv"; fi
done <<<"$previous_rows"
commit="$(git -C "$root" rev-parse --short HEAD)"
printf '%-10s %8s %7s %14s %9s\n' component trials chunks failed_chunks seconds

# run_chunks NAME TRIALS PER_CHUNK KILLS_PER_UNIT COMMAND...
# Runs COMMAND with PMSNAP_CRASH_TRIALS=<units> until TRIALS kills are done;
# one unit of PMSNAP_CRASH_TRIALS is KILLS_PER_UNIT kills (diff: 5 policies).
# COMMAND may use $chunk (the chunk number) through `eval`.
run_chunks() {
  local name="$1" trials="$2" per_chunk="$3" per_unit="$4"
  shift 4
  if ! selected "$name"; then return 0; fi
  local done_trials=0 chunks=0 failed=0 start=$SECONDS
  while ((done_trials < trials)); do
    local this=$((trials - done_trials < per_chunk ? trials - done_trials : per_chunk))
    local units=$(((this + per_unit - 1) / per_unit))
    local chunk=$chunks
    local log="$logs/$name-$chunk.log"
    if ! PMSNAP_CRASH_TRIALS="$units" eval "$@" >"$log" 2>&1; then
      failed=$((failed + 1))
      echo "crash_soak: $name chunk $chunk FAILED (log: $log)" >&2
    fi
    done_trials=$((done_trials + units * per_unit))
    chunks=$((chunks + 1))
  done
  local seconds=$((SECONDS - start))
  printf '%-10s %8d %7d %14d %9d\n' "$name" "$done_trials" "$chunks" "$failed" "$seconds"
  echo "$name,$done_trials,$chunks,$failed,$seconds,$commit" >>"$csv"
  ((failed == 0))
}

status=0
cd "$build"
pool_trials=$((total * 55 / 100))
diff_trials=$((total * 30 / 100))
hooks_trials=$((total * 10 / 100))
python_trials=$((total - pool_trials - diff_trials - hooks_trials))

run_chunks pool "$pool_trials" 250 1 \
  'PMEM_IS_PMEM_FORCE=$((chunk % 2)) tests/pool_crash_test' || status=1
run_chunks diff "$diff_trials" 250 5 \
  'PMEM_IS_PMEM_FORCE=1 tests/diff_crash_test --gtest_filter="*EveryRetained*"' || status=1
run_chunks hooks "$hooks_trials" 48 1 \
  'PMEM_IS_PMEM_FORCE=1 tests/hooks_resume_test' || status=1
run_chunks python "$python_trials" 80 2 \
  'PYTHONPATH="$build/python" PMEM_IS_PMEM_FORCE=1 "$python" -m pytest -q -p no:cacheprovider \
     "$root/tests/python/test_crash_resume.py" -k killed_and_resumed' || status=1

echo "crash_soak: wrote $csv (logs in $logs)"
exit $status
