#!/usr/bin/env python3
"""Python front end overhead: a transformer trained with AdamW, pmsnap against the plain optimizer.

Issue [perf] part 2: "a Python transformer loop (AdamW, 72 parameter tensors,
4.7M elements, a checkpoint on 28 of 30 iterations) measured +4-6% against the
plain optimizer; target <= 2%". The model is 6 nn.TransformerEncoderLayer
blocks (d_model 256, 4 heads, feed-forward 1024, no dropout): 72 parameter
tensors, 4.74M elements, 57 MB of parameters + AdamW state per checkpoint.

Each trial trains a fresh copy of the same initial model for --iterations
iterations (default 30) and times the last ones (all but --warmup, default 2:
the first iterations create AdamW's state and fault in a fresh pool), so a
pmsnap trial checkpoints every timed iteration ("28 of 30"). Methods:

  plain        torch.optim.AdamW.step(), no checkpoints: the baseline
  pmsnap       pmsnap.CheckpointedOptimizer(every=1), the recommended
               configuration: adaptive strategy, copy start "auto", workers
               pinned to the CPUs the training thread does not use
  pmsnap-nopin the same with the workers left to the OS scheduler
  pmsnap-per-param  pmsnap with step_groups=None: the wrapped optimizer's
               step() called once per parameter (the stepping before
               parameter groups), to show what the groups save
  hooks-only   pmsnap's grouped step and hooks with a checkpoint interval
               longer than the run (no commit): what the Python stepping
               costs without copies
  pmsnap-cont  continuous mode instead of every=1 (a checkpoint whenever the
               previous one is durable), pinned
  pmsnap-cont-staged-w2  the same with two copy workers (both on the
               workers' CPU; they mostly wait for the PM)
  pmsnap-cont-staged  continuous with dram_staging_buffers=2: a step that
               finds the previous checkpoint still being written is staged
               in host memory (run these two under simulated PM, e.g.
               PMSNAP_PM_WRITE_GBPS=0.8, where the table's "% of PM limit"
               compares checkpoints per minute with the write rate over the
               bytes per checkpoint)

The training thread is pinned to the first allowed CPU in every method (when
the process may use two or more), so all methods compare on equal terms.
Methods run interleaved, in a rotated order per round; the overhead of a
round is its mean iteration time over the same round's `plain`, and the table
gives the median over rounds with the range. The machine may be loaded by
other work: read the in-round ratios, not the milliseconds. "step() CPU ms"
is the training thread's CPU time inside step() (time.thread_time, median of
the timed iterations): what the stepping itself costs, which the load moves
far less than the wall clock.

    PMEM_IS_PMEM_FORCE=1 PYTHONPATH=build/python .venv/bin/python \\
        bench/python_transformer.py --rounds 7

Writes bench/results/python_transformer.csv (one row per trial) and prints a
table. Pools go to $PMSNAP_POOL_DIR (default /dev/shm) and are removed.
"""

import argparse
import csv
import os
import statistics
import time

import torch
from torch import nn

import pmsnap

HERE = os.path.dirname(os.path.abspath(__file__))


def make_model(seed):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024,
                                       dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)


