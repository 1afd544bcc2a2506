#!/usr/bin/env python3
"""Python front end overhead: a training loop with pmsnap against the plain optimizer, by parts.

Issue [perf2] item 1: Python at every iteration <= 2% on the transformer and
<= 5% on examples/train_dlrm.py. Two workloads (--workload):

  transformer  6 nn.TransformerEncoderLayer blocks (d_model 256, 4 heads,
               feed-forward 1024, no dropout): 72 parameter tensors, 4.74M
               elements, 57 MB of parameters + AdamW state per checkpoint.
               Each iteration trains on one of 4 fixed batches.
  dlrm         the DLRM of examples/train_dlrm.py at its defaults (4
               EmbeddingBag tables of 76k rows x 16, Adagrad, batches of 128
               with Zipf ids) in the example's configuration: the tables
               through the intermittent differential policy, lookups tracked
               (track_embeddings=True). Each iteration makes its batch as the
               example does (Zipf sampling and the teacher's forward pass
               included), so the overhead is the one the example's
               --measure-overhead prints.

Each trial trains a fresh copy of the same initial model for --iterations
iterations and times the last ones (all but --warmup: the first iterations
create the optimizer state and fault in a fresh pool), so a pmsnap trial
checkpoints every timed iteration. Methods (each a variation of `pmsnap`, so
that the differences between rows are the parts of the overhead):

  plain        the wrapped optimizer's step(), no checkpoints: the baseline
  pmsnap       pmsnap.CheckpointedOptimizer(every=1), the recommended
               configuration: adaptive strategy, copy start "auto", workers
               pinned to the CPUs the training thread does not use
  pmsnap-nopin the same with the workers left to the OS scheduler
  pmsnap-per-param  pmsnap with step_groups=None: the wrapped optimizer's
               step() called once per parameter (the stepping before
               parameter groups), to show what the groups save
  pmsnap-norng pmsnap with capture_rng=False: no RNG states packed per step
               (the transformer's methods all run without them)
  pmsnap-zero-in-place  pmsnap with zero_grad(set_to_none=False): the
               gradients zeroed in place each step (CheckpointedOptimizer's
               default before 2026-11-28; plain torch.optim sets them to None)
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
  dlrm only:
  tracking-only  the plain optimizer with a pmsnap.EmbeddingTracker on the
               model: what marking the looked-up rows costs
  pmsnap-notrack pmsnap without track_embeddings (the differential policy's
               own lookup tracking stays): the example's second tracker
  pmsnap-dense the tables checkpointed as dense parameters, in full

The training thread is pinned to the first allowed CPU in every method (when
the process may use two or more), so all methods compare on equal terms.
Methods run interleaved, in a rotated order per round; the overhead of a
round is its mean iteration time over the same round's `plain`, and the table
gives the median over rounds with the range. The machine may be loaded by
other work: read the in-round ratios, not the milliseconds. "step() CPU ms"
is the training thread's CPU time inside step() (time.thread_time, median of
the timed iterations): what the stepping itself costs, which the load moves
far less than the wall clock; "pmsnap CPU ms" the part of it outside the
wrapped optimizer's own step() calls (pmsnap's Python and engine calls; ~0
for plain), steady where the update's memory traffic moves step() CPU by
milliseconds between processes; "fwd+bwd CPU ms" the same for the rest of the
iteration (the batch, the forward pass with its hooks, the backward pass);
"faults/it" the training thread's page faults per timed iteration (on a VM
each costs ~10-20 us, and they contend with the copy workers' faults on
the pool for the process's memory map).

    PMEM_IS_PMEM_FORCE=1 PYTHONPATH=build/python .venv/bin/python \\
        bench/python_overhead.py --rounds 7
    PMEM_IS_PMEM_FORCE=1 PYTHONPATH=build/python .venv/bin/python \\
        bench/python_overhead.py --workload dlrm --rounds 7

Writes bench/results/python_<workload>.csv (one row per trial) and prints a
table. Pools go to $PMSNAP_POOL_DIR (default /dev/shm) and are removed.
"""

import argparse
import csv
import os
import resource
import statistics
import sys
import time

import torch
from torch import nn

import pmsnap

HERE = os.path.dirname(os.path.abspath(__file__))
DROP = object()  # a method's keyword value: leave the keyword out

