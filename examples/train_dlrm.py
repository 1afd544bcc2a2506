#!/usr/bin/env python3
"""Train a DLRM-like recommendation model with pmsnap checkpointing every iteration.

The model follows DLRM's shape: a bottom MLP over dense features, a few
nn.EmbeddingBag tables over sparse ids, pairwise dot-product interactions and a
top MLP producing a click logit. Data is synthetic: dense features are
Gaussian, sparse ids follow a Zipf distribution (a few hot rows, a long tail,
as in real click logs) and labels come from a fixed, randomly initialised
"teacher" DLRM.

It runs the configuration pmsnap recommends for this model, and prints what
it chose and why: the embedding tables through a differential policy
(intermittent differential: Adagrad changes only the rows a batch looked up,
so each checkpoint writes those rows), the adaptive conflict strategy, and
where the machine has two or more CPUs the training thread pinned to one and
pmsnap's checkpoint workers to the others. --embedding-policy dense,
--strategy and --no-pin choose otherwise. --measure-overhead measures instead
of training: --rounds rounds (default 3), each a run with the plain optimizer
and a checkpointed run into a fresh pool, their order alternating, and
prints the median overhead with its spread and the time blocked in hooks.

Every iteration is checkpointed into the pool through pmsnap's
CheckpointedOptimizer; run the script again with the same pool (e.g. after
Ctrl-C or kill -9) and it resumes from the last committed iteration, with the
same data stream (the batch index and RNG states travel with the checkpoint).
Embedding tracking reports which fraction of each table the run touched, the
rows a differential checkpoint would write. With --embedding-policy the
tables are checkpointed that way (intermittent differential, IncrCP...,
optionally quantized with --quantize-bits): only the rows an interval
touched are written, and the script reports bytes per table checkpoint
against the table size and the retained checkpoints it can recover.

In an environment with pmsnap installed (README, "Python"):

    python3 examples/train_dlrm.py
    python3 examples/train_dlrm.py --iterations 400 \
        --device simulated:12:256 --strategy adaptive
    python3 examples/train_dlrm.py --fresh --embedding-policy incrcp --retain 4
    python3 examples/train_dlrm.py --fresh --measure-overhead

Thread-safety: a single-threaded script.
"""

import argparse
import os
import time

import torch
from torch import nn

import pmsnap


class DLRM(nn.Module):
    def __init__(self, dense_features, table_rows, dim):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense_features, 64), nn.ReLU(),
                                    nn.Linear(64, dim), nn.ReLU())
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum")
                                    for rows in table_rows)
        pairs = (len(table_rows) + 1) * len(table_rows) // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense, ids, offsets):
        x = self.bottom(dense)
        features = [x] + [table(i, o) for table, i, o in zip(self.tables, ids, offsets)]
        stacked = torch.stack(features, dim=1)                      # [B, F, dim]
        dots = torch.bmm(stacked, stacked.transpose(1, 2))          # [B, F, F]
        rows, cols = torch.tril_indices(len(features), len(features), offset=-1)
        return self.top(torch.cat([x, dots[:, rows, cols]], dim=1)).squeeze(1)


def zipf_ids(rows, count, exponent, generator):
    """`count` ids in [0, rows) with P(rank r) ~ 1 / r^exponent, hot rows scattered."""
    ranks = torch.arange(1, rows + 1, dtype=torch.float64)
    probs = ranks.pow(-exponent)
    ids = torch.multinomial(probs / probs.sum(), count, replacement=True, generator=generator)
    return (ids * 2654435761) % rows  # a fixed permutation-like spread of the hot rows


def make_batch(args, teacher, generator):
    dense = torch.randn(args.batch, args.dense, generator=generator)
    ids, offsets = [], []
    for rows in args.table_rows:
        lengths = torch.randint(1, args.max_ids + 1, (args.batch,), generator=generator)
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]))
        ids.append(zipf_ids(rows, int(lengths.sum()), args.zipf, generator))
    with torch.no_grad():
        labels = (teacher(dense, ids, offsets) > 0).float()
    return dense, ids, offsets, labels


def build(args):
    """A fresh model, teacher, Adagrad optimizer and data generator, seeded."""
    torch.manual_seed(0)
    model = DLRM(args.dense, args.table_rows, args.dim)
    teacher = DLRM(args.dense, args.table_rows, args.dim)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    return model, teacher, optimizer, torch.Generator().manual_seed(1)


