"""A DDP trainer for the multi-rank crash test, run by torchrun (gloo, CPU).

Trains a small MLP with Adam under DistributedDataParallel, each rank on its
own deterministic batches, and checkpoints every iteration through
pmsnap.CheckpointedOptimizer into one pool per rank. On restart attempt i
(TORCHELASTIC_RESTART_COUNT) it first restores, then, if the kill plan has an
entry for attempt i, the named rank SIGKILLs itself a fraction of its own
measured step time after the named step: inside the next step's update, its
checkpoint's commit, or between steps. torchrun then restarts every rank.
At the end every rank writes its parameters and optimizer state.

  --plain: the same training with the plain optimizer (the reference).
  --sharding replicated: each rank writes only the parameters it owns.
  --lowdiff-plus: checkpoint with pmsnap.LowDiffPlus instead (the gradients
    snapshotted from DDP's buckets, the optimizer applied again to a host
    replica that commits every iteration).
"""

import argparse
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import pmsnap

torch.set_num_threads(1)


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 12, generator=g)
    return x, x.sum(dim=1, keepdim=True).repeat(1, 4).sin()


def kill_plan(kills, attempt):
    """(rank, step, fraction) of restart attempt `attempt`'s kill in `kills`
    ("rank:step:fraction" per attempt, comma-separated); (-1, 0, 0.0): none."""
    plan = [k.split(":") for k in kills.split(",") if k]
    if attempt >= len(plan):
        return -1, 0, 0.0
    rank, step, fraction = plan[attempt]
    return int(rank), int(step), float(fraction)


def kill_after(began, fraction):
    """SIGKILLs this process `fraction` of the time since `began` from now
    (a step's time measured on this machine: inside the next update, its
    commit, or between steps)."""
    delay = fraction * (time.monotonic() - began)
    threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()


def train_steps(forward, opt, optimizer, args, start, rank, data_rank, attempt, loss_of=None,
                recorded=None):
    """Steps start..args.steps: the loss (loss_of(step), default MSE of
    forward(x) on batch(step, data_rank)), backward, then the plain
    optimizer (--plain, or --record: recorded(step) after each step) or
    pmsnap's step with the data position; this attempt's planned kill
    (--kills) after its step."""
    if loss_of is None:
        def loss_of(step):
            x, y = batch(step, data_rank)
            return torch.nn.functional.mse_loss(forward(x), y)
    plain = getattr(args, "plain", False) or getattr(args, "record", False)
    victim, kill_step, fraction = kill_plan(args.kills, attempt)
    print(f"rank {rank} attempt {attempt} starts at {start}", flush=True)
    for step in range(start, args.steps + 1):
        began = time.monotonic()
        loss_of(step).backward()
        if plain:
            opt.step()
            if recorded is not None:
                recorded(step)
        else:
            opt.step(extra_state={"batch": step})
        optimizer.zero_grad(set_to_none=True)
        if rank == victim and step == kill_step:
            kill_after(began, fraction)


def exit_after_gloo(code=0):
    """Waits for every rank, destroys the process group and leaves the
    process without the interpreter's finalization, once every result is
    written: torch 2.11's gloo backend sometimes aborts there after an FSDP2
    run ("terminate called without an active exception", about 1 run in 12
    here: a gloo worker thread met during finalization,
    pytorch/pytorch#190489)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kills", default="", help="rank:step:fraction per attempt, comma-separated")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--sharding", default=None, help='"replicated": sharded writes')
    parser.add_argument("--lowdiff-plus", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = 1
    if args.plain:
        opt = optimizer
    else:
        if args.lowdiff_plus:
            opt = pmsnap.LowDiffPlus(ddp, optimizer, args.pool, sharding=args.sharding)
        else:
            opt = pmsnap.CheckpointedOptimizer(optimizer, args.pool, model=model, every=1,
                                               sharding=args.sharding)
        try:
            _, extra = opt.restore()
            start = extra["batch"] + 1
        except pmsnap.NotFoundError:
            pass  # no rank holds a checkpoint yet (the same answer on every rank)
    train_steps(ddp, opt, optimizer, args, start, rank, rank, attempt)
    if not args.plain:
        opt.close()
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "optimizer": optimizer.state_dict(), "start": start},
               os.path.join(args.out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