# Each method's CheckpointedOptimizer keywords over the workload's own;
# "pin": False leaves the workers to the OS scheduler.
METHODS = {
    "pmsnap": {},
    "pmsnap-nopin": {"pin": False},
    "pmsnap-per-param": {"step_groups": None},
    "pmsnap-norng": {"capture_rng": False},
    "pmsnap-zero-in-place": {"zero_in_place": True},
    "hooks-only": {"every": 10 ** 9, "pin": False},  # never reached: no checkpoint
    "pmsnap-cont": {"mode": "continuous", "every": DROP},
    "pmsnap-cont-staged": {"mode": "continuous", "every": DROP, "dram_staging_buffers": 2},
    "pmsnap-cont-staged-w2": {"mode": "continuous", "every": DROP, "dram_staging_buffers": 2,
                              "workers": 2},
    "pmsnap-notrack": {"track_embeddings": DROP},
    "pmsnap-dense": {"embedding_policy": DROP, "retain": DROP},
}
DLRM_ONLY = ("tracking-only", "pmsnap-notrack", "pmsnap-dense")


class TransformerWorkload:
    name = "transformer"

    def __init__(self, args):
        self.seed = args.seed
        self.batch, self.seq = args.batch, args.seq

    def describe(self):
        tensors = list(self._model().parameters())
        return (f"transformer: {len(tensors)} parameter tensors, "
                f"{sum(p.numel() for p in tensors) / 1e6:.2f}M elements, AdamW")

    def _model(self):
        torch.manual_seed(self.seed)
        layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024,
                                           dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)

    def make(self):
        """(model, optimizer, loss_of(iteration), checkpoint keywords)."""
        model = self._model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        generator = torch.Generator().manual_seed(self.seed + 1)
        batches = [torch.randn(self.batch, self.seq, 256, generator=generator)
                   for _ in range(4)]
        return (model, optimizer, lambda it: model(batches[it % len(batches)]).pow(2).mean(),
                dict(model=model, capture_rng=False))


class DlrmWorkload:
    name = "dlrm"

    def __init__(self, args):
        del args
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
        import train_dlrm  # the example's model, data and configuration
        self.example = train_dlrm
        self.options = train_dlrm.make_parser().parse_args([])

    def describe(self):
        rows = self.options.table_rows
        return (f"dlrm (examples/train_dlrm.py defaults): {len(rows)} EmbeddingBag tables of "
                f"{sum(rows)} rows x {self.options.dim}, batch {self.options.batch}, Adagrad, "
                f"tables {self.options.embedding_policy}")

    def make(self):
        model, teacher, optimizer, generator = self.example.build(self.options)
        loss_fn = nn.BCEWithLogitsLoss()

        def loss_of(it):
            del it
            dense, ids, offsets, labels = self.example.make_batch(self.options, teacher,
                                                                  generator)
            return loss_fn(model(dense, ids, offsets), labels)

        kwargs = self.example.checkpoint_kwargs_of(self.options, None)
        for key in ("pool", "worker_cpus"):
            del kwargs[key]
        return model, optimizer, loss_of, dict(kwargs, model=model)


WORKLOADS = {w.name: w for w in (TransformerWorkload, DlrmWorkload)}


def checkpoint_kwargs(method, base, pool, worker_cpus):
    """The CheckpointedOptimizer keywords of `method` over the workload's `base`."""
    kwargs = dict(base, pool=pool, every=1)
    pin = True
    for key, value in METHODS[method].items():
        if key == "pin":
            pin = value
        elif key == "zero_in_place":
            continue  # run_trial's
        elif value is DROP:
            kwargs.pop(key, None)
        else:
            kwargs[key] = value
    if pin and worker_cpus:
        kwargs["worker_cpus"] = worker_cpus
    return kwargs