def run_trial(method, args, pool_dir, trial, worker_cpus):
    model = make_model(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randn(args.batch, args.seq, 256, generator=generator)
               for _ in range(4)]
    pool = os.path.join(pool_dir, f"pmsnap-bench-pytransformer-{os.getpid()}-{trial}.pool")
    stepper = optimizer
    if method != "plain":
        kwargs = dict(pool=pool, model=model, capture_rng=False)
        if method == "hooks-only":
            kwargs["every"] = 10 ** 9  # never reached: no checkpoint
        elif method.startswith("pmsnap-cont"):
            kwargs["mode"] = "continuous"
            if method.startswith("pmsnap-cont-staged"):
                kwargs["dram_staging_buffers"] = 2
            if method == "pmsnap-cont-staged-w2":
                kwargs["workers"] = 2
        else:
            kwargs["every"] = 1
        if method not in ("pmsnap-nopin", "hooks-only") and worker_cpus:
            kwargs["worker_cpus"] = worker_cpus
        if method == "pmsnap-per-param":
            kwargs["step_groups"] = None
        stepper = pmsnap.CheckpointedOptimizer(optimizer, **kwargs)
    times, step_cpu = [], []
    commits_at_warmup = commits_at_end = 0
    try:
        for it in range(args.iterations):
            if it == args.warmup and method != "plain":
                commits_at_warmup = stepper.stats()["epochs_committed"]
            start = time.perf_counter()
            stepper.zero_grad()
            out = model(batches[it % len(batches)])
            loss = out.pow(2).mean()
            loss.backward()
            cpu = time.thread_time()
            stepper.step()
            step_cpu.append(time.thread_time() - cpu)
            times.append(time.perf_counter() - start)
        commits = 0
        blocked = 0.0
        checkpoint_bytes = 0.0
        if method != "plain":
            commits_at_end = stepper.stats()["epochs_committed"]
            stepper.close()
            s = stepper.stats()
            commits = s["epochs_committed"]
            blocked = s["blocked_seconds"] / max(1, s["steps"])
            checkpoint_bytes = s["bytes_written"] / max(1, commits)
    finally:
        if os.path.exists(pool):
            os.remove(pool)
    timed = times[args.warmup:]
    return dict(mean_ms=1e3 * statistics.mean(timed), median_ms=1e3 * statistics.median(timed),
                step_cpu_ms=1e3 * statistics.median(step_cpu[args.warmup:]),
                commits=commits, blocked_ms=1e3 * blocked,
                # Over the timed iterations: the cold first epochs left out.
                ckpt_per_min=60 * (commits_at_end - commits_at_warmup) / sum(times[args.warmup:]),
                checkpoint_mb=checkpoint_bytes / 1e6)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods",
                        default="plain,pmsnap,pmsnap-nopin,pmsnap-per-param,hooks-only",
                        help="also pmsnap-cont, pmsnap-cont-staged, pmsnap-cont-staged-w2")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "python_transformer.csv"))
    args = parser.parse_args()
    methods = args.methods.split(",")
    if methods[0] != "plain":
        parser.error("the first method must be plain (the baseline)")

    torch.set_num_threads(1)
    allowed = sorted(os.sched_getaffinity(0))
    worker_cpus = []
    if len(allowed) >= 2:
        os.sched_setaffinity(0, {allowed[0]})  # this (the training) thread
        worker_cpus = allowed[1:]
    pool_dir = os.environ.get("PMSNAP_POOL_DIR", "/dev/shm")
    model = make_model(args.seed)
    tensors = list(model.parameters())
    print(f"transformer: {len(tensors)} parameter tensors, "
          f"{sum(p.numel() for p in tensors) / 1e6:.2f}M elements, AdamW; "
          f"{args.iterations} iterations per trial, the first {args.warmup} untimed; "
          f"training thread on CPU {allowed[0] if worker_cpus else 'any'}, "
          f"pmsnap workers on CPU(s) {worker_cpus or 'any'}; load average "
          f"{os.getloadavg()[0]:.1f} at start")

    rows = []
    trial = 0
    for rnd in range(args.rounds):
        order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
        results = {}
        for method in order:
            results[method] = run_trial(method, args, pool_dir, trial, worker_cpus)
            trial += 1
        for method in methods:
            r = results[method]
            r.update(round=rnd, method=method,
                     overhead_pct=100 * (r["mean_ms"] / results["plain"]["mean_ms"] - 1))
            rows.append(r)

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["round", "method", "mean_ms", "median_ms",
                                               "step_cpu_ms", "overhead_pct", "commits",
                                               "blocked_ms", "ckpt_per_min", "checkpoint_mb"])
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v)
                             for k, v in r.items()})

    write_gbps = float(os.environ.get("PMSNAP_PM_WRITE_GBPS") or 0)
    if write_gbps:
        print(f"\nsimulated PM: {write_gbps} GB/s write (PMSNAP_PM_WRITE_GBPS)")
    print(f"\n{'method':<19} {'mean ms/it':>11} {'overhead % (median, range over rounds)':>40} "
          f"{'step() CPU ms':>14} {'commits':>8} {'blocked ms/it':>14} {'ckpt/min':>9}"
          + (f" {'% of PM limit':>14}" if write_gbps else ""))
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        over = sorted(r["overhead_pct"] for r in mine)
        rate = statistics.median(r["ckpt_per_min"] for r in mine)
        limit = ""
        mb = statistics.median(r["checkpoint_mb"] for r in mine)
        if write_gbps and mb > 0:
            limit = f" {100 * rate / (60 * write_gbps * 1e3 / mb):13.0f}%"
        print(f"{method:<19} {statistics.median(r['mean_ms'] for r in mine):11.2f} "
              f"{statistics.median(over):+15.2f} ({over[0]:+.2f} .. {over[-1]:+.2f}){'':>8} "
              f"{statistics.median(r['step_cpu_ms'] for r in mine):14.2f} "
              f"{statistics.median(r['commits'] for r in mine):8.0f} "
              f"{statistics.median(r['blocked_ms'] for r in mine):14.3f} {rate:9.0f}{limit}")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end; CSV: {args.out}")


if __name__ == "__main__":
    main()
