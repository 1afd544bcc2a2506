"""A 2-rank FSDP2 trainer for the one-step-one-checkpoint test, run by
torchrun (gloo, CPU).

Every tensor pmsnap checkpoints changes at every step in a way that tells
the step apart: the weights (Adam, a gradient of ones), Adam's moments and
its `step`, and a buffer that counts forward passes. With --record the run
uses the plain optimizer and writes, for every step k, every such tensor as
it is after step k (this rank's shards), keyed like the pool: (unit, role).
Otherwise it checkpoints through pmsnap (--mode every or continuous), after
a restore, and the kill plan of ddp_trainer.py may SIGKILL a rank.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import pmsnap
from ddp_trainer import exit_after_gloo, train_steps

torch.set_num_threads(1)


class Counted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(16, 32)
        self.second = torch.nn.Linear(32, 4)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        self.forwards += 1
        # Loss = the sum of every weight: each gradient is all ones.
        return (self.first.weight.sum() + self.first.bias.sum() + self.second.weight.sum()
                + self.second.bias.sum()) + 0 * x.sum()


def snapshot(model, optimizer):
    """{(unit, role): this rank's tensor} as pmsnap names them in the pool."""
    out = {}
    for name, p in model.named_parameters():
        out[(name, "param")] = p.to_local().detach().clone()
        for key, value in optimizer.state.get(p, {}).items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[(name, key)] = local.detach().clone()
    out[("#buffers", "forwards")] = model.forwards.detach().clone()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kills", default="")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--mode", default="every")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = Counted()
    fully_shard(model.first)
    fully_shard(model.second)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    start, opt, history = 1, optimizer, {}
    if not args.record:
        kwargs = {"every": 1} if args.mode == "every" else {"mode": args.mode}
        opt = pmsnap.CheckpointedOptimizer(optimizer, args.pool, model=model, **kwargs)
        try:
            _, extra = opt.restore()
            start = extra["batch"] + 1
        except pmsnap.NotFoundError:
            pass
    train_steps(None, opt, optimizer, args, start, rank, rank, attempt,
                loss_of=lambda step: model(torch.ones(2, 16)),
                recorded=lambda step: history.__setitem__(step, snapshot(model, optimizer)))
    if args.record:
        torch.save(history, os.path.join(args.out, f"history{rank}.pt"))
    else:
        opt.close()
    exit_after_gloo()


if __name__ == "__main__":
    main()