def thread_page_faults():
    """Page faults (minor + major) of the calling thread so far."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_minflt + usage.ru_majflt


def run_trial(workload, method, args, pool_dir, trial, worker_cpus, made=None):
    """One trial of `method`: a fresh copy of the workload's model, or `made`
    (workload.make()'s tuple, kept by --same-model; its optimizer is left
    as it was, its state trained further)."""
    model, optimizer, loss_of, base = made or workload.make()
    pool = os.path.join(pool_dir, f"pmsnap-bench-python-{os.getpid()}-{trial}.pool")
    stepper = optimizer
    tracker = None
    if method == "tracking-only":
        tracker = pmsnap.EmbeddingTracker(model)
    elif method != "plain":
        stepper = pmsnap.CheckpointedOptimizer(
            optimizer, **checkpoint_kwargs(method, base, pool, worker_cpus))
    checkpointed = isinstance(stepper, pmsnap.CheckpointedOptimizer)
    set_to_none = not METHODS.get(method, {}).get("zero_in_place", False)
    # The wrapped optimizer's own step() CPU, to tell pmsnap's part of a
    # step from the update's, whose memory traffic moves by milliseconds.
    update_cpu = [0.0]
    update = optimizer.step

    def timed_update(*args, **kwargs):
        began = time.thread_time()
        try:
            return update(*args, **kwargs)
        finally:
            update_cpu[0] += time.thread_time() - began

    optimizer.step = timed_update
    times, step_cpu, rest_cpu, own_cpu = [], [], [], []
    commits_at_warmup = commits_at_end = 0
    faults_at_warmup = 0
    try:
        for it in range(args.iterations):
            if it == args.warmup:
                faults_at_warmup = thread_page_faults()
                if checkpointed:
                    commits_at_warmup = stepper.stats()["epochs_committed"]
            start = time.perf_counter()
            rest = time.thread_time()
            stepper.zero_grad(set_to_none=set_to_none)
            loss_of(it).backward()
            cpu = time.thread_time()
            update_cpu[0] = 0.0
            stepper.step()
            step_cpu.append(time.thread_time() - cpu)
            own_cpu.append(step_cpu[-1] - update_cpu[0])
            rest_cpu.append(cpu - rest)
            times.append(time.perf_counter() - start)
        faults = thread_page_faults() - faults_at_warmup
        commits = 0
        blocked = 0.0
        checkpoint_bytes = 0.0
        if checkpointed:
            commits_at_end = stepper.stats()["epochs_committed"]
            stepper.close()
            s = stepper.stats()
            commits = s["epochs_committed"]
            blocked = s["blocked_seconds"] / max(1, s["steps"])
            checkpoint_bytes = s["bytes_written"] / max(1, commits)
    finally:
        del optimizer.step  # the class's step() again, for the next trial on `made`
        if tracker is not None:
            tracker.remove()
        if os.path.exists(pool):
            os.remove(pool)
    timed = times[args.warmup:]
    return dict(mean_ms=1e3 * statistics.mean(timed), median_ms=1e3 * statistics.median(timed),
                step_cpu_ms=1e3 * statistics.median(step_cpu[args.warmup:]),
                rest_cpu_ms=1e3 * statistics.median(rest_cpu[args.warmup:]),
                own_cpu_ms=1e3 * statistics.median(own_cpu[args.warmup:]),
                commits=commits, blocked_ms=1e3 * blocked,
                faults_per_it=faults / len(timed),
                # Over the timed iterations: the cold first epochs left out.
                ckpt_per_min=60 * (commits_at_end - commits_at_warmup) / sum(times[args.warmup:]),
                checkpoint_mb=checkpoint_bytes / 1e6)


def add_transformer_arguments(parser):
    """The transformer workload's options (--batch, --seq, --seed)."""
    parser.add_argument("--batch", type=int, default=2, help="transformer batch")
    parser.add_argument("--seq", type=int, default=32, help="transformer sequence length")
    parser.add_argument("--seed", type=int, default=0, help="transformer seed")