def timed_run(args, checkpoint_kwargs=None):
    """One run of --iterations from scratch: (seconds per iteration after the
    first, blocked seconds per step). The first iteration creates the
    optimizer state (and the pool) and is left out. Plain optimizer when
    `checkpoint_kwargs` is None, else a CheckpointedOptimizer built with them
    (into a pool that must not exist yet; it is deleted afterwards)."""
    model, teacher, optimizer, generator = build(args)
    loss_fn = nn.BCEWithLogitsLoss()
    opt = optimizer
    if checkpoint_kwargs is not None:
        opt = pmsnap.CheckpointedOptimizer(optimizer, model=model, **checkpoint_kwargs)
    seconds = 0.0
    for it in range(1, args.iterations + 1):
        began = time.perf_counter()
        dense, ids, offsets, labels = make_batch(args, teacher, generator)
        opt.zero_grad()
        loss_fn(model(dense, ids, offsets), labels).backward()
        opt.step()
        if it > 1:
            seconds += time.perf_counter() - began
    blocked = 0.0
    if checkpoint_kwargs is not None:
        opt.close()
        s = opt.stats()
        blocked = s["blocked_seconds"] / max(1, s["steps"])
        os.remove(checkpoint_kwargs["pool"])
    return seconds / max(1, args.iterations - 1), blocked


def median_and_spread(values, scale, fmt):
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return f"{median * scale:{fmt}}  [{ordered[0] * scale:{fmt}} .. {ordered[-1] * scale:{fmt}}]"


def measure_overhead(args, checkpoint_kwargs):
    """--rounds rounds of a plain and a checkpointed run in this process, the
    order alternating so that neither side always runs first; prints each
    round and the medians with their spread."""
    plain, checkpointed, blocked, overhead = [], [], [], []
    pool = checkpoint_kwargs["pool"] + ".overhead"
    for round_number in range(1, args.rounds + 1):
        first_plain = round_number % 2 == 1
        for plain_turn in (first_plain, not first_plain):
            if plain_turn:
                seconds, _ = timed_run(args)
                plain.append(seconds)
            else:
                if os.path.exists(pool):
                    os.remove(pool)
                seconds, blocked_seconds = timed_run(args, dict(checkpoint_kwargs, pool=pool))
                checkpointed.append(seconds)
                blocked.append(blocked_seconds)
        overhead.append(checkpointed[-1] / plain[-1] - 1)
        print(f"  round {round_number}/{args.rounds}  plain {1e3 * plain[-1]:.3f} ms/it, "
              f"checkpointed {1e3 * checkpointed[-1]:.3f} ms/it ({100 * overhead[-1]:+.1f}%), "
              f"blocked {1e3 * blocked[-1]:.3f} ms/it", flush=True)
    print(f"overhead (median of {args.rounds} interleaved rounds of {args.iterations} "
          f"iterations, checkpoint every {args.every}  [min .. max])")
    print(f"  iteration time, plain optimizer       {median_and_spread(plain, 1e3, '.3f')} ms")
    print(f"  iteration time, checkpointed          "
          f"{median_and_spread(checkpointed, 1e3, '.3f')} ms")
    print(f"  overhead (checkpointed / plain - 1)   {median_and_spread(overhead, 1e2, '+.1f')} %")
    print(f"  blocked in hooks per iteration        {median_and_spread(blocked, 1e3, '.3f')} ms")


