"""A DDP trainer for LowDiff's crash tests, run by torchrun (gloo, CPU).

The MLP and batches of ddp_trainer.py, under DistributedDataParallel with a
LowDiff compressor (--compressor powersgd | topk), Adam. Every step is
checkpointed by pmsnap.lowdiff.LowDiff (full checkpoints every --full-every
steps, differentials in batches of --batch). On start it restores (full
checkpoint + replayed differentials) and writes what it restored to
restored_rank<r>.pt; if --kill rank:step:fraction names this rank, it
SIGKILLs itself a fraction of its own measured step time after that step
(fraction "now": at once, before the next step begins).

  --reference: the same training with the same compressor hook and the
  plain optimizer, no pmsnap; writes the state after every step to
  reference_rank<r>.pt (what a restore to iteration n must equal).
  --sharded: full checkpoints sharded over the ranks (each rank's pool holds
  its share of them, and every differential).
  --check-decompress: after every backward, the decompression of this
  step's records must equal the gradients DDP produced, bitwise.
"""

import argparse
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import pmsnap
from pmsnap import lowdiff

from ddp_trainer import batch

torch.set_num_threads(1)


def state_of(model, optimizer):
    return {"params": [p.detach().clone() for p in model.parameters()],
            "optimizer": {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                          for k, s in optimizer.state_dict()["state"].items()}}


def make_compressor(name):
    if name == "powersgd":
        return lowdiff.PowerSGD(matrix_approximation_rank=2, start_powerSGD_iter=3)
    return lowdiff.TopK(ratio=0.1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--compressor", default="topk")
    parser.add_argument("--full-every", type=int, default=7)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--kill", default="")
    parser.add_argument("--sharded", action="store_true",
                        help="full checkpoints sharded over the ranks (sharding=\"replicated\")")
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--check-decompress", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    compressor = make_compressor(args.compressor)
    start = 1
    states = {}
    if args.reference:
        compressor.attach(ddp)
        opt = None
    else:
        opt = lowdiff.LowDiff(optimizer, args.pool, ddp, compressor, full_every=args.full_every,
                              batch=args.batch, workers=1,
                              sharding="replicated" if args.sharded else None)
        try:
            n, extra, info = opt.restore()
            assert extra["batch"] == n, (extra, n)
            start = n + 1
            torch.save(dict(state_of(model, optimizer), iteration=n, **info),
                       os.path.join(args.out, f"restored_rank{rank}.pt"))
        except pmsnap.NotFoundError:
            pass
    victim, kill_step, fraction = -1, 0, 0.0
    if args.kill:
        v, s, f = args.kill.split(":")
        victim, kill_step, fraction = int(v), int(s), (None if f == "now" else float(f))
    print(f"rank {rank} starts at {start}", flush=True)
    for step in range(start, args.steps + 1):
        began = time.monotonic()
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if args.check_decompress:
            records = compressor._records
            assert records, f"rank {rank} step {step}: the hook recorded nothing"
            kinds = {int(desc[0]) for desc, _ in records}
            # PowerSGD allreduces uncompressed (kind 0) before start_powerSGD_iter.
            assert step <= 3 or 0 not in kinds, (step, kinds)
            shapes = [tuple(p.shape) for p in model.parameters()]
            for desc, tensors in records:
                d = desc.tolist()
                params = d[2:2 + d[1]]
                got = compressor.decompress_bucket(d[0], d, list(tensors), params, shapes)
                for i in params:
                    want = list(model.parameters())[i].grad
                    assert torch.equal(got[i], want), f"rank {rank} step {step} parameter {i}"
        if args.reference:
            compressor.take()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            states[step] = state_of(model, optimizer)
        else:
            opt.step(extra_state={"batch": step})
            opt.zero_grad(set_to_none=True)
        if rank == victim and step == kill_step:
            if fraction is None:  # "now": right after the step, before anything else
                os.kill(os.getpid(), signal.SIGKILL)
            delay = fraction * (time.monotonic() - began)
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    if opt is not None:
        stats = opt.stats()
        opt.close()
        torch.save(stats["log"], os.path.join(args.out, f"stats_rank{rank}.pt"))
    if args.reference:
        torch.save(states, os.path.join(args.out, f"reference_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
