"""bench/distributed: checkpointing a 2-rank DDP job (gloo, CPU) every
iteration with pmsnap against torch.distributed.checkpoint and torch.save.

Each method runs in fresh rank processes (torch.multiprocessing, fork): the
model under DistributedDataParallel with AdamW, warm-up iterations, then
measured ones. Every rank reports its median iteration time, the time its
training thread spent inside the checkpoint calls (blocked), the bytes it
wrote per iteration, and its restore time; the table shows the slowest
rank. Overhead is against the `none` run of the same model in the same
invocation. The machine has 2 cores: 2 ranks, each with one compute
thread, leave pmsnap's copy workers and DCP's background writer no core of
their own, so every overhead here is an upper bound of what a machine with
spare cores would see.

  .venv/bin/python bench/distributed/distributed.py [--iters 30] [--models mlp,transformer,gpt2]
      [--wrap fsdp2]   # the model sharded by FSDP2's fully_shard instead of DDP
      [--reshard-to 3] # fsdp2: also restore on 3 ranks (0: not)

With --wrap fsdp2 each checkpointing method's files are also restored at
another world size (--reshard-to ranks, FSDP2 over as many gloo processes):
pmsnap through init_from= (each new rank reads its shards' rows from the
old pools, one rank at a time, and seeds its own pool), DCP through
dcp.load (which reshards natively); the slowest rank's time is the
"restore ms (M ranks)" column.

Writes bench/results/distributed.csv (one row per model and method),
distributed_allreduce.csv (latency of pmsnap's epoch-agreement all-reduce)
and distributed.png; --tag NAME writes NAME.csv, NAME_allreduce.csv and
NAME.png instead. With PMSNAP_PM_WRITE_GBPS / _READ_GBPS set (simulated PM,
each rank's pool held to that rate), pmsnap's rows also give checkpoints
per minute against the limit: the write rate over each rank's bytes per
checkpoint, and at most one checkpoint per iteration.
"""

import argparse
import csv
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import pmsnap
from pmsnap import distributed as pmdist

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results")
WORLD = 2


def make_model(name):
    torch.manual_seed(0)
    if name == "mlp":
        widths = [512, 1024, 1024, 1024, 512]
        layers = []
        for a, b in zip(widths, widths[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1]), lambda g: torch.randn(32, 512, generator=g)
    if name == "transformer":
        layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024,
                                                 batch_first=True, dropout=0.0)
        return (torch.nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False),
                lambda g: torch.randn(8, 64, 256, generator=g))
    if name == "gpt2":
        model = Gpt2Like()
        return model, lambda g: torch.randint(0, model.vocab, (2, 128), generator=g)
    raise ValueError(f"unknown model {name}")


class Gpt2Like(torch.nn.Module):
    """A GPT-2-small-shaped causal language model scaled to this 2-core
    machine: pre-norm decoder blocks with GELU, learned positions, a tied
    output head. GPT-2 small is 12 layers, d_model 768, vocabulary 50257
    (124M parameters); this keeps its structure at 6 layers, d_model 512 and
    a vocabulary of 8192: 23.2M parameters in 76 tensors, about 0.5 s of
    forward and backward per batch of 2x128 tokens on one core here. Its
    forward returns the per-token next-token cross-entropy terms, so callers
    reduce it like the other models (`.square().mean()` or `.mean()`)."""

    def __init__(self, layers=6, d_model=512, heads=8, vocab=8192, context=128):
        super().__init__()
        self.vocab = vocab
        self.tokens = torch.nn.Embedding(vocab, d_model)
        self.positions = torch.nn.Embedding(context, d_model)
        block = torch.nn.TransformerEncoderLayer(d_model=d_model, nhead=heads,
                                                 dim_feedforward=4 * d_model, dropout=0.0,
                                                 activation="gelu", batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, num_layers=layers,
                                                  enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, ids):
        length = ids.shape[1]
        hidden = self.tokens(ids) + self.positions(torch.arange(length, device=ids.device))
        hidden = self.blocks(hidden, mask=self.causal[:length, :length], is_causal=True)
        logits = self.norm(hidden) @ self.tokens.weight.t()
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, self.vocab),
                                                 ids[:, 1:].reshape(-1), reduction="none")


