"""bench/lowdiff: LowDiff (compressed gradients as differential checkpoints)
against full checkpoints, on a 2-rank DDP job (gloo, CPU, fork), one
checkpoint per iteration.

Models: `gpt2` (the GPT-2-small-shaped causal LM of bench/distributed, 23.2M
parameters) and `mlp` (same file). Optimizer AdamW. Methods (METHODS):

  none                no checkpoint, no compression (baseline of the full methods)
  pmsnap-k1           pmsnap CheckpointedOptimizer, every iteration (weight-grained)
  checkfreq-style     CheckFreq's snapshot (state copied to host memory on the
                      training thread) + persist (torch.save on a thread), every
                      iteration
  none-powersgd       DDP with LowDiff's PowerSGD hook, no checkpoint (baseline)
  lowdiff-powersgd    LowDiff, PowerSGD rank 4: a differential every iteration
  none-topk           DDP with LowDiff's top-k hook (1%), no checkpoint (baseline)
  lowdiff-topk        LowDiff, top-k 1% with error feedback
  lowdiff-topk-sharded  the same with sharding="replicated": each rank writes
                      its share of every full checkpoint
  lowdiff-plus        LowDiff+ (pmsnap.LowDiffPlus, every iteration): only the
                      gradients leave the device; a host replica stepped by
                      the same optimizer commits to the pool
  lowdiff-plus-sharded  LowDiff+ with sharding="replicated": each rank copies,
                      steps and persists only its share of the replica

ms/it is training time per measured iteration (the mean, so the steps that
take full checkpoints count; the CSV also has the median step). Each
method's overhead is against its own baseline (the compressed methods
against the same hook without checkpointing). LowDiff runs with full
checkpoints every --full-every iterations and batches of --batch (fixed, so
runs compare; Eq. 10's f*, b* from the run's measurements are reported).
Bytes moved off the device are what a GPU would copy to the host per
iteration: SIMULATED (this is a CPU run; the numbers are the bytes the
method hands to pmsnap: whole state for full checkpoints, the compressed
gradient for LowDiff).

--rounds R runs the method list R times, alternating, and takes each
round's overhead against that round's baseline; the _summary CSV has the
median and range over the rounds and where the slowest rank's time went:
its training thread's CPU, every other thread's CPU (gloo's, pmsnap's
workers': on this 2-core machine with 2 ranks that CPU is taken from
training) and the waits pmsnap reports (the engine's blocked time, the
differential log's copy wait), each against the baseline's.

Recovery: one process restores a pool holding a full checkpoint plus n
differentials (n = 1..--max-diffs), sequential replay (AdamW, and SGD) and
the parallel log-n merge (SGD, where the update is additive). Eq. 8: wasted
time per hour of training at MTBF 1 h and 10 h, from the measured W, S, R_D,
R_F and iteration time.

To add a method: put an entry in METHODS:
name -> (factory, baseline name, description); factory(ctx) returns an
object with step(step), finish() -> {"persisted", "off_device"} bytes per
iteration and close(); ctx has model, ddp, optimizer, pool, rank, args.

  .venv/bin/python bench/lowdiff/lowdiff.py [--models gpt2,mlp] [--iters 12] [--warmup 3]

Writes bench/results/lowdiff.csv, lowdiff_recovery.csv, lowdiff_wasted.csv
and lowdiff.png (--tag renames them). The machine has 2 cores: two ranks with one compute thread
each leave pmsnap's worker no core of its own, so overheads are upper bounds.
"""

import argparse
import copy
import csv
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "distributed"))
from distributed import make_model  # noqa: E402  (bench/distributed/distributed.py)

import pmsnap  # noqa: E402
from pmsnap import _pmsnap, lowdiff  # noqa: E402

RESULTS = os.path.join(HERE, "..", "results")
WORLD = 2
SIMULATED = "simulated device (CPU run: bytes a GPU would copy to the host)"