def make_parser():
    """The command line; its defaults are the model and run this example trains
    (bench/python_overhead.py --workload dlrm reuses them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", default=os.path.join(os.environ.get("PMSNAP_POOL_DIR",
                                                                      "/dev/shm"),
                                                       "pmsnap-dlrm.pool"))
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dense", type=int, default=13)
    parser.add_argument("--table-rows", type=int, nargs="+", default=[20000, 5000, 50000, 1000])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--max-ids", type=int, default=4, help="ids per bag, at most")
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--device", default="host", help="host, simulated:GBPS:MEM_MIB, cuda")
    parser.add_argument("--strategy", default="adaptive", help='"1".."4" or adaptive')
    parser.add_argument("--every", type=int, default=1, help="checkpoint interval (iterations)")
    parser.add_argument("--fresh", action="store_true", help="delete the pool first")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--embedding-policy", default="intermittent",
                        help="checkpoint the tables with full, one-shot, incremental, "
                             "intermittent (default) or incrcp; dense: as dense parameters")
    parser.add_argument("--no-pin", action="store_true",
                        help="leave the training thread and the workers to the OS scheduler")
    parser.add_argument("--measure-overhead", action="store_true",
                        help="measure instead of training: --rounds rounds of a plain and a "
                             "checkpointed run of --iterations, interleaved")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of --measure-overhead (default 3)")
    parser.add_argument("--quantize-bits", default=None,
                        help="quantize table checkpoints: 2, 3, 4, 8 or auto")
    parser.add_argument("--retain", type=int, default=None,
                        help="table checkpoints kept recoverable (default 2)")
    return parser


def checkpoint_kwargs_of(args, worker_cpus):
    """The CheckpointedOptimizer keywords (besides optimizer and model) that
    the command line `args` choose, with checkpoint workers on `worker_cpus`
    (None: the OS scheduler's choice)."""
    embedding_kwargs = {}
    if args.embedding_policy != "dense":
        embedding_kwargs = dict(embedding_policy=args.embedding_policy, retain=args.retain)
        if args.quantize_bits is not None:
            bits = args.quantize_bits
            embedding_kwargs["quantize_bits"] = bits if bits == "auto" else int(bits)
    return dict(pool=args.pool, every=args.every, device=args.device, strategy=args.strategy,
                track_embeddings=True, worker_cpus=worker_cpus, **embedding_kwargs)


def main():
    parser = make_parser()
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    allowed = sorted(os.sched_getaffinity(0))
    worker_cpus = None
    if not args.no_pin and len(allowed) >= 2:
        os.sched_setaffinity(0, {allowed[0]})  # this thread: the training thread
        worker_cpus = allowed[1:]
    print("configuration:")
    if args.embedding_policy == "dense":
        print("  embedding tables  written in full every checkpoint (--embedding-policy dense)")
    else:
        print(f"  embedding tables  {args.embedding_policy}: Adagrad changes only the rows a batch "
              "looked up, so a checkpoint writes those rows (the tables' lookups are tracked)")
    print(f"  conflict strategy {args.strategy}"
          + (": picks per unit from the last epoch's profile" if args.strategy == "adaptive"
             else ""))
    if worker_cpus:
        print(f"  CPUs              training thread on CPU {allowed[0]}, checkpoint workers on "
              f"CPU(s) {', '.join(map(str, worker_cpus))}: copies never take the training core")
    else:
        print("  CPUs              not pinned"
              + (" (--no-pin)" if args.no_pin else f" (this process may use {len(allowed)} CPU)"))

    if args.fresh and os.path.exists(args.pool):
        os.remove(args.pool)
    checkpoint_kwargs = checkpoint_kwargs_of(args, worker_cpus)
    if args.measure_overhead:
        if args.rounds < 1:
            parser.error("--rounds must be at least 1")
        measure_overhead(args, checkpoint_kwargs)
        return

    loss_fn = nn.BCEWithLogitsLoss()
    model, teacher, optimizer, generator = build(args)
    opt = pmsnap.CheckpointedOptimizer(optimizer, model=model, **checkpoint_kwargs)
    if opt.device_note:
        print(f"pmsnap: {opt.device_note}")
    start = 0
    if pmsnap.has_checkpoint(args.pool):
        start, extra = opt.restore()
        generator.set_state(extra["data_rng"])
        print(f"resumed from {args.pool} at iteration {start}")
    else:
        print(f"new pool {args.pool}")

    began = time.perf_counter()
    with opt:
        for it in range(start + 1, args.iterations + 1):
            dense, ids, offsets, labels = make_batch(args, teacher, generator)
            opt.zero_grad()
            loss = loss_fn(model(dense, ids, offsets), labels)
            loss.backward()
            # Stored with this iteration's checkpoint: where the data stream is.
            opt.step(extra_state={"data_rng": generator.get_state()})
            if it % 50 == 0 or it == args.iterations:
                s = opt.stats()
                print(f"iter {it:5d}  loss {loss.item():.4f}  checkpoints {s['epochs_committed']}"
                      f"  last committed {s['last_committed_iteration']}"
                      f"  blocked {1e3 * s['blocked_seconds'] / max(1, s['steps']):.3f} ms/step")
                for name in opt.embedding_tables:
                    last = opt.last_checkpoint(name)
                    weight = dict(model.named_parameters())[name]
                    # The unit: the weight plus its row-shaped optimizer state (Adagrad's sum).
                    row_tensors = 1 + sum(1 for v in optimizer.state[weight].values()
                                          if isinstance(v, torch.Tensor) and v.dim() >= 1
                                          and v.shape[0] == weight.shape[0])
                    table_bytes = weight.numel() * 4 * row_tensors
                    print(f"    {name}: last checkpoint {'full' if last['full'] else 'partial'}"
                          f", {last['rows_written']} rows, {last['bytes_written'] / 1024:.1f} KiB"
                          f" ({100 * last['bytes_written'] / table_bytes:.1f}% of table + state)")
        tracker = opt.embedding_tracker
        touched = ", ".join(f"{name} {100 * tracker.touched_fraction(name):.1f}%"
                            for name in tracker.tables)
        for name in opt.embedding_tables:
            retained = ", ".join(str(c["iteration"]) for c in pmsnap.list_checkpoints(opt, name))
            print(f"{name}: recoverable at iterations {retained} "
                  f"(pmsnap.recover_table(pool, '{name}', epoch))")
    elapsed = time.perf_counter() - began
    s = opt.stats()
    print(f"{args.iterations - start} iterations in {elapsed:.1f} s; rows touched: {touched}")
    print(s["summary"])
    print(f"pool {args.pool}: last committed iteration "
          f"{pmsnap.read_pool(args.pool)['latest']['iteration']}")


if __name__ == "__main__":
    main()