def pin_training_thread():
    """One torch thread, pinned to the first allowed CPU when there are two
    or more; returns (the allowed CPUs, the others: pmsnap's workers' CPUs,
    empty on one CPU)."""
    torch.set_num_threads(1)
    allowed = sorted(os.sched_getaffinity(0))
    worker_cpus = []
    if len(allowed) >= 2:
        os.sched_setaffinity(0, {allowed[0]})  # this (the training) thread
        worker_cpus = allowed[1:]
    return allowed, worker_cpus


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="transformer")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=None,
                        help="per trial (default: transformer 30, dlrm 300)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed first iterations (default: transformer 2, dlrm 10)")
    add_transformer_arguments(parser)
    parser.add_argument("--methods", default=None,
                        help="comma-separated, plain first (default: transformer "
                             "plain,pmsnap,pmsnap-nopin,pmsnap-per-param,hooks-only; dlrm "
                             "plain,pmsnap,tracking-only,pmsnap-notrack,pmsnap-norng,"
                             "pmsnap-dense,hooks-only); also pmsnap-cont, pmsnap-cont-staged, "
                             "pmsnap-cont-staged-w2")
    parser.add_argument("--same-model", action="store_true",
                        help="every trial trains on, with the same model, optimizer and "
                             "tensors (fresh copies per trial move the plain iteration by "
                             "tens of percent between trials on a VM); with short trials and "
                             "many rounds, the rounds pair methods run seconds apart")
    parser.add_argument("--out", default=None,
                        help="CSV (default bench/results/python_<workload>.csv)")
    args = parser.parse_args()
    dlrm = args.workload == "dlrm"
    if args.iterations is None:
        args.iterations = 300 if dlrm else 30
    if args.warmup is None:
        args.warmup = 10 if dlrm else 2
    if args.methods is None:
        args.methods = ("plain,pmsnap,tracking-only,pmsnap-notrack,pmsnap-norng,pmsnap-dense,"
                        "hooks-only" if dlrm else
                        "plain,pmsnap,pmsnap-nopin,pmsnap-per-param,hooks-only")
    if args.out is None:
        args.out = os.path.join(HERE, "results", f"python_{args.workload}.csv")
    methods = args.methods.split(",")
    if methods[0] != "plain":
        parser.error("the first method must be plain (the baseline)")
    for method in methods[1:]:
        if method not in METHODS and method != "tracking-only":
            parser.error(f"unknown method {method!r}")
        if method in DLRM_ONLY and not dlrm:
            parser.error(f"{method} needs --workload dlrm (the transformer has no tables)")
    if args.warmup >= args.iterations:
        parser.error("--warmup must be below --iterations")

    allowed, worker_cpus = pin_training_thread()
    pool_dir = os.environ.get("PMSNAP_POOL_DIR", "/dev/shm")
    workload = WORKLOADS[args.workload](args)
    print(f"{workload.describe()}; "
          f"{args.iterations} iterations per trial, the first {args.warmup} untimed"
          f"{', every trial on the same model (--same-model)' if args.same_model else ''}; "
          f"training thread on CPU {allowed[0] if worker_cpus else 'any'}, "
          f"pmsnap workers on CPU(s) {worker_cpus or 'any'}; load average "
          f"{os.getloadavg()[0]:.1f} at start; "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset)')}")

    made = workload.make() if args.same_model else None
    rows = []
    trial = 0
    for rnd in range(args.rounds):
        order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
        results = {}
        for method in order:
            results[method] = run_trial(workload, method, args, pool_dir, trial,
                                        worker_cpus, made)
            trial += 1
        for method in methods:
            r = results[method]
            r.update(round=rnd, method=method,
                     overhead_pct=100 * (r["mean_ms"] / results["plain"]["mean_ms"] - 1))
            rows.append(r)

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["round", "method", "mean_ms", "median_ms",
                                               "step_cpu_ms", "own_cpu_ms", "rest_cpu_ms",
                                               "faults_per_it",
                                               "overhead_pct", "commits",
                                               "blocked_ms", "ckpt_per_min", "checkpoint_mb"])
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v)
                             for k, v in r.items()})

    write_gbps = float(os.environ.get("PMSNAP_PM_WRITE_GBPS") or 0)
    if write_gbps:
        print(f"\nsimulated PM: {write_gbps} GB/s write (PMSNAP_PM_WRITE_GBPS)")
    print(f"\n{'method':<19} {'mean ms/it':>11} {'overhead % (median, range over rounds)':>40} "
          f"{'step() CPU ms':>14} {'pmsnap CPU ms':>14} {'fwd+bwd CPU ms':>15} "
          f"{'faults/it':>10} {'commits':>8} "
          f"{'blocked ms/it':>14} {'ckpt/min':>9}"
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
              f"{statistics.median(r['own_cpu_ms'] for r in mine):14.3f} "
              f"{statistics.median(r['rest_cpu_ms'] for r in mine):15.2f} "
              f"{statistics.median(r['faults_per_it'] for r in mine):10.0f} "
              f"{statistics.median(r['commits'] for r in mine):8.0f} "
              f"{statistics.median(r['blocked_ms'] for r in mine):14.3f} {rate:9.0f}{limit}")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end; CSV: {args.out}")


if __name__ == "__main__":
    main()