def state_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Runner:
    """What every method's runner shares: the pmsnap waits (seconds so far)
    it can report; none by default."""

    def waits(self):
        return {}


class NoCheckpoint(Runner):
    def __init__(self, ctx, compressor=None):
        self.ctx = ctx
        self.compressor = compressor
        if compressor is not None:
            compressor.attach(ctx.ddp)

    def step(self, step):
        if self.compressor is not None:
            self.compressor.take()
        self.ctx.optimizer.step()
        self.ctx.optimizer.zero_grad()

    def finish(self):
        return {"persisted": 0, "off_device": 0}

    def close(self):
        pass


class Full(Runner):
    """pmsnap CheckpointedOptimizer (every=1, or the CheckFreq policy)."""

    def __init__(self, ctx, **options):
        self.ctx = ctx
        self.opt = pmsnap.CheckpointedOptimizer(ctx.optimizer, ctx.pool, model=ctx.model, workers=1,
                                                part_bytes=1 << 20, **options)

    def step(self, step):
        self.opt.step()
        self.opt.zero_grad()

    def waits(self):
        return {"engine_blocked": self.opt.stats()["blocked_seconds"]}

    def finish(self):
        self.opt.flush()
        s = self.opt.stats()
        per_it = s["bytes_written"] / max(1, s["steps"])
        return {"persisted": per_it, "off_device": per_it,
                "checkpoints_per_it": s["epochs_committed"] / max(1, s["steps"])}

    def close(self):
        self.opt.close()


