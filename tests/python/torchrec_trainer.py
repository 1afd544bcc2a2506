"""A torchrec DLRM trainer for the sharded-embedding tests, run by torchrun
(gloo, CPU, fbgemm-gpu-cpu).

torchrec's DLRM (dense arch, over arch, an EmbeddingBagCollection of three
tables of uneven row counts) under DistributedModelParallel with --plan
table_wise (table i on rank i % world) or row_wise (every table's rows split
over the ranks); the tables' optimizer is fbgemm's EXACT_ROWWISE_ADAGRAD,
fused into backward; the dense part (data-parallel under DMP) trains with
Adam. Each rank trains on its own deterministic batches.

Checkpoints every iteration through pmsnap.CheckpointedOptimizer (the dense
Adam wrapped; the fused tables found through DMP) into one pool per rank,
restoring first (or, with --init-from, starting from the pools of a run on
another plan or number of ranks, after writing what it loaded); the kill
plan (ddp_trainer.py) SIGKILLs a rank a fraction of its step time after a
step. --plain trains without pmsnap (the reference); --record too, writing
after every step k every tensor pmsnap checkpoints, keyed like the pool
(test_one_step.py). --mode continuous checkpoints while the next steps train;
--rows-scale multiplies the tables' rows (copies long enough to overlap the
next step's lookups). At the end every rank writes its shards of the tables
and their state (with their offsets), the dense parameters and Adam's state.
"""

import argparse
import logging
import os
import warnings

import torch
import torch.distributed as dist

import pmsnap
from ddp_trainer import exit_after_gloo, train_steps

torch.set_num_threads(1)

TABLES = [("t0", 40), ("t1", 27), ("t2", 33)]  # uneven rows: row-wise shards differ
DIM = 8
DENSE = 4
BATCH = 8


def quiet():
    """fbgemm warns on import that its compatibility table lacks torch 2.11
    (it is the release built for it); torchrec's planner logs its plans."""
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")


def make_model(world, plan):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (construct_module_sharding_plan, row_wise,
                                                    table_wise)
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM
    torch.manual_seed(0)
    configs = [EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=rows,
                                  feature_names=[f"f_{name}"]) for name, rows in TABLES]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE,
                 dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1])
    sharder = EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    placement = {"table_wise": lambda i: table_wise(rank=i % world, compute_kernel="fused"),
                 "row_wise": lambda i: row_wise(compute_kernel="fused")}[plan]
    module_plan = construct_module_sharding_plan(
        ebc, {name: placement(i) for i, (name, _) in enumerate(TABLES)}, local_size=world,
        world_size=world, device_type="cpu", sharder=sharder)
    return DistributedModelParallel(
        model, device=torch.device("cpu"), sharders=[sharder],
        plan=ShardingPlan({"sparse_arch.embedding_bag_collection": module_plan}))


