#!/usr/bin/env python3
"""Tables for bench/stall at three simulated PM points (issue [perf] part 1).

Reads the stall benchmark's CSVs of runs made under the PM bandwidth model
(PMSNAP_PM_WRITE_GBPS / PMSNAP_PM_READ_GBPS; tags stall_pm_<point>) and
prints, per point, workload and pmsnap method:

  * checkpoints per minute against the physical limit: the PM's write
    bandwidth over the bytes per checkpoint, and no more than one per
    iteration of `none` (a checkpoint captures a step); target >= 90%;
  * training overhead over `none` in the same rounds (target <= 1%);
  * restore time against the read bandwidth (bytes / read rate).

Then a computed table (labelled as such, no measurement): the largest model
that can checkpoint every iteration at each point for a given iteration
time, dense (Adam: 12 B per parameter) and DLRM-like with the embedding
tables written in full, differentially and differentially with 4-bit
quantization (bytes ratios measured by bench/embedding: full 63.69 MB per
interval, intermittent differential 15.05, intermittent + 4-bit 4.84).

    python3 bench/pm_points.py [results dir] [prefix]   # writes pm_points.csv there

`prefix` (default stall_pm_) picks the runs: stall_pm_quiet_ reads
stall_pm_quiet_<point>.csv and writes stall_pm_quiet_points.csv.

Everything here is simulated PM: pools in DRAM held to the modelled rates.
"""

import csv
import os
import sys

POINTS = [  # name, label, write GB/s, read GB/s
    ("optane1", "1-DIMM Optane", 2.3, 6.6),
    ("optane6", "6-DIMM Optane", 13.9, 39.4),
    ("cxl", "CXL Gen5 x8", 32.0, 32.0),
]
# bench/embedding (RESULTS.md "embedding"): MB per interval against full.
DIFF_RATIO = 63.69 / 15.05
DIFF_QUANT_RATIO = 63.69 / 4.84


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main():
    results = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results")
    prefix = sys.argv[2] if len(sys.argv) > 2 else "stall_pm_"
    rows = []
    for name, label, write, read in POINTS:
        path = os.path.join(results, f"{prefix}{name}.csv")
        if not os.path.exists(path):
            print(f"{label}: no {path}; run the stall benchmark for it first")
            continue
        stall = read_csv(path)
        restores = {}
        restore_path = os.path.join(results, f"{prefix}{name}_restore.csv")
        if os.path.exists(restore_path):
            for r in read_csv(restore_path):
                restores[(r["workload"], r["method"])] = r
        none = {r["workload"]: r for r in stall if r["method"] == "none"}
        for r in stall:
            if not r["method"].startswith("pmsnap") or r["workload"] not in none:
                continue
            per_iter_mb = float(r["mb_written_per_iter"])
            its_per_commit = float(r["iterations_per_commit"] or 0)
            bytes_per_ckpt = per_iter_mb * its_per_commit * 1e6
            none_ms = float(none[r["workload"]]["mean_ms"])
            pm_limit = write * 1e9 / bytes_per_ckpt * 60 if bytes_per_ckpt > 0 else float("nan")
            iter_limit = 60e3 / none_ms
            limit = min(pm_limit, iter_limit)
            achieved = float(r["commits_per_min"])
            restore = next((v for (w, m), v in restores.items()
                            if w == r["workload"] and m.startswith("pmsnap")), None)
            restore_ms = float(restore["restore_ms"]) if restore else float("nan")
            restore_bytes = float(restore["bytes"]) if restore else float("nan")
            rows.append(dict(
                point=label, write_gbps=write, read_gbps=read, workload=r["workload"],
                method=r["method"], mb_per_checkpoint=bytes_per_ckpt / 1e6, none_ms=none_ms,
                ckpt_per_min=achieved, pm_limit_per_min=pm_limit,
                iteration_limit_per_min=iter_limit,
                pct_of_limit=100 * achieved / limit if limit > 0 else float("nan"),
                overhead_pct=float(r["overhead_pct"]),
                overhead_min_pct=float(r["overhead_min_pct"]),
                overhead_max_pct=float(r["overhead_max_pct"]),
                stall_ms_per_iter=float(r["stall_ms_per_iter"]),
                restore_ms=restore_ms,
                restore_at_read_rate_ms=restore_bytes / (read * 1e9) * 1e3,
                pm=r.get("pm", "")))
    if rows:
        out = os.path.join(results, "pm_points.csv" if prefix == "stall_pm_"
                           else f"{prefix}points.csv")
        with open(out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            writer.writeheader()
            writer.writerows(rows)
        print("| PM point (simulated) | workload | method | MB/ckpt | ckpt/min | limit/min "
              "(PM / iterations) | % of limit | overhead % (range) | stall ms/it | restore ms "
              "(bytes at read rate) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['point']} ({r['write_gbps']:g}/{r['read_gbps']:g} GB/s) | {r['workload']}"
                  f" | {r['method']} | {r['mb_per_checkpoint']:.0f} | {r['ckpt_per_min']:.0f} | "
                  f"{r['pm_limit_per_min']:.0f} / {r['iteration_limit_per_min']:.0f} | "
                  f"{r['pct_of_limit']:.0f}% | {r['overhead_pct']:+.1f} "
                  f"({r['overhead_min_pct']:+.1f}..{r['overhead_max_pct']:+.1f}) | "
                  f"{r['stall_ms_per_iter']:.2f} | {r['restore_ms']:.0f} "
                  f"({r['restore_at_read_rate_ms']:.0f}) |")
        print(f"\ncsv: {out}")

    print("\nComputed, not measured: the largest model that can checkpoint every iteration "
          "(bytes per checkpoint <= write rate x iteration time)")
    print("| PM point | iteration | dense, Adam (12 B/param) | DLRM tables in full "
          "(Adagrad, 8 B/param) | differential (x%.1f fewer bytes) | differential + 4-bit "
          "(x%.1f) |" % (DIFF_RATIO, DIFF_QUANT_RATIO))
    print("|---|---|---|---|---|---|")
    for _, label, write, _ in POINTS:
        for iteration_s in (0.05, 0.2, 1.0):
            budget = write * 1e9 * iteration_s
            print(f"| {label} ({write:g} GB/s) | {iteration_s * 1e3:.0f} ms | "
                  f"{budget / 12 / 1e6:,.0f}M params | {budget / 8 / 1e6:,.0f}M | "
                  f"{budget * DIFF_RATIO / 8 / 1e6:,.0f}M | "
                  f"{budget * DIFF_QUANT_RATIO / 8 / 1e6:,.0f}M |")


if __name__ == "__main__":
    main()
