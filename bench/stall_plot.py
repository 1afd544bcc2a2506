#!/usr/bin/env python3
"""Plot bench/stall results (pmsnap_bench_stall writes the CSVs).

One row of panels per (workload, device): overhead over no checkpointing,
training-thread stall by cause, and restore time.

    .venv/bin/python bench/stall_plot.py [results_dir] [tag]   (matplotlib: scripts/requirements.txt)
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

results = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
tag = sys.argv[2] if len(sys.argv) > 2 else "stall"
rows = [r for r in csv.DictReader(open(f"{results}/{tag}.csv")) if int(r["rounds"]) > 0]
restores = list(csv.DictReader(open(f"{results}/{tag}_restore.csv")))
cells = []
for r in rows:
    key = (r["workload"], r["device"])
    if key not in cells:
        cells.append(key)

causes = [("conflict_ms", "conflict wait"), ("boundary_ms", "boundary wait"),
          ("copy_ms", "copy"), ("save_ms", "sync save"), ("hook_ms", "hook")]
fig, axes = plt.subplots(len(cells), 3, figsize=(19, 4.2 * len(cells)), squeeze=False,
                         gridspec_kw={"width_ratios": [3, 3, 1.3]})
for (workload, device), ax_row in zip(cells, axes):
    cell = [r for r in rows if r["workload"] == workload and r["device"] == device
            and r["method"] != "none"]
    names = [r["method"] for r in cell]
    x = range(len(cell))
    label = f"{workload} / {device}" + (" (SIMULATED device)" if device == "simulated" else "")

    ax = ax_row[0]
    overhead = [float(r["overhead_pct"]) for r in cell]
    colors = ["tab:green" if n.startswith("pmsnap") else "tab:gray" for n in names]
    # Whiskers: the range over rounds (CSVs from before it was recorded have none).
    spread = None
    if cell and "overhead_min_pct" in cell[0]:
        spread = [[o - float(r["overhead_min_pct"]) for o, r in zip(overhead, cell)],
                  [float(r["overhead_max_pct"]) - o for o, r in zip(overhead, cell)]]
    ax.bar(x, overhead, color=colors, yerr=spread, capsize=2, error_kw={"linewidth": 0.8})
    ax.axhline(3.5, color="red", linestyle="--", linewidth=1, label="3.5% budget")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("mean iteration time over 'none' (%),\nmedian and range of rounds")
    ax.set_title(f"{label}: overhead")
    ax.legend(fontsize=7)

    ax = ax_row[1]
    bottom = [0.0] * len(cell)
    for key, name in causes:
        values = [max(float(r[key]), 0.0) for r in cell]
        ax.bar(x, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("training-thread stall (ms / iteration)")
    ax.set_title(f"{label}: stall by cause")
    ax.legend(fontsize=7)

    ax = ax_row[2]
    rs = [r for r in restores if r["workload"] == workload and r["device"] == device]
    ax.barh(range(len(rs)), [float(r["open_ms"]) for r in rs], label="open (+verify)")
    ax.barh(range(len(rs)), [float(r["restore_ms"]) for r in rs],
            left=[float(r["open_ms"]) for r in rs], label="copy / load")
    ax.set_yticks(range(len(rs)))
    ax.set_yticklabels([r["method"].replace(" (", "\n(") for r in rs], fontsize=7)
    ax.set_xlabel("restore of the newest checkpoint, fresh process (ms)")
    ax.set_title("restore")
    ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(f"{results}/{tag}.png", dpi=90)
