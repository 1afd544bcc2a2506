#!/usr/bin/env python3
"""Markdown tables of a stall run for bench/RESULTS.md.

    python3 bench/stall_tables.py [RESULTS_DIR [TAG]]   (bench/results, stall)
"""
import csv
import sys

results = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
tag = sys.argv[2] if len(sys.argv) > 2 else "stall"

print("| workload | device | method | median ms | p99 ms | overhead % (range over rounds) "
      "| step ms (extra: step / fwd+bwd) "
      "| stall ms/it (conflict / boundary / copy / save / hook) | ckpt/min | MB/it | k<3.5% |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for r in csv.DictReader(open(f"{results}/{tag}.csv")):
    if int(r["rounds"]) == 0:
        print(f"| {r['workload']} | {r['device']} | {r['method']} | FAILED: {r['note']} |")
        continue
    f = lambda k: float(r[k])
    none = r["method"] == "none"
    overhead = "+0.0" if none else "%+.1f (%+.1f..%+.1f)" % (
        f("overhead_pct"), f("overhead_min_pct"), f("overhead_max_pct"))
    step = "%.0f" % f("step_ms") if none else "%.0f (%+.1f / %+.1f)" % (
        f("step_ms"), f("extra_step_ms"), f("extra_forward_backward_ms"))
    k = r["k_under_3.5pct"]
    k = "-" if k in ("0", "") else k
    print("| %s | %s | %s | %.0f | %.0f | %s | %s | %.2f (%.2f / %.2f / %.2f / %.2f / %.2f) "
          "| %.0f | %.0f | %s |" % (
              r["workload"], r["device"], r["method"], f("median_ms"), f("p99_ms"), overhead, step,
              f("stall_ms_per_iter"), f("conflict_ms"), f("boundary_ms"), f("copy_ms"),
              f("save_ms"), f("hook_ms"), f("commits_per_min"), f("mb_written_per_iter"), k))
print()
print("| workload | device | restore | open ms | copy/load ms | total ms | MB "
      "| torch::load / this (paired rounds: median, range) |")
print("|---|---|---|---|---|---|---|---|")
for r in csv.DictReader(open(f"{results}/{tag}_restore.csv")):
    f = lambda k: float(r[k])
    speedup = "-" if r["method"] == "torch-load" else "%.1fx (%.1f-%.1fx)" % (
        f("speedup_vs_torch_load"), f("speedup_min"), f("speedup_max"))
    print("| %s | %s | %s | %.1f | %.1f | %.1f | %.0f | %s |" % (
        r["workload"], r["device"], r["method"], f("open_ms"), f("restore_ms"), f("total_ms"),
        f("bytes") / 1e6, speedup))
