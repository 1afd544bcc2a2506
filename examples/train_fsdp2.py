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

Thread-safety: one training thread per rank.
"""

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import pmsnap
from relaunch import run_kill_resume_and_move


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
    if args.init_from:
        # Another number of ranks: each rank reads the rows of its new
        # shards from the old run's pools and starts pools of its own.
        opt = pmsnap.CheckpointedOptimizer(optimizer, args.pool, model=model, every=1,
                                           init_from=args.init_from)
        start = opt.iteration + 1
        if rank == 0:
            print(f"on {dist.get_world_size()} ranks: continuing at step {start}", flush=True)
    else:
        opt = pmsnap.CheckpointedOptimizer(optimizer, args.pool, model=model, every=1)
        start = 1
        try:
            _, extra = opt.restore()
            start = extra["batch"] + 1
            if rank == 0:
                print(f"resumed: continuing at step {start}", flush=True)
        except pmsnap.NotFoundError:
            pass
    for step in range(start, args.steps + 1):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step(extra_state={"batch": step})
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or abs(step - args.kill_at) <= 1):
            print(f"step {step:4d}  loss {loss.item():.5f}", flush=True)
        if args.kill_at == step and rank == 1 and not args.resumed:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no close, no flush
    opt.close()
    stats = opt.stats()
    if rank == 0:
        print(f"rank 0 wrote {stats['bytes_written'] / max(1, stats['epochs_committed']) / 1e3:.1f} "
              f"kB per checkpoint ({stats['epochs_committed']} checkpoints)", flush=True)
    dist.destroy_process_group()
    # torch 2.11's gloo backend sometimes aborts in the interpreter's
    # finalization after an FSDP2 run ("terminate called without an active
    # exception", pytorch/pytorch#190489); everything is written and closed
    # by now, so leave without it.
    sys.stdout.flush()
    os._exit(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool", default="/dev/shm/pmsnap_fsdp2.{rank}.pool")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--resumed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--init-from", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:  # started by torchrun: a rank
        train(args)
        return
    # Started by hand: launch the job under torchrun, as a scheduler would,
    # relaunch it once a rank died, then continue on 3 ranks.
    run_kill_resume_and_move(__file__, args, world=2, new_world=3)


if __name__ == "__main__":
    main()
