#!/usr/bin/env bash
# One command for the stall-profiling benchmark (bench/stall/, issue [bench]):
# builds pmsnap_bench_stall and runs it. Extra arguments go to the benchmark
# (--quick for a ~1 minute smoke run, --help for all flags).
#
#   scripts/bench_stall.sh [--quick] [flags...]
#
# Environment: PMSNAP_BUILD_DIR (default build, as scripts/pmsnap.sh), JOBS
# (default 2), PMSNAP_POOL_DIR (pools and checkpoint files; default /dev/shm).
# Results: bench/results/stall.{csv,png}, stall_restore.csv, stall_trials.csv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${PMSNAP_BUILD_DIR:-$root/build}"
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
ninja -C "$build" -j "${JOBS:-2}" pmsnap_bench_stall

exec "$build/bench/pmsnap_bench_stall" "$@"
