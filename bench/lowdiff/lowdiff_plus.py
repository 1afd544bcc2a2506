"""bench/lowdiff/lowdiff_plus.py: LowDiff+ (pmsnap.LowDiffPlus) against full
pmsnap checkpoints and no checkpoint, one checkpoint per iteration, in a
2-rank DDP job (gloo, CPU, torch.multiprocessing fork).

Methods (each in fresh rank processes, AdamW, warm-up iterations first):
  none          DDP training, no checkpoint (the baseline of the overheads);
  pmsnap-k1     pmsnap.CheckpointedOptimizer(every=1): every parameter and
                its AdamW state copied out of the trained model each iteration;
  lowdiff-plus  pmsnap.LowDiffPlus(every=1): the all-reduced gradients
                snapshotted from DDP's buckets, AdamW applied again on a host
                replica that commits to the pool each iteration.

Reported per model and method (the slowest rank): median iteration time and
overhead against `none` of the same model in this invocation; the training
thread's wait inside the checkpoint calls; bytes persisted into the pool per
iteration; bytes moved off the device per iteration, counted as a device
link would carry them (SIMULATED device: the run is on the host, nothing
crosses a link; full pmsnap moves parameters + optimizer state, LowDiff+ the
gradients); and the restore time of a fresh model from the pool.

The machine has 2 cores, shared with other jobs: the 2 ranks take both, so
pmsnap's copy worker and LowDiff+'s snapshot and replica threads (a second
AdamW update of the whole model per iteration, on the CPU) get no core of
their own. The runs are kept short (default 3 warm-up + 8 measured
iterations) for that reason; every overhead is an upper bound of a machine
whose CPU has room for the checkpoint threads beside the training.

  .venv/bin/python bench/lowdiff/lowdiff_plus.py [--models gpt2,mlp] [--iters 8]

Writes bench/results/lowdiff_plus.csv and lowdiff_plus.png.
"""

import argparse
import csv
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import pmsnap

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "distributed"))
from distributed import WORLD, make_model, spawn  # noqa: E402  (bench/distributed)

RESULTS = os.path.join(HERE, "..", "results")
METHODS = ("none", "pmsnap-k1", "lowdiff-plus")