# method -> (kind, options)
METHODS = {
    "none": ("none", {}),
    "pmsnap-k1": ("pmsnap", {"every": 1}),
    "pmsnap-continuous": ("pmsnap", {}),
    "pmsnap-sharded-k1": ("pmsnap", {"every": 1, "sharding": "replicated"}),
    "pmsnap-sharded-r2-k1": ("pmsnap", {"every": 1, "sharding": "replicated", "replicas": 2}),
    "dcp-save-k{k}": ("dcp", {"async": False}),
    "dcp-async-k{k}": ("dcp", {"async": True}),
    "torch-save-rank0-k{k}": ("torch_save", {}),
}


def state_dict(model, optimizer, wrap="ddp"):
    if wrap == "fsdp2":
        # DTensor state: DCP's own view of the model and the optimizer.
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state}
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def wrapped(model, wrap):
    """`model` under DDP, or sharded by FSDP2 (each block, then the root),
    which changes it in place; returns what the training loop calls."""
    if wrap == "ddp":
        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard
    if hasattr(model, "layers"):  # TransformerEncoder
        blocks = model.layers
    elif hasattr(model, "blocks"):  # Gpt2Like
        blocks = model.blocks.layers
    else:  # the MLP's Sequential
        blocks = list(model)
    for block in blocks:
        if any(True for _ in block.parameters()):
            fully_shard(block)
    fully_shard(model)
    return model


def dir_bytes(path, rank=None):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            if rank is None or f.startswith(f"__{rank}_"):
                total += os.path.getsize(os.path.join(root, f))
    return total


