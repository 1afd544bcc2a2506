#!/usr/bin/env python3
"""pmsnap's wall-clock overhead on the Python workloads, from blocks a few iterations long.

Issue [perf2] item 1 asks for <= 5% on examples/train_dlrm.py and <= 2% on the
transformer of bench/python_overhead.py. Trials of whole runs (that script)
cannot tell on a shared 2-vCPU VM: the plain iteration moves by 20-30%
between runs half a second apart, in one process on the same tensors
(bench/RESULTS.md, eighth session). This benchmark pairs iterations run
milliseconds apart instead:

- two copies of the workload's model and optimizer, built alike, live in
  this process; one runs --method (default pmsnap: CheckpointedOptimizer,
  every=1, the workload's configuration), the other its plain optimizer;
- they take turns in blocks of --block iterations (the first --skip of
  each block untimed: the other copy ran in between), the order alternating
  per pair of blocks; a pmsnap block ends with flush(), untimed, so that
  its copies do not slow the plain block after it (within a block they
  overlap training as usual);
- halfway the copies swap roles (the pool is closed and a new one opened
  on the other copy), so that a difference between the two copies' memory
  does not read as the method's;
- the overhead of a pair is the measured block's mean iteration over the
  plain block's; the table gives the median over pairs of each half and
  of all, with a 95% confidence interval of the median (order
  statistics). --method plain is the control: what the pairing reads
  when there is nothing to find.

    PMEM_IS_PMEM_FORCE=1 PYTHONPATH=build/python .venv/bin/python \\
        bench/python_paired.py --workload dlrm --pairs 200

Writes bench/results/python_paired_<workload>_<method>.csv (a row per pair) and
prints the table. Pools go to $PMSNAP_POOL_DIR (default /dev/shm).
"""

import argparse
import csv
import math
import os
import statistics
import sys
import time

import pmsnap

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import python_overhead  # noqa: E402  (the workloads)


def median_interval(values, confidence_z=1.96):
    """(median, low, high): the median of `values` and the order statistics
    around it that hold the population median with about 95% confidence
    (the binomial's normal approximation; needs 10 or more values)."""
    ordered = sorted(values)
    n = len(ordered)
    half = confidence_z * math.sqrt(n) / 2
    low = max(0, int(math.floor(n / 2 - half)))
    high = min(n - 1, int(math.ceil(n / 2 + half)))
    return statistics.median(ordered), ordered[low], ordered[high]


