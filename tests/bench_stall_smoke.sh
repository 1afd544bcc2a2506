#!/usr/bin/env bash
# The stall benchmark end to end at a tiny size (issue [bench]). Every
# restore runs in a fresh child process of the benchmark, so this checks the
# round trip: stall_restore.csv must hold a timed restore of each kind on
# each device, pmsnap's paired against torch::load, and the training table
# the methods asked for.
#   bench_stall_smoke.sh <path to pmsnap_bench_stall>
set -euo pipefail
bench="$1"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

"$bench" --workloads=transformer --devices=host,simulated \
  --methods=pmsnap-adaptive-k1,pmsnap-adaptive-cont-staged,torch-save-k2,checkfreq-k1 --k=2 --sweep=1 \
  --tf-dim=64 --tf-layers=1 --tf-heads=2 --tf-seq=8 --tf-batch=2 \
  --iters=4 --warmup=1 --repeats=1 --target-rounds=1 --trial-seconds=0.05 \
  --restore-rounds=2 --out="$out" --no-plot --dir="${PMSNAP_POOL_DIR:-/dev/shm}"

fail() { echo "bench_stall_smoke: $*" >&2; exit 1; }
restores="$out/stall_restore.csv"
[[ -s "$restores" ]] || fail "no $restores"
for device in host simulated; do
  for method in none torch-save-k2 checkfreq-k1 pmsnap-adaptive-k1 pmsnap-adaptive-cont-staged; do
    grep -q "^transformer,$device,$method," "$out/stall.csv" ||
      fail "stall.csv has no row for $device/$method"
  done
  for restore in pmsnap-verify pmsnap-noverify torch-load; do
    # columns: workload,device,method,open_ms,restore_ms,total_ms,bytes,speedup,min,max
    row="$(grep "^transformer,$device,$restore," "$restores")" ||
      fail "no $device/$restore restore in $restores"
    awk -F, -v r="$restore" '{
      if ($6 <= 0 || $7 <= 0) exit 1;            # timed, and moved bytes
      if (r != "torch-load" && $8 <= 0) exit 1;  # paired against torch::load
    }' <<<"$row" || fail "$device/$restore row is incomplete: $row"
  done
done
# The overhead's bootstrap interval brackets its median; training-thread
# counters are positive where the kernel offers them (nan where it does not).
python3 - "$out/stall.csv" <<'PY' || fail "stall.csv: overhead interval, training-thread counters or peak RSS wrong"
import csv, math, sys
for row in csv.DictReader(open(sys.argv[1])):
    low, mid, high = (float(row[k]) for k in
                      ("overhead_ci95_low_pct", "overhead_pct", "overhead_ci95_high_pct"))
    assert low <= mid + 1e-9 <= high + 2e-9, row
    ipc = float(row["training_ipc"])
    assert math.isnan(ipc) or ipc > 0, row
    # Cold start (the warm-up iterations) and page faults, reported apart.
    assert float(row["cold_ms"]) > 0, row
    assert float(row["faults_per_iter"]) >= 0 and float(row["cold_faults_per_iter"]) >= 0, row
    # Peak resident set per method (reset before each) and its excess over none's.
    assert float(row["peak_rss_mb"]) > 0, row
    assert not math.isnan(float(row["extra_peak_rss_mb"])), row
PY
echo "bench_stall_smoke: restores in fresh processes on host and simulated: ok"