class CheckFreqStyle(Runner):
    """CheckFreq's two phases (Mohan et al., FAST'21) at one checkpoint per
    iteration: snapshot (the training thread copies model and optimizer
    state into host memory, after waiting for the previous persist, as
    CheckFreq does), then persist (torch.save on a background thread into
    the same /dev/shm work directory). pmsnap's own CheckFreq policy refuses
    several ranks (it picks iterations from each rank's measurements), so
    this is the baseline written out."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.thread = None
        self.written = 0
        self.steps = 0

    def step(self, step):
        self.ctx.optimizer.step()
        self.ctx.optimizer.zero_grad()
        if self.thread is not None:
            self.thread.join()
        snapshot = {"model": {k: v.detach().clone() for k, v in self.ctx.model.state_dict().items()},
                    "optim": copy.deepcopy(self.ctx.optimizer.state_dict())}
        target = self.ctx.pool.replace("{rank}", str(self.ctx.rank)) + ".checkfreq.pt"

        def persist():
            torch.save(snapshot, target)
            self.written += os.path.getsize(target)

        self.thread = threading.Thread(target=persist)
        self.thread.start()
        self.steps += 1

    def finish(self):
        if self.thread is not None:
            self.thread.join()
        per_it = self.written / max(1, self.steps)
        return {"persisted": per_it, "off_device": per_it}

    def close(self):
        pass


class LowDiffMethod(Runner):
    def __init__(self, ctx, compressor, **options):
        self.ctx = ctx
        self.ld = lowdiff.LowDiff(ctx.optimizer, ctx.pool, ctx.ddp, compressor,
                                  full_every=ctx.args.full_every or None,
                                  batch=ctx.args.batch or None,
                                  mtbf_seconds=3600, workers=1, part_bytes=1 << 20, **options)

    def step(self, step):
        self.ld.step()
        self.ld.zero_grad()

    def waits(self):
        s = self.ld.stats()
        return {"engine_blocked": s["engine"]["blocked_seconds"],
                "log_copy_wait": s["log"]["copy_wait_seconds"] if "log" in s else 0.0}

    def finish(self):
        self.ld.flush()
        s = self.ld.stats()
        steps = max(1, s["engine"]["steps"])
        log = s["log"]
        full = s["engine"]["bytes_written"]
        return {"persisted": (full + log["bytes_written"]) / steps,
                "off_device": (full + self.ld.stats()["bytes_handed"]) / steps,
                "diff_bytes_per_it": log["bytes_written"] / max(1, log["appended"]),
                "f_star": s.get("f_star", ""), "b_star": s.get("b_star", ""),
                "full_every": s["full_every"], "batch": s["batch"],
                "full_checkpoints": s["engine"]["epochs_committed"],
                "inputs": s.get("inputs")}

    def close(self):
        self.ld.close()


class LowDiffPlusMethod(Runner):
    """pmsnap.LowDiffPlus (every=1): DDP's synchronized buckets snapshotted
    while backward runs, the optimizer applied to a host replica that
    commits to the pool every iteration (bench/lowdiff/lowdiff_plus.py adds
    its restore time)."""

    def __init__(self, ctx, **options):
        self.ctx = ctx
        self.plus = pmsnap.LowDiffPlus(ctx.ddp, ctx.optimizer, ctx.pool, every=1, workers=1,
                                       part_bytes=1 << 20, **options)

    def step(self, step):
        self.plus.step()
        self.ctx.optimizer.zero_grad()

    def waits(self):
        return {"snapshot_wait": self.plus.stats()["lowdiff_plus"]["training_wait_seconds"]}

    def finish(self):
        self.plus.flush()
        s = self.plus.stats()
        plus = s["lowdiff_plus"]
        return {"persisted": s["bytes_written"] / max(1, s["steps"]),
                "off_device": plus["gradient_bytes_snapshotted"] / max(1, plus["iterations"])}

    def close(self):
        self.plus.close()


# name -> (factory(ctx), baseline, description)
METHODS = {
    "none": (lambda c: NoCheckpoint(c), "none", "no checkpoint"),
    "pmsnap-k1": (lambda c: Full(c, every=1), "none", "pmsnap full, every iteration"),
    "checkfreq-style": (lambda c: CheckFreqStyle(c), "none",
                        "CheckFreq-style snapshot + background torch.save, every iteration"),
    "none-powersgd": (lambda c: NoCheckpoint(c, lowdiff.PowerSGD(matrix_approximation_rank=4,
                                                                 start_powerSGD_iter=2)),
                      "none-powersgd", "PowerSGD hook, no checkpoint"),
    "lowdiff-powersgd": (lambda c: LowDiffMethod(c, lowdiff.PowerSGD(matrix_approximation_rank=4,
                                                                     start_powerSGD_iter=2)),
                         "none-powersgd", "LowDiff, PowerSGD rank 4"),
    "none-topk": (lambda c: NoCheckpoint(c, lowdiff.TopK(0.01)), "none-topk",
                  "top-k 1% hook, no checkpoint"),
    "lowdiff-topk": (lambda c: LowDiffMethod(c, lowdiff.TopK(0.01)), "none-topk",
                     "LowDiff, top-k 1%"),
    "lowdiff-topk-sharded": (lambda c: LowDiffMethod(c, lowdiff.TopK(0.01),
                                                     sharding="replicated"), "none-topk",
                             "LowDiff, top-k 1%, full checkpoints sharded over the ranks"),
    "lowdiff-plus": (lambda c: LowDiffPlusMethod(c), "none",
                     "LowDiff+: gradients off the device, replica committed every iteration"),
    "lowdiff-plus-sharded": (lambda c: LowDiffPlusMethod(c, sharding="replicated"), "none",
                             "LowDiff+, the replica sharded over the ranks (each steps and "
                             "persists its share)"),
}


def run_rank(rank, model_name, method, args, workdir, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/init", rank=rank,
                            world_size=WORLD)
    model, make_batch = make_model(model_name)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ctx = types.SimpleNamespace(model=model, ddp=ddp, optimizer=optimizer, rank=rank, args=args,
                                pool=os.path.join(workdir, "pool.{rank}"))
    runner = METHODS[method][0](ctx)
    times = []
    for step in range(1, args.warmup + args.iters + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        if step == args.warmup + 1:
            # Where the measured iterations' time goes: this (training)
            # thread's CPU, every other thread's (gloo, pmsnap's workers),
            # and the waits pmsnap reports.
            cpu0, process0, waits0 = time.thread_time(), time.process_time(), runner.waits()
        start = time.perf_counter()
        ddp(make_batch(g)).square().mean().backward()
        runner.step(step)
        if step > args.warmup:
            times.append(time.perf_counter() - start)
    main_cpu, process_cpu = time.thread_time() - cpu0, time.process_time() - process0
    waits = {k: (v - waits0[k]) / args.iters for k, v in runner.waits().items()}
    out = runner.finish()
    runner.close()
    dist.barrier()
    dist.destroy_process_group()
    # The mean is training time per iteration, full checkpoints' steps and
    # all; the median shows the typical (differential-only) step.
    results[rank] = dict(out, iteration_s=statistics.mean(times),
                         iteration_median_s=statistics.median(times),
                         training_cpu_s=main_cpu / args.iters,
                         other_cpu_s=(process_cpu - main_cpu) / args.iters, waits=waits)


def spawn(target, args):
    workdir = tempfile.mkdtemp(prefix="pmsnap-bench-lowdiff-", dir="/dev/shm")
    try:
        with mp.Manager() as manager:
            results = manager.dict()
            mp.start_processes(target, args=(*args, workdir, results), nprocs=WORLD, join=True,
                               start_method="fork")
            return [dict(results[r]) for r in range(WORLD)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# --- recovery against the number of differentials (one process) -------------

def recovery_rank(rank, model_name, max_diffs, workdir, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/init", rank=0, world_size=1)
    rows = []
    for opt_name in ("adamw", "sgd"):
        for n in sorted({1, 2, 4, 8, 16, max_diffs}):
            pool = os.path.join(workdir, f"rec-{opt_name}-{n}.pool")
            model, make_batch = make_model(model_name)
            ddp = DistributedDataParallel(model)
            make_opt = ((lambda ps: torch.optim.AdamW(ps, lr=1e-4)) if opt_name == "adamw"
                        else (lambda ps: torch.optim.SGD(ps, lr=1e-3)))
            ld = lowdiff.LowDiff(make_opt(model.parameters()), pool, ddp, lowdiff.TopK(0.01),
                                 full_every=10 ** 6, batch=4, workers=1, part_bytes=1 << 20)
            for step in range(1, n + 2):
                g = torch.Generator().manual_seed(step)
                ddp(make_batch(g)).square().mean().backward()
                ld.step()
                ld.zero_grad()
            ld.close()
            merges = ["sequential"] + (["parallel"] if opt_name == "sgd" else [])
            for merge in merges:
                fresh, _ = make_model(model_name)
                fddp = DistributedDataParallel(fresh)
                r = lowdiff.LowDiff(make_opt(fresh.parameters()), pool, fddp, lowdiff.TopK(0.01),
                                    full_every=10 ** 6, batch=4, merge=merge, workers=1)
                t = time.perf_counter()
                reached, _, info = r.restore()
                total = time.perf_counter() - t
                assert info["replayed"] == n, info
                r.close(abandon=True)
                rows.append({"model": model_name, "optimizer": opt_name, "merge": merge,
                             "differentials": n, "restore_ms": 1e3 * total,
                             "replay_ms": 1e3 * info["seconds"],
                             "full_restore_ms": 1e3 * (total - info["seconds"])})
            os.remove(pool)
    dist.destroy_process_group()
    results[0] = rows


def recovery(model_name, max_diffs):
    workdir = tempfile.mkdtemp(prefix="pmsnap-bench-lowdiff-rec-", dir="/dev/shm")
    try:
        with mp.Manager() as manager:
            results = manager.dict()
            mp.start_processes(recovery_rank, args=(model_name, max_diffs, workdir, results),
                               nprocs=1, join=True, start_method="fork")
            return list(results[0])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main():
    global WORLD
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2,mlp")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--full-every", type=int, default=10,
                        help="full checkpoint interval 1/f (0: f* of Eq. 10, re-tuned as run)")
    parser.add_argument("--batch", type=int, default=2,
                        help="differentials per chunk b (0: b* of Eq. 10, re-tuned as run)")
    parser.add_argument("--max-diffs", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=WORLD,
                        help="DDP ranks (2: the issue's setting; 1 leaves a core of this 2-core "
                             "machine to pmsnap's threads, as a GPU run leaves the host's cores)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every method this many times, alternating, each round's "
                             "overheads against that round's baselines (medians in _summary.csv)")
    parser.add_argument("--tag", default="lowdiff", help="CSV/PNG name prefix under bench/results")
    args = parser.parse_args()
    WORLD = args.ranks
    os.makedirs(RESULTS, exist_ok=True)
    rows, wasted, rec_rows = [], [], []
    for model_name in args.models.split(","):
        model, _ = make_model(model_name)
        model_bytes = state_bytes(model)
        for round_no in range(1, args.rounds + 1):
            by_method = {}
            for method in args.methods.split(","):
                row = measure(model_name, model_bytes, method, round_no, args, by_method)
                rows.append(row)
                print(f"{model_name:6s} round {round_no} {method:18s} {row['iteration_ms']:8.1f} "
                      f"ms/it  overhead {fmt_pct(row['overhead_pct']):>8s}  training CPU "
                      f"{row['training_cpu_ms']:.1f} ms/it, other threads "
                      f"{row['other_cpu_ms']:.1f} ms/it, pmsnap waits "
                      f"{sum(row['_waits'].values()):.2f} ms/it  persisted "
                      f"{row['persisted_mb_per_it']:.3f} MB/it  off-device "
                      f"{row['off_device_mb_per_it_simulated']:.3f} MB/it (simulated)", flush=True)
        recs = recovery(model_name, args.max_diffs)
        rec_rows += recs
        wasted += wasted_rows(model_name, rows, recs, args)
    write_csv(f"{args.tag}.csv", [{k: v for k, v in r.items() if not k.startswith("_")}
                                  for r in rows])
    summary = summary_rows(rows)
    write_csv(f"{args.tag}_summary.csv", summary)
    write_csv(f"{args.tag}_recovery.csv", rec_rows)
    write_csv(f"{args.tag}_wasted.csv", wasted)
    print_tables(rows, rec_rows, wasted, summary)
    plot(summary, rec_rows, args.tag)


def measure(model_name, model_bytes, method, round_no, args, by_method):
    """One run of `method` (both ranks); its row, with the overhead against
    the baseline measured earlier in the same round (by_method) and where
    the slowest rank's time went, per iteration: the training thread's CPU,
    every other thread's CPU (on this 2-core machine another thread's CPU
    is taken from training), and the waits pmsnap reports."""
    _, baseline, description = METHODS[method]
    per_rank = spawn(run_rank, (model_name, method, args))
    slow = max(per_rank, key=lambda r: r["iteration_s"])
    row = {"model": model_name, "round": round_no, "method": method, "description": description,
           "baseline": baseline, "ranks": WORLD, "model_mb": model_bytes / 1e6,
           "iteration_ms": 1e3 * slow["iteration_s"],
           "iteration_median_ms": 1e3 * slow["iteration_median_s"],
           "training_cpu_ms": 1e3 * slow["training_cpu_s"],
           "other_cpu_ms": 1e3 * slow["other_cpu_s"],
           "engine_blocked_ms": 1e3 * slow["waits"].get("engine_blocked", 0.0),
           "log_copy_wait_ms": 1e3 * slow["waits"].get("log_copy_wait", 0.0),
           "persisted_mb_per_it": max(r["persisted"] for r in per_rank) / 1e6,
           "off_device_mb_per_it_simulated": max(r["off_device"] for r in per_rank) / 1e6,
           "f_star": slow.get("f_star", ""), "b_star": slow.get("b_star", ""),
           "full_every_in_force": slow.get("full_every", ""), "batch_in_force": slow.get("batch", ""),
           "full_checkpoints": slow.get("full_checkpoints", "")}
    row["_waits"] = {k: 1e3 * v for k, v in slow["waits"].items()}
    base = by_method.get(baseline)
    row["overhead_pct"] = (100 * (row["iteration_ms"] / base["iteration_ms"] - 1)
                           if base is not None and baseline != method else "")
    by_method[method] = row
    if slow.get("inputs"):
        row["_inputs"] = slow["inputs"]
    return row


def summary_rows(rows):
    """Per model and method over the rounds: the median overhead and its
    range, and the medians of the time breakdown against the baseline's."""
    out = []
    keys = list(dict.fromkeys((r["model"], r["method"]) for r in rows))
    for model, method in keys:
        mine = [r for r in rows if (r["model"], r["method"]) == (model, method)]
        base = [r for r in rows if (r["model"], r["method"]) == (model, mine[0]["baseline"])]

        def med(field, rs=mine):
            return statistics.median(r[field] for r in rs)

        overheads = [r["overhead_pct"] for r in mine if r["overhead_pct"] != ""]
        out.append({"model": model, "method": method, "baseline": mine[0]["baseline"],
                    "rounds": len(mine), "iteration_ms": med("iteration_ms"),
                    "iteration_median_ms": med("iteration_median_ms"),
                    "overhead_pct_median": statistics.median(overheads) if overheads else "",
                    "overhead_pct_min": min(overheads) if overheads else "",
                    "overhead_pct_max": max(overheads) if overheads else "",
                    "training_cpu_ms": med("training_cpu_ms"),
                    "training_cpu_delta_ms": med("training_cpu_ms") - med("training_cpu_ms", base),
                    "other_cpu_ms": med("other_cpu_ms"),
                    "other_cpu_delta_ms": med("other_cpu_ms") - med("other_cpu_ms", base),
                    "engine_blocked_ms": med("engine_blocked_ms"),
                    "log_copy_wait_ms": med("log_copy_wait_ms")})
    return out


