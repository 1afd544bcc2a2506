#!/usr/bin/env python3
"""Plot bench/conflict results: training-thread stall per iteration for every
method in every (bandwidth, memory) cell, one panel per workload.

    .venv/bin/python bench/conflict_plot.py [results_dir]   (matplotlib: scripts/requirements.txt)
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

results = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
rows = list(csv.DictReader(open(f"{results}/conflict.csv")))
workloads = sorted({r["workload"] for r in rows})
methods = ["s1", "s2", "s3", "s4", "adaptive", "model"]
fig, axes = plt.subplots(1, len(workloads), figsize=(7 * len(workloads), 4.5), squeeze=False)
for ax, workload in zip(axes[0], workloads):
    cells = defaultdict(dict)
    for r in rows:
        if r["workload"] == workload:
            cells[(float(r["bandwidth_gbps"]), r["memory"])][r["method"]] = float(r["stall_ms_per_iter"])
    keys = sorted(cells, key=lambda k: (k[0], k[1] != "ample"))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ax.bar([x + i * width for x in range(len(keys))],
               [max(cells[k].get(m, 0), 1e-3) for k in keys], width, label=m)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))])
    ax.set_xticklabels([f"{k[0]:.0f} GB/s\n{k[1]}" for k in keys])
    ax.set_yscale("log")
    ax.set_ylabel("training-thread stall (ms / iteration)")
    ax.set_title(f"{workload} (simulated device, continuous checkpointing)")
    ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(f"{results}/conflict.png", dpi=110)