def run_rank(rank, model_name, method, kind, options, k, iters, warmup, wrap, workdir, results):
    import torch.distributed.checkpoint as dcp
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/init", rank=rank,
                            world_size=WORLD)
    # DCP's collectives on a group of their own: async_save runs them on a
    # background thread, beside DDP's all-reduces on the default group.
    checkpoint_group = dist.new_group(backend="gloo") if kind == "dcp" else None
    model, make_batch = make_model(model_name)
    ddp = wrapped(model, wrap)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pool = os.path.join(workdir, "pool.{rank}")
    opt = optimizer
    if kind == "pmsnap":
        opt = pmsnap.CheckpointedOptimizer(optimizer, pool, model=model, workers=1,
                                           part_bytes=1 << 20, **options)
    times, blocked, written = [], 0.0, 0
    pending = None
    run_start = time.perf_counter()
    for step in range(1, warmup + iters + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        start = time.perf_counter()
        ddp(make_batch(g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        t0 = time.perf_counter()
        if kind in ("dcp", "torch_save") and step % k == 0:
            target = os.path.join(workdir, f"ckpt-{step}")
            if kind == "torch_save":
                if rank == 0:
                    torch.save(state_dict(model, optimizer, wrap), target + ".pt")
            elif options["async"]:
                if pending is not None:
                    pending.result()
                pending = dcp.async_save(state_dict(model, optimizer, wrap), checkpoint_id=target,
                                         process_group=checkpoint_group)
            else:
                dcp.save(state_dict(model, optimizer, wrap), checkpoint_id=target,
                         process_group=checkpoint_group)
        t1 = time.perf_counter()
        if step > warmup:
            times.append(t1 - start)
            if kind != "pmsnap":
                blocked += t1 - t0  # the checkpoint call alone
    if pending is not None:
        pending.result()
    restore_seconds = None
    run_seconds = time.perf_counter() - run_start
    committed, checkpoint_bytes, pm = 0, 0, ""
    if kind == "pmsnap":
        opt.flush()
        stats = opt.stats()
        committed, pm = stats["epochs_committed"], stats["pm"]
        checkpoint_bytes = stats["bytes_written"] / max(1, committed)
        blocked = stats["blocked_seconds"] * iters / max(1, stats["steps"])
        written = stats["bytes_written"] / max(1, stats["steps"])
        opt.close()
        fresh, _ = make_model(model_name)
        if wrap == "fsdp2":
            wrapped(fresh, wrap)  # the same shards as the run that wrote the pool
        reopened = pmsnap.CheckpointedOptimizer(torch.optim.AdamW(fresh.parameters(), lr=1e-3),
                                                pool, model=fresh, workers=1, **options)
        t = time.perf_counter()
        reopened.restore()
        restore_seconds = time.perf_counter() - t
        reopened.close(abandon=True)
    elif kind == "dcp":
        latest = os.path.join(workdir, f"ckpt-{(warmup + iters) // k * k}")
        written = dir_bytes(workdir, rank) / (warmup + iters)
        fresh, _ = make_model(model_name)
        fresh_model = wrapped(fresh, wrap)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        fresh_model(make_batch(torch.Generator().manual_seed(0))).sum().backward()
        fresh_opt.step()  # DCP loads into existing optimizer state
        target = state_dict(fresh, fresh_opt, wrap)
        dist.barrier()
        t = time.perf_counter()
        dcp.load(target, checkpoint_id=latest, process_group=checkpoint_group)
        restore_seconds = time.perf_counter() - t
    elif kind == "torch_save":
        written = (dir_bytes(workdir) if rank == 0 else 0) / (warmup + iters)
        if rank == 0:
            t = time.perf_counter()
            torch.load(os.path.join(workdir, f"ckpt-{(warmup + iters) // k * k}.pt"),
                       weights_only=True)
            restore_seconds = time.perf_counter() - t
    dist.barrier()
    dist.destroy_process_group()
    results[rank] = {
        "iteration_s": statistics.median(times),
        "blocked_s_per_it": blocked / iters,
        "bytes_per_it": written,
        "restore_s": restore_seconds,
        "checkpoints_per_min": 60 * committed / run_seconds,
        "checkpoint_bytes": checkpoint_bytes,
        "pm": pm,
    }


def reshard_rank(rank, world, model_name, kind, options, k, iters, warmup, workdir, results):
    """Rank `rank` of `world` restoring the 2-rank FSDP2 run's checkpoint
    in `workdir` at this world size: (its restore time, for pmsnap the time
    of the reads alone)."""
    import torch.distributed.checkpoint as dcp
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/init-{world}", rank=rank,
                            world_size=world)
    model, make_batch = make_model(model_name)
    wrapped(model, "fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dist.barrier()
    reads = None
    if kind == "pmsnap":
        old = os.path.join(workdir, "pool.{rank}")
        # The reads alone (what dcp.load does), every rank at once as in
        # init_from: each shard's rows from the old pools, every part checked.
        from pmsnap import sharded
        from pmsnap.units import named_parameters
        t = time.perf_counter()
        sharded.load_resharded(old, model, optimizer, named_parameters(optimizer, model))
        dist.barrier()
        reads = time.perf_counter() - t
        # init_from as a user runs it: the same reads, then a new pool per
        # rank created and its first epoch committed.
        model, _ = make_model(model_name)
        wrapped(model, "fsdp2")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dist.barrier()
        t = time.perf_counter()
        opt = pmsnap.CheckpointedOptimizer(optimizer, os.path.join(workdir, "new.{rank}"),
                                           model=model, workers=1, **options, init_from=old)
        seconds = time.perf_counter() - t
        opt.close()
    else:
        model(make_batch(torch.Generator().manual_seed(0))).square().mean().backward()
        optimizer.step()  # DCP loads into existing optimizer state
        target = state_dict(model, optimizer, "fsdp2")
        dist.barrier()
        t = time.perf_counter()
        dcp.load(target, checkpoint_id=os.path.join(workdir, f"ckpt-{(warmup + iters) // k * k}"))
        seconds = time.perf_counter() - t
    dist.barrier()
    dist.destroy_process_group()
    results[rank] = (seconds, reads)


def restore_at_another_world_size(args, model_name, kind, options, workdir):
    """reshard_rank on args.reshard_to ranks over the 2-rank run's files."""
    return start_ranks(reshard_rank, (args.reshard_to, model_name, kind, options, args.k,
                                      args.iters, args.warmup, workdir), args.reshard_to)


def allreduce_latency(rank, workdir, rounds, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/init", rank=rank,
                            world_size=WORLD)
    coordinator = pmdist.TorchDistributedCoordinator()
    samples = []
    for i in range(rounds):
        t = time.perf_counter()
        coordinator.start_min_all_reduce([i, rank, 0])
        coordinator.finish_min_all_reduce()
        samples.append(time.perf_counter() - t)
    dist.destroy_process_group()
    results[rank] = statistics.median(samples[rounds // 10:])


def spawn(target, args, then=None):
    """Runs target(rank, *args(workdir), results) on WORLD ranks in a fresh
    work folder; returns their results, and then(workdir)'s (None without
    `then`: what runs on the files the ranks left, before they are removed)."""
    workdir = tempfile.mkdtemp(prefix="pmsnap-bench-dist-", dir="/dev/shm")
    try:
        per_rank = start_ranks(target, (*args(workdir),), WORLD)
        return per_rank, (then(workdir) if then is not None else None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def start_ranks(target, args, world):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(target, args=(*args, results), nprocs=world, join=True,
                           start_method="fork")
        return [results[r] for r in range(world)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--k", type=int, default=5, help="interval of the DCP/torch.save baselines")
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tag", default="distributed", help="name of the CSV and PNG files")
    parser.add_argument("--wrap", choices=("ddp", "fsdp2"), default="ddp",
                        help="fsdp2: the model sharded by fully_shard (each rank holds 1/N)")
    parser.add_argument("--reshard-to", type=int, default=3,
                        help="fsdp2: ranks of the restore at another world size (0: none)")
    args = parser.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    rows = []
    write_gbps = float(os.environ.get("PMSNAP_PM_WRITE_GBPS") or 0)  # simulated PM, if set
    for model_name in args.models.split(","):
        model, _ = make_model(model_name)
        state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
        none_time = None
        for method in args.methods.split(","):
            kind, options = METHODS[method]
            label = method.format(k=args.k)
            if args.wrap == "fsdp2" and (kind == "torch_save" or "sharding" in options):
                continue  # no whole-model save on rank 0; the shards are already spread
            reshard = (functools.partial(restore_at_another_world_size, args, model_name, kind,
                                         options)
                       if args.wrap == "fsdp2" and args.reshard_to and kind in ("pmsnap", "dcp")
                       else None)
            per_rank, resharded = spawn(
                run_rank, lambda d: (model_name, label, kind, options, args.k, args.iters,
                                     args.warmup, args.wrap, d), then=reshard)
            row = {
                "model": model_name, "wrap": args.wrap, "method": label, "ranks": WORLD,
                "state_mb": state_bytes / 1e6,
                "iteration_ms": 1e3 * max(r["iteration_s"] for r in per_rank),
                "blocked_ms_per_it": 1e3 * max(r["blocked_s_per_it"] for r in per_rank),
                "mb_per_rank_per_it": max(r["bytes_per_it"] for r in per_rank) / 1e6,
                "restore_ms": (1e3 * max(r["restore_s"] for r in per_rank
                                         if r["restore_s"] is not None)
                               if any(r["restore_s"] is not None for r in per_rank) else ""),
                "reshard_ranks": args.reshard_to if resharded else "",
                "restore_resharded_ms": 1e3 * max(r[0] for r in resharded) if resharded else "",
                "reshard_reads_ms": (1e3 * max(r[1] for r in resharded)
                                     if resharded and resharded[0][1] is not None else ""),
            }
            pm = next((r["pm"] for r in per_rank if r["pm"]), "")
            row["pm"] = pm
            row["checkpoints_per_min"] = min(r["checkpoints_per_min"] for r in per_rank)
            checkpoint_mb = max(r["checkpoint_bytes"] for r in per_rank) / 1e6
            row["limit_per_min"] = ""
            if kind == "pmsnap" and checkpoint_mb > 0:
                # A checkpoint captures a step: at most one per iteration of `none`.
                iterations_per_min = 60e3 / (none_time or row["iteration_ms"])
                row["limit_per_min"] = (min(60 * write_gbps * 1e3 / checkpoint_mb,
                                            iterations_per_min)
                                        if write_gbps > 0 else iterations_per_min)
            if kind == "none":
                none_time = row["iteration_ms"]
            row["overhead_pct"] = (100 * (row["iteration_ms"] / none_time - 1)
                                   if none_time else "")
            rows.append(row)
            print(f"{model_name:12s} {label:24s} {row['iteration_ms']:8.1f} ms/it "
                  f"overhead {overhead_text(row)}", flush=True)
    latency, _ = spawn(allreduce_latency, lambda d: (d, 300))
    with open(os.path.join(RESULTS, f"{args.tag}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(RESULTS, f"{args.tag}_allreduce.csv"), "w", newline="") as f:
        f.write("ranks,median_us\n")
        f.write(f"{WORLD},{1e6 * max(latency):.1f}\n")
    print_table(rows, latency)
    plot(rows, args.tag)


def overhead_text(row):
    return "" if row["overhead_pct"] == "" else f"{row['overhead_pct']:+.1f}%"


def print_table(rows, latency):
    pm = next((r["pm"] for r in rows if r["pm"]), "")
    print(f"\n2-rank {rows[0]['wrap'].upper()} on gloo, CPU, 2 cores (see the docstring); "
          "overhead vs `none`"
          + (f"; {pm} per rank" if pm else ""))
    other = next((r["reshard_ranks"] for r in rows if r["reshard_ranks"]), "")
    header = ("model", "method", "ms/it", "overhead", "blocked ms/it", "MB/rank/it", "restore ms",
              f"restore ms ({other} ranks)" if other else "restore ms (other ranks)",
              "ckpt/min", "limit/min", "% of limit")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        overhead = overhead_text(r)
        restore = "" if r["restore_ms"] == "" else f"{r['restore_ms']:.1f}"
        resharded = ("" if r["restore_resharded_ms"] == ""
                     else f"{r['restore_resharded_ms']:.1f}")
        if r["reshard_reads_ms"] != "":
            resharded += f" (reads {r['reshard_reads_ms']:.1f})"
        limit = r["limit_per_min"]
        rate = (f"{r['checkpoints_per_min']:.0f} | {limit:.0f} | "
                f"{100 * r['checkpoints_per_min'] / limit:.0f}%" if limit else " | | ")
        print(f"| {r['model']} | {r['method']} | {r['iteration_ms']:.1f} | {overhead} | "
              f"{r['blocked_ms_per_it']:.2f} | {r['mb_per_rank_per_it']:.2f} | {restore} | "
              f"{resharded} | "
              f"{rate} |")
    print(f"\nepoch-agreement all-reduce (3 int64, gloo side group): median "
          f"{1e6 * max(latency):.0f} us")


def plot(rows, tag):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model and r["overhead_pct"] != ""
                and r["method"] != "none"]
        ax.barh([r["method"] for r in mine], [r["overhead_pct"] for r in mine])
        pm = next((r["pm"] for r in rows if r["pm"]), "")
        ax.set_title(f"{model}: overhead vs no checkpoint (2-rank DDP, CPU)"
                     + (f"\n{pm}" if pm else ""), fontsize=9)
        ax.set_xlabel("%")
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{tag}.png"), dpi=110)


if __name__ == "__main__":
    sys.exit(main())