def state_bytes(model, optimizer):
    """Parameters plus every optimizer-state tensor: what a full checkpoint
    moves off the device."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values()
                     if isinstance(t, torch.Tensor))
    return total


def run_rank(rank, model_name, method, iters, warmup, workdir, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/init", rank=rank,
                            world_size=WORLD)
    model, make_batch = make_model(model_name)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pool = os.path.join(workdir, "pool.{rank}")
    common = dict(workers=1, part_bytes=1 << 20)
    if method == "pmsnap-k1":
        opt = pmsnap.CheckpointedOptimizer(optimizer, pool, model=model, every=1, **common)
    elif method == "lowdiff-plus":
        opt = pmsnap.LowDiffPlus(ddp, optimizer, pool, every=1, **common)
    else:
        opt = optimizer
    times, blocked = [], 0.0
    for step in range(1, warmup + iters + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        start = time.perf_counter()
        ddp(make_batch(g)).square().mean().backward()
        opt.step()
        optimizer.zero_grad()
        if step > warmup:
            times.append(time.perf_counter() - start)
    out = {"iteration_s": statistics.median(times), "blocked_s_per_it": 0.0,
           "persisted_per_it": 0.0, "off_device_per_it": 0.0, "restore_s": None}
    if method != "none":
        opt.flush()
        stats = opt.stats()
        steps = max(1, stats["steps"])
        out["persisted_per_it"] = stats["bytes_written"] / steps
        if method == "pmsnap-k1":
            out["blocked_s_per_it"] = stats["blocked_seconds"] / steps
            out["off_device_per_it"] = state_bytes(model, optimizer)
        else:
            plus = stats["lowdiff_plus"]
            out["blocked_s_per_it"] = plus["training_wait_seconds"] / plus["iterations"]
            out["off_device_per_it"] = plus["gradient_bytes_snapshotted"] / plus["iterations"]
        opt.close()
        fresh, _ = make_model(model_name)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        if method == "pmsnap-k1":
            reopened = pmsnap.CheckpointedOptimizer(fresh_opt, pool, model=fresh, **common)
        else:
            reopened = pmsnap.LowDiffPlus(fresh, fresh_opt, pool, **common)
        t = time.perf_counter()
        reopened.restore()
        out["restore_s"] = time.perf_counter() - t
        reopened.close(abandon=True)
    dist.barrier()
    dist.destroy_process_group()
    results[rank] = out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", default="gpt2,mlp")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default="lowdiff_plus")
    args = parser.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    rows = []
    print(f"2-rank DDP, gloo, CPU ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}); "
          "bytes off the device: SIMULATED device (counted, the run is on the host)",
          flush=True)
    for model_name in args.models.split(","):
        none_time = None
        for method in args.methods.split(","):
            per_rank, _ = spawn(run_rank, lambda d: (model_name, method, args.iters,
                                                     args.warmup, d))
            restores = [r["restore_s"] for r in per_rank if r["restore_s"] is not None]
            row = {
                "model": model_name, "method": method, "ranks": WORLD,
                "iteration_ms": 1e3 * max(r["iteration_s"] for r in per_rank),
                "blocked_ms_per_it": 1e3 * max(r["blocked_s_per_it"] for r in per_rank),
                "persisted_mb_per_it": max(r["persisted_per_it"] for r in per_rank) / 1e6,
                "off_device_mb_per_it_simulated":
                    max(r["off_device_per_it"] for r in per_rank) / 1e6,
                "restore_ms": 1e3 * max(restores) if restores else "",
                "load_avg": round(os.getloadavg()[0], 1),
            }
            if method == "none":
                none_time = row["iteration_ms"]
            row["overhead_pct"] = (100 * (row["iteration_ms"] / none_time - 1)
                                   if none_time else "")
            rows.append(row)
            print(f"{model_name:6s} {method:14s} {row['iteration_ms']:8.1f} ms/it "
                  f"overhead {overhead_text(row)}", flush=True)
    path = os.path.join(RESULTS, f"{args.out}.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print_table(rows)
    plot(rows, os.path.join(RESULTS, f"{args.out}.png"))
    print(f"\nwrote {path}")


def overhead_text(row):
    return "" if row["overhead_pct"] == "" else f"{row['overhead_pct']:+.1f}%"


def print_table(rows):
    print("\n2-rank DDP on gloo, CPU, 2 shared cores; one checkpoint per iteration; overhead vs "
          "`none`; off-device bytes: SIMULATED device (counted)")
    header = ("model", "method", "ms/it", "overhead", "train wait ms/it", "persisted MB/it",
              "off-device MB/it (simulated)", "restore ms")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        restore = "" if r["restore_ms"] == "" else f"{r['restore_ms']:.1f}"
        print(f"| {r['model']} | {r['method']} | {r['iteration_ms']:.1f} | {overhead_text(r)} | "
              f"{r['blocked_ms_per_it']:.2f} | {r['persisted_mb_per_it']:.1f} | "
              f"{r['off_device_mb_per_it_simulated']:.1f} | {restore} |")


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 6), squeeze=False)
    for col, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model and r["method"] != "none"]
        ax = axes[0][col]
        ax.barh([r["method"] for r in mine], [r["overhead_pct"] or 0 for r in mine])
        ax.axvline(3, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{model}: overhead vs no checkpoint (2-rank DDP, CPU)")
        ax.set_xlabel("% (dashed: LowDiff+ target 3%)")
        ax = axes[1][col]
        ax.barh([r["method"] for r in mine],
                [r["off_device_mb_per_it_simulated"] for r in mine])
        ax.set_xlabel("MB off the device per iteration (simulated device)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