def wasted_rows(model_name, rows, recs, args):
    """Eq. 8 per hour of training, N = 2, from a LowDiff run's measurements."""
    out = []
    full_restore = statistics.median(r["full_restore_ms"] for r in recs) / 1e3
    for row in rows:
        inputs = row.get("_inputs")
        if row["model"] != model_name or not inputs or row["round"] != args.rounds:
            continue
        for mtbf_h in (1, 10):
            common = dict(write_bandwidth=inputs["write_bandwidth"], full_bytes=inputs["full_bytes"],
                          merge_seconds=inputs["merge_seconds"], load_full_seconds=full_restore,
                          mtbf_seconds=3600 * mtbf_h, iteration_seconds=inputs["iteration_seconds"],
                          world_size=WORLD)
            cfg = _pmsnap.optimal_configuration(
                **{k: v for k, v in common.items() if k != "load_full_seconds"})
            cases = [("full every iteration (f=1, b=1)", 1.0, 1.0)]
            if args.full_every and args.batch:
                cases.append((f"LowDiff as run (f=1/{args.full_every}, b={args.batch})",
                              1 / args.full_every, args.batch))
            cases += [
                      (f"LowDiff at Eq. 10 (f*={cfg['f_star']:.3g}, b*={cfg['b_star']:.3g})",
                       cfg["f_star"], cfg["b_star"])]
            for name, f, b in cases:
                out.append({"model": model_name, "method": row["method"], "mtbf_h": mtbf_h,
                            "configuration": name,
                            "wasted_s_per_h": _pmsnap.wasted_seconds(**common, f=f, b=b,
                                                                    training_seconds=3600)})
    return out


