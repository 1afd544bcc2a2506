#!/usr/bin/env python3
"""FSDP2 training that checkpoints every step and survives a killed rank.

A small MLP sharded with torch.distributed.fsdp.fully_shard (every rank holds
1/N of each weight and of AdamW's moments), trained on CPU with gloo. pmsnap
checkpoints each rank's shards into its own pool every step; the script
kills rank 1 with SIGKILL at --kill-at, then relaunches the job itself (as a
scheduler would) and the ranks resume from the newest step both committed,
bit-exact. It prints the loss around the crash and the per-rank bytes of one
checkpoint. Then it moves the run to 3 ranks: new pools started from the 2
ranks' ones (init_from), each rank reading only the rows of its new shards.

    python3 examples/train_fsdp2.py          # launches torchrun: kill, then resume
    torchrun --nproc_per_node=2 examples/train_fsdp2.py --kill-at 0   # one plain run

pmsnap's calls (CheckpointedOptimizer, restore, init_from) are in
relaunch.py's open_checkpointed, shared with train_torchrec.py.

Thread-safety: one training thread per rank.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from relaunch import (example_arguments, open_checkpointed, run_kill_resume_and_move,
                      train_and_close)


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 64, generator=g)
    return x, x[:, :8].sin()


def train(args):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step_loss(step):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt, start = open_checkpointed(optimizer, model, args, rank,
                                   f"on {dist.get_world_size()} ranks")
    train_and_close(opt, args, rank, start, step_loss)


def main():
    args = example_arguments("/dev/shm/pmsnap_fsdp2.{rank}.pool", steps=60,
                             kill_at=25).parse_args()
    if "LOCAL_RANK" in os.environ:  # started by torchrun: a rank
        train(args)
        return
    # Started by hand: launch the job under torchrun, as a scheduler would,
    # relaunch it once a rank died, then continue on 3 ranks.
    run_kill_resume_and_move(__file__, args, world=2, new_world=3)


if __name__ == "__main__":
    main()
