"""SIMULATED: pmsnap's per-iteration checkpointing of a 7B and a 70B model on
8 to 1,024 ranks, predicted from costs measured by bench/distributed and
from published hardware figures. Nothing here ran on many ranks.

Inputs
  measured  the epoch-agreement all-reduce latency at 2 ranks
            (bench/results/distributed_allreduce.csv), grown as log2(N)
            hops of a tree all-reduce;
  assumed   16 bytes of state per parameter (bf16 weights, fp32 master
            weights and two Adam moments; ANCHORS.md: 7B ~ 112 GB), 8 GPUs
            per node, H100 bf16 989 TFLOP/s at 40% MFU, 16,384 tokens per
            GPU per iteration (6 FLOPs per parameter and token), 50 GB/s of
            network per node (400 Gb/s);
  published PM write / read bandwidth per node: 1-DIMM Optane 2.3 / 6.6,
            6-DIMM Optane 13.9 / 39.4, CXL Gen5 x8 32 / 32 GB/s.

Model
  per-rank bytes per checkpoint = state / N x R (sharded state, replicas R);
  a node writes 8 ranks' bytes into its PM while the next iterations run,
  so it can checkpoint every k = ceil(write time / iteration time)
  iterations; the training thread pays the agreement all-reduce only where
  it cannot overlap (it runs during the step: 0 unless it outlasts it).
  Recovery after a crash: each node reads its ranks' bytes from PM; after a
  lost node (R = 2) its ranks' bytes cross the network from the peers.

  .venv/bin/python bench/distributed/scale_model.py
Writes bench/results/distributed_scale.csv and distributed_scale.png.
"""

import csv
import math
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results")
BYTES_PER_PARAM = 16
GPUS_PER_NODE = 8
PEAK_FLOPS, MFU, TOKENS_PER_GPU = 989e12, 0.40, 16384
NETWORK_GBPS = 50.0
PM_POINTS = {"optane-1dimm": (2.3, 6.6), "optane-6dimm": (13.9, 39.4), "cxl": (32.0, 32.0)}
MODELS = {"7B": 7e9, "70B": 70e9}
RANKS = [8, 16, 32, 64, 128, 256, 512, 1024]


def measured_allreduce_seconds():
    path = os.path.join(RESULTS, "distributed_allreduce.csv")
    try:
        with open(path) as f:
            row = next(csv.DictReader(f))
        return float(row["median_us"]) * 1e-6, "measured (2 ranks, gloo)"
    except (OSError, StopIteration, KeyError):
        return 200e-6, "assumed 200 us (run bench/distributed/distributed.py first)"


def predict(params, ranks, replicas, pm, allreduce_2):
    write_gbps, read_gbps = PM_POINTS[pm]
    state = params * BYTES_PER_PARAM
    per_rank = state / ranks * replicas
    per_node = per_rank * min(GPUS_PER_NODE, ranks)
    iteration = 6 * params * TOKENS_PER_GPU / (PEAK_FLOPS * MFU)
    write = per_node / (write_gbps * 1e9)
    every = max(1, math.ceil(write / iteration))
    allreduce = allreduce_2 * math.log2(ranks)
    stall = max(0.0, allreduce - iteration)  # overlapped with the step
    restore_local = per_node / replicas / (read_gbps * 1e9)
    restore_lost_node = restore_local + per_node / replicas / (NETWORK_GBPS * 1e9)
    return {
        "model": f"{params / 1e9:.0f}B", "ranks": ranks, "replicas": replicas, "pm": pm,
        "per_rank_gb": per_rank / 1e9, "iteration_s": iteration, "pm_write_s": write,
        "checkpoint_every": every, "allreduce_us": allreduce * 1e6,
        "overhead_pct": 100 * stall / iteration,
        "restore_s": restore_local, "restore_lost_node_s": restore_lost_node,
    }


def main():
    allreduce_2, source = measured_allreduce_seconds()
    rows = [predict(params, n, r, pm, allreduce_2) for params in MODELS.values() for n in RANKS
            for r in (1, 2) for pm in PM_POINTS]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "distributed_scale.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["simulated", *rows[0]])
        writer.writeheader()
        for row in rows:
            writer.writerow({"simulated": "yes", **row})
    print(f"SIMULATED (model, not measured); agreement all-reduce at 2 ranks: "
          f"{allreduce_2 * 1e6:.0f} us, {source}")
    print("| model | ranks | R | PM | GB/rank | iteration s | PM write s | every k | "
          "all-reduce us | overhead | restore s | lost node s |")
    print("|" + "---|" * 12)
    for row in rows:
        if row["ranks"] not in (8, 64, 1024):
            continue
        print(f"| {row['model']} | {row['ranks']} | {row['replicas']} | {row['pm']} | "
              f"{row['per_rank_gb']:.2f} | {row['iteration_s']:.2f} | {row['pm_write_s']:.2f} | "
              f"{row['checkpoint_every']} | {row['allreduce_us']:.0f} | "
              f"{row['overhead_pct']:.2f}% | {row['restore_s']:.2f} | "
              f"{row['restore_lost_node_s']:.2f} |")
    print("Published, for comparison (not measured here): Gemini >13x faster recovery and "
          "checkpoints every iteration into CPU memory; DCP async_save 7B blocking time "
          "148.8 s -> 6.3 s per checkpoint.")
    plot(rows)


def plot(rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, model in zip(axes, MODELS):
        for pm in PM_POINTS:
            mine = [r for r in rows if r["model"] == model and r["pm"] == pm and r["replicas"] == 2]
            ax.plot([r["ranks"] for r in mine], [r["checkpoint_every"] for r in mine],
                    marker="o", label=pm)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel("checkpoint every k iterations")
        ax.set_title(f"SIMULATED {model}, replicas=2")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "distributed_scale.png"), dpi=110)


if __name__ == "__main__":
    main()