class Copy:
    """One copy of the workload: its model, optimizer and loss, and while it
    is the measured copy, what the method adds (a CheckpointedOptimizer
    around the optimizer, or tracking-only's EmbeddingTracker)."""

    def __init__(self, workload, name):
        self.name = name
        self.model, self.optimizer, self.loss_of, self.base = workload.make()
        self.stepper = self.optimizer
        self.tracker = None
        self.iteration = 0

    def start(self, method, pool, worker_cpus):
        """Runs `method` (a python_overhead method, or plain) from now on."""
        if method == "tracking-only":
            self.tracker = pmsnap.EmbeddingTracker(self.model)
        elif method != "plain":
            self.stepper = pmsnap.CheckpointedOptimizer(
                self.optimizer,
                **python_overhead.checkpoint_kwargs(method, self.base, pool, worker_cpus))

    def stop(self):
        """Back to plain; returns the closed pool's stats, or None."""
        if self.tracker is not None:
            self.tracker.remove()
            self.tracker = None
        if not self.checkpointed:
            return None
        self.stepper.close()
        stats = self.stepper.stats()
        self.stepper = self.optimizer
        return stats

    @property
    def checkpointed(self):
        return self.stepper is not self.optimizer

    def block(self, iterations, skip):
        """Trains `iterations` iterations; returns the mean seconds of the
        timed ones (all but the first `skip`)."""
        times = []
        for it in range(iterations):
            start = time.perf_counter()
            self.stepper.zero_grad()
            self.loss_of(self.iteration).backward()
            self.stepper.step()
            times.append(time.perf_counter() - start)
            self.iteration += 1
        if self.checkpointed:
            self.stepper.flush()  # untimed: its copies end before the other copy's block
        return statistics.mean(times[skip:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(python_overhead.WORKLOADS), default="dlrm")
    parser.add_argument("--pairs", type=int, default=200, help="pairs of blocks (even)")
    parser.add_argument("--block", type=int, default=12, help="iterations per block")
    parser.add_argument("--skip", type=int, default=2, help="untimed first iterations of a block")
    parser.add_argument("--warmup", type=int, default=30,
                        help="iterations of each copy before the first pair (state, pool)")
    parser.add_argument("--method", default="pmsnap",
                        help="what the measured copy runs: a method of python_overhead.py "
                             "(pmsnap, pmsnap-norng, hooks-only, tracking-only, ...) or plain "
                             "(the control: what the pairing reads with nothing to find)")
    python_overhead.add_transformer_arguments(parser)
    parser.add_argument("--out", default=None,
                        help="CSV (default bench/results/python_paired_<workload>_<method>.csv)")
    args = parser.parse_args()
    if args.pairs < 20 or args.pairs % 2:
        parser.error("--pairs must be even and at least 20")
    if not 0 <= args.skip < args.block:
        parser.error("--skip must be below --block")
    if args.method not in python_overhead.METHODS and args.method not in ("plain",
                                                                          "tracking-only"):
        parser.error(f"unknown method {args.method!r}")
    if args.method in python_overhead.DLRM_ONLY and args.workload != "dlrm":
        parser.error(f"{args.method} needs --workload dlrm")
    if args.out is None:
        args.out = os.path.join(HERE, "results",
                                f"python_paired_{args.workload}_{args.method}.csv")

    allowed, worker_cpus = python_overhead.pin_training_thread()
    pool_dir = os.environ.get("PMSNAP_POOL_DIR", "/dev/shm")
    workload = python_overhead.WORKLOADS[args.workload](args)
    copies = [Copy(workload, "first"), Copy(workload, "second")]
    what = ("plain against plain (the control)" if args.method == "plain"
            else f"{args.method} against plain")
    print(f"{workload.describe()}; {what}; {args.pairs} pairs of blocks of {args.block} "
          f"iterations (the first {args.skip} untimed), roles swapped halfway; training thread "
          f"on CPU {allowed[0] if worker_cpus else 'any'}, pmsnap workers on CPU(s) "
          f"{worker_cpus or 'any'}; load average {os.getloadavg()[0]:.1f} at start")

    rows = []
    stats = []
    for half in (0, 1):
        measured, plain = copies[half], copies[1 - half]
        pool = os.path.join(pool_dir, f"pmsnap-bench-paired-{os.getpid()}-{half}.pool")
        if os.path.exists(pool):
            os.remove(pool)
        measured.start(args.method, pool, worker_cpus)
        try:
            for copy in (measured, plain):
                copy.block(args.warmup, 0)
            for pair in range(args.pairs // 2):
                order = (plain, measured) if pair % 2 == 0 else (measured, plain)
                means = {copy.name: copy.block(args.block, args.skip) for copy in order}
                rows.append(dict(half=half, pair=pair, measured_copy=measured.name,
                                 plain_ms=1e3 * means[plain.name],
                                 measured_ms=1e3 * means[measured.name],
                                 overhead_pct=100 * (means[measured.name]
                                                     / means[plain.name] - 1)))
        finally:
            stats.append(measured.stop())
            if os.path.exists(pool):
                os.remove(pool)

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()})

    label = "plain (as measured)" if args.method == "plain" else args.method
    print(f"\n{'pairs':<22} {'plain ms/it':>12} {label + ' ms/it':>24} "
          f"{'overhead % (median [95% CI])':>32}")
    for title, mine in (("first half", [r for r in rows if r["half"] == 0]),
                        ("second half (swapped)", [r for r in rows if r["half"] == 1]),
                        ("all", rows)):
        median, low, high = median_interval([r["overhead_pct"] for r in mine])
        print(f"{title:<22} {statistics.median(r['plain_ms'] for r in mine):12.2f} "
              f"{statistics.median(r['measured_ms'] for r in mine):24.2f} "
              f"{median:+17.2f} [{low:+.2f} .. {high:+.2f}]")
    for s in filter(None, stats):
        print(f"pmsnap: {s['epochs_committed']} checkpoints over {s['steps']} steps, "
              f"blocked {1e3 * s['blocked_seconds'] / max(1, s['steps']):.3f} ms/step "
              "(the untimed flushes included)")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end; CSV: {args.out}")


if __name__ == "__main__":
    main()