def dense_optimizer(model):
    """Adam over the parameters torchrec does not update in backward."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    return torch.optim.Adam([p for _, p in in_backward_optimizer_filter(model.named_parameters())],
                            lr=1e-2)


def batch(step, rank):
    from torchrec import KeyedJaggedTensor
    g = torch.Generator().manual_seed(1000 * step + rank)
    dense = torch.randn(BATCH, DENSE, generator=g)
    lengths, values = [], []
    for _, rows in TABLES:
        n = torch.randint(0, 4, (BATCH,), generator=g)
        lengths.append(n)
        values.append(torch.randint(0, rows, (int(n.sum()),), generator=g))
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{name}" for name, _ in TABLES],
                                                 values=torch.cat(values),
                                                 lengths=torch.cat(lengths))
    labels = (dense.sum(dim=1) > 0).float()
    return dense, sparse, labels


def snapshot(model, optimizer):
    """{(unit, role): this rank's tensor} as pmsnap names them in the pool."""
    out = {}
    for name, (_, t) in local_state(model, optimizer)["tables"].items():
        unit, _, role = name.rpartition(".")
        out[(name, "param") if role == "weight" else (unit, role)] = t
    for name, p in model.named_parameters():
        if any(p is q for g in optimizer.param_groups for q in g["params"]):
            out[(name, "param")] = p.detach().clone()
            for key, value in optimizer.state.get(p, {}).items():
                out[(name, key)] = value.clone()
    return out


def local_state(model, optimizer):
    """This rank's share: each table shard and its state with their offsets,
    the dense parameters and Adam's state (every rank holds them)."""
    fused = model.fused_optimizer
    tables = {}
    for name, sharded in fused.params.items():
        for shard in sharded.local_shards():
            tables[name] = (list(shard.metadata.shard_offsets), shard.tensor.clone())
        for key, value in fused.state.get(sharded, {}).items():
            for shard in getattr(value, "local_shards", lambda: [])():
                tables[f"{name}.{key.rpartition('.')[2]}"] = (list(shard.metadata.shard_offsets),
                                                               shard.tensor.clone())
    named = {id(p): n for n, p in model.named_parameters()}
    dense = {named[id(p)]: p.detach().clone() for g in optimizer.param_groups
             for p in g["params"]}
    state = {f"{named[id(p)]}.{k}": v.clone() for p, s in optimizer.state.items()
             for k, v in s.items()}
    return {"tables": tables, "dense": dense, "state": state}


def main():
    quiet()
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kills", default="",
                        help="rank:step:fraction per attempt, comma-separated")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--mode", choices=("every", "continuous"), default="every")
    parser.add_argument("--rows-scale", type=int, default=1)
    parser.add_argument("--policy", default=None, help="embedding policy of the fused tables")
    parser.add_argument("--quantize-bits", type=int, default=None)
    parser.add_argument("--plan", choices=("table_wise", "row_wise"), default="table_wise")
    parser.add_argument("--init-from", default=None,
                        help="start from the pools of a run on another plan or number of ranks")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    TABLES[:] = [(name, rows * args.rows_scale) for name, rows in TABLES]
    model = make_model(world, args.plan)
    optimizer = dense_optimizer(model)
    start, opt, history = 1, optimizer, {}
    kwargs = {"every": 1} if args.mode == "every" else {"mode": args.mode}
    if args.policy:
        kwargs.update(embedding_policy=args.policy, quantize_bits=args.quantize_bits)
    if args.init_from:
        opt = pmsnap.CheckpointedOptimizer(optimizer, args.pool, model=model,
                                           init_from=args.init_from, **kwargs)
        start = opt.iteration + 1
        torch.save(dict(local_state(model, optimizer), iteration=opt.iteration),
                   os.path.join(args.out, f"restored{rank}.pt"))
    elif not (args.plain or args.record):
        opt = pmsnap.CheckpointedOptimizer(optimizer, args.pool, model=model, **kwargs)
        try:
            _, extra = opt.restore()
            start = extra["batch"] + 1
        except pmsnap.NotFoundError:
            pass  # no rank holds a checkpoint yet (the same answer on every rank)
    def loss_of(step):
        dense, sparse, labels = batch(step, rank)
        logits = model(dense, sparse).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)

    train_steps(None, opt, optimizer, args, start, rank, rank, attempt, loss_of=loss_of,
                recorded=lambda step: history.__setitem__(step, snapshot(model, optimizer)))
    written = {}
    if args.record:
        torch.save(history, os.path.join(args.out, f"history{rank}.pt"))
    elif not args.plain:
        opt.flush()
        # What each table's last checkpoint wrote (rows_written, full...).
        written = {name: opt.last_checkpoint(name) for name in opt.embedding_tables}
        opt.close()
    torch.save(dict(local_state(model, optimizer), start=start, iteration=args.steps,
                    written=written),
               os.path.join(args.out, f"rank{rank}.pt"))
    exit_after_gloo()


if __name__ == "__main__":
    main()