def fmt_pct(v):
    return "" if v == "" else f"{v:+.2f}%"


def write_csv(name, rows):
    if not rows:
        return
    with open(os.path.join(RESULTS, name), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def print_tables(rows, recs, wasted, summary):
    print(f"\n{WORLD}-rank DDP, gloo, CPU (2 cores); overhead vs each method's own baseline; "
          f"off-device bytes: {SIMULATED}")
    print("| model | round | method | ms/it | overhead | persisted MB/it | off-device MB/it "
          "(simulated) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['round']} | {r['method']} | {r['iteration_ms']:.1f} | "
              f"{fmt_pct(r['overhead_pct'])} (vs {r['baseline']}) | {r['persisted_mb_per_it']:.3f} | "
              f"{r['off_device_mb_per_it_simulated']:.3f} |")
    print("\nWhere the slowest rank's time went, per iteration (medians over the rounds; "
          "deltas against the baseline's medians)")
    print("| model | method | rounds | ms/it | overhead median (min..max) | training CPU ms "
          "(delta) | other threads' CPU ms (delta) | engine blocked ms | log copy wait ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in summary:
        spread = ("" if r["overhead_pct_median"] == "" else
                  f"{fmt_pct(r['overhead_pct_median'])} ({r['overhead_pct_min']:+.1f}.."
                  f"{r['overhead_pct_max']:+.1f})")
        print(f"| {r['model']} | {r['method']} | {r['rounds']} | {r['iteration_ms']:.1f} | "
              f"{spread} | {r['training_cpu_ms']:.1f} ({r['training_cpu_delta_ms']:+.1f}) | "
              f"{r['other_cpu_ms']:.1f} ({r['other_cpu_delta_ms']:+.1f}) | "
              f"{r['engine_blocked_ms']:.2f} | {r['log_copy_wait_ms']:.2f} |")
    print("\nRecovery: full checkpoint + n differentials (one process)")
    print("| model | optimizer | merge | n | restore ms | of which replay ms |")
    print("|---|---|---|---|---|---|")
    for r in recs:
        print(f"| {r['model']} | {r['optimizer']} | {r['merge']} | {r['differentials']} | "
              f"{r['restore_ms']:.1f} | {r['replay_ms']:.1f} |")
    print("\nEq. 8 wasted time per hour of training (N = 2, measured W, S, R_D, R_F)")
    print("| model | method | MTBF | configuration | wasted s/h |")
    print("|---|---|---|---|---|")
    for r in wasted:
        print(f"| {r['model']} | {r['method']} | {r['mtbf_h']} h | {r['configuration']} | "
              f"{r['wasted_s_per_h']:.2f} |")


def plot(summary, recs, tag="lowdiff"):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = sorted({r["model"] for r in summary})
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        mine = [r for r in summary if r["model"] == model and r["overhead_pct_median"] != ""]
        ax = axes[0][col]
        medians = [r["overhead_pct_median"] for r in mine]
        ax.barh([f"{r['method']} (vs {r['baseline']})" for r in mine], medians,
                xerr=[[m - r["overhead_pct_min"] for m, r in zip(medians, mine)],
                      [r["overhead_pct_max"] - m for m, r in zip(medians, mine)]])
        ax.axvline(1.0, color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(f"{model}: overhead, one checkpoint per iteration")
        ax.set_xlabel("% vs own no-checkpoint run (2-rank DDP, CPU; median, min..max over "
                      "rounds)")
        ax = axes[1][col]
        for (opt, merge) in sorted({(r["optimizer"], r["merge"]) for r in recs
                                    if r["model"] == model}):
            pts = [r for r in recs if r["model"] == model and r["optimizer"] == opt
                   and r["merge"] == merge]
            ax.plot([r["differentials"] for r in pts], [r["restore_ms"] for r in pts], marker="o",
                    label=f"{opt}, {merge}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("differentials replayed")
        ax.set_ylabel("restore ms (full + replay)")
        ax.set_title(f"{model}: recovery")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{tag}.png"), dpi=110)


if __name__ == "__main__":
    sys.exit(main())
