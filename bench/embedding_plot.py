#!/usr/bin/env python3
"""Plot bench/embedding results: bytes written per interval, chunk-heap
capacity over time, and recovery time of every checkpoint with and without
the baseline copy, per policy.

    .venv/bin/python bench/embedding_plot.py [results_dir]   (matplotlib: scripts/requirements.txt)
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

results = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
intervals = defaultdict(list)
for r in csv.DictReader(open(f"{results}/embedding_intervals.csv")):
    intervals[r["policy"]].append(r)
recovery = defaultdict(list)
for r in csv.DictReader(open(f"{results}/embedding_recovery.csv")):
    recovery[r["policy"]].append(r)

fig, axes = plt.subplots(1, 4, figsize=(24, 5))
for policy, rows in intervals.items():
    x = [int(r["interval"]) for r in rows]
    axes[0].plot(x, [int(r["bytes"]) / 1e6 for r in rows], label=policy)
    axes[1].plot(x, [int(r["capacity_bytes"]) / 1e6 for r in rows], label=policy)
for policy, rows in recovery.items():
    x = [int(r["checkpoint"]) for r in rows]
    axes[2].plot(x, [float(r["recovery_ms"]) for r in rows], label=policy)
    if "without_baseline_ms" in rows[0]:
        axes[3].plot(x, [float(r["without_baseline_ms"]) for r in rows], label=policy)
axes[0].set_yscale("log")
axes[0].set_title("MB written per checkpoint interval")
axes[1].set_title("chunk-heap capacity in use (MB)")
axes[2].set_title("recovery time of each retained checkpoint (ms)")
axes[3].set_title("the same without the baseline copy (ms; IncrCP 5.1.4)")
for ax in axes:
    ax.set_xlabel("interval / checkpoint")
    ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(f"{results}/embedding.png", dpi=110)
