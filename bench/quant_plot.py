#!/usr/bin/env python3
"""Plots bench/quant results: mean l2 error by method and bit width (like
Check-N-Run Figure 9) and single-core throughput. Reads the CSVs written by
pmsnap_bench_quant; needs python3-matplotlib (Debian package).

    .venv/bin/python bench/quant_plot.py [results_dir]
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

results = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results")
errors = list(csv.DictReader(open(os.path.join(results, "quant_error.csv"))))
tput = list(csv.DictReader(open(os.path.join(results, "quant_throughput.csv"))))

fig, axes = plt.subplots(1, 2, figsize=(14, 5))
methods = ["symmetric", "asymmetric", "kmeans_i15", "adaptive_b45_r1.0", "adaptive_auto",
           "torch_2bit_prepack_optimized", "torch_4bit_prepack_optimized"]
bits_list = [2, 3, 4, 8]
ax = axes[0]
width = 0.8 / len(methods)
for i, m in enumerate(methods):
    ys = []
    for b in bits_list:
        v = [float(r["mean_l2"]) for r in errors
             if r["table"] == "heavy" and r["dim"] == "64" and r["method"] == m and int(r["bits"]) == b]
        ys.append(v[0] if v else 0)
    ax.bar([x + i * width for x in range(len(bits_list))], ys, width, label=m)
ax.set_xticks([x + 0.4 for x in range(len(bits_list))])
ax.set_xticklabels([f"{b}-bit" for b in bits_list])
ax.set_yscale("log")
ax.set_ylabel("mean l2 error (heavy-tailed rows, dim 64)")
ax.legend(fontsize=7)

ax = axes[1]
series = [("asymmetric", "scalar_ref"), ("asymmetric", "portable"), ("asymmetric", "avx512"),
          ("asymmetric", "avx2"), ("symmetric", "avx512"), ("adaptive_b45_r1.0", "avx512"),
          ("adaptive_auto", "avx512"), ("kmeans_i15", "portable"),
          ("torch_byte_prepack", "torch"), ("torch_4bit_prepack", "torch"),
          ("torch_2bit_prepack", "torch"), ("torch_4bit_prepack_optimized", "torch")]
for (m, impl) in series:
    pts = sorted((int(r["bits"]), float(r["gbps_per_core"])) for r in tput
                 if r["table"] == "normal" and r["dim"] == "64" and r["method"] == m and r["impl"] == impl)
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{m} ({impl})")
ax.set_xticks(bits_list)
ax.set_yscale("log")
ax.set_xlabel("bits")
ax.set_ylabel("GB/s of fp32 input, one core (normal rows, dim 64)")
ax.legend(fontsize=7)
fig.tight_layout()
out = os.path.join(results, "quant.png")
fig.savefig(out, dpi=110)
print("wrote", out)
