#!/usr/bin/env python3
"""torchrec DLRM training that checkpoints every step, survives a killed
rank, and moves to another sharding plan on more ranks.

torchrec's DLRM with three embedding tables under DistributedModelParallel,
on CPU with gloo (fbgemm-gpu-cpu). The tables are sharded table-wise over 2
ranks and trained by fbgemm's fused EXACT_ROWWISE_ADAGRAD inside backward;
the dense part trains data-parallel with Adam. pmsnap wraps the dense
optimizer and finds the fused tables through DMP: each rank checkpoints its
table shards with their optimizer state, and the dense part, into its own
pool every step. The script kills rank 1 with SIGKILL at --kill-at, then
relaunches the job (as a scheduler would) and the ranks resume from the
newest step both committed, bit-exact, printing the loss around the crash.
Then it moves the run to 4 ranks with every table row-wise sharded: new
pools started from the 2 ranks' ones (init_from), each rank reading only
the rows of its new shards, and the optimizer state following its rows.

    python3 examples/train_torchrec.py      # launches torchrun: kill, resume, 4 ranks
    torchrun --nproc_per_node=2 examples/train_torchrec.py --kill-at 0   # one plain run

Needs torchrec and fbgemm-gpu-cpu (scripts/requirements-nodeps.txt pins the
releases for torch 2.11). pmsnap's calls (CheckpointedOptimizer, restore,
init_from) are in relaunch.py's open_checkpointed, shared with
train_fsdp2.py. Thread-safety: one training thread per rank.
"""

import logging
import os
import warnings

import torch
import torch.distributed as dist

from relaunch import (example_arguments, open_checkpointed, run_kill_resume_and_move,
                      train_and_close)

TABLES = [("user", 5000), ("item", 20000), ("category", 300)]
DIM = 16


def make_model(plan_kind, world):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (construct_module_sharding_plan, row_wise,
                                                    table_wise)
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=rows,
                                 feature_names=[name]) for name, rows in TABLES]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=8,
                 dense_arch_layer_sizes=[32, DIM], over_arch_layer_sizes=[32, 1])
    sharder = EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    placement = (lambda i: table_wise(rank=i % world, compute_kernel="fused")) \
        if plan_kind == "table_wise" else (lambda i: row_wise(compute_kernel="fused"))
    plan = construct_module_sharding_plan(
        ebc, {name: placement(i) for i, (name, _) in enumerate(TABLES)},
        local_size=world, world_size=world, device_type="cpu", sharder=sharder)
    return DistributedModelParallel(
        model, device=torch.device("cpu"), sharders=[sharder],
        plan=ShardingPlan({"sparse_arch.embedding_bag_collection": plan}))


def batch(step, rank):
    from torchrec import KeyedJaggedTensor
    g = torch.Generator().manual_seed(1000 * step + rank)
    dense = torch.randn(64, 8, generator=g)
    lengths = torch.randint(1, 4, (len(TABLES), 64), generator=g)
    values = torch.cat([torch.randint(0, rows, (int(n.sum()),), generator=g)
                        for (_, rows), n in zip(TABLES, lengths)])
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[name for name, _ in TABLES],
                                                 values=values, lengths=lengths.flatten())
    return dense, sparse, (dense[:, 0] > 0).float()


def train(args):
    # fbgemm 1.6 warns that its table of known torch releases lacks 2.11,
    # the release it was built for; torchrec logs its plans.
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(args.plan, world)
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    # The dense optimizer: the parameters torchrec does not update in backward.
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    optimizer = torch.optim.Adam(dense, lr=1e-3)

    def step_loss(step):
        dense_x, sparse, labels = batch(step, rank)
        logits = model(dense_x, sparse).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        return loss

    # Under --init-from, another plan on another number of ranks.
    opt, start = open_checkpointed(optimizer, model, args, rank, f"on {world} ranks, {args.plan}")
    train_and_close(opt, args, rank, start, step_loss)


def main():
    parser = example_arguments("/dev/shm/pmsnap_torchrec.{rank}.pool", steps=40, kill_at=15)
    parser.add_argument("--plan", choices=("table_wise", "row_wise"), default="table_wise")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:  # started by torchrun: a rank
        train(args)
        return
    run_kill_resume_and_move(__file__, args, world=2, new_world=4,
                             extra=("--plan", "table_wise"), new_extra=("--plan", "row_wise"))


if __name__ == "__main__":
    main()
