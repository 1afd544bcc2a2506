"""A sharded trainer for the FSDP2 / DTensor crash tests, run by torchrun
(gloo, CPU).

--model fsdp2: the MLP of ddp_trainer.py under torch.distributed.fsdp's
  fully_shard (each Linear, then the root): DTensor parameters Shard(0) over
  the ranks, and Adam's moments DTensors like them. Each rank trains on its
  own batches.
--model dtensor: parameters made with distribute_tensor directly, on a
  device mesh of --mesh ("2": 1-D; "2x1", "1x2": 2-D), some Shard(0), some
  Shard(1), some Replicate(); the forward gathers them (full_tensor), every
  rank on the same batch. --reverse-ranks lays the mesh over the ranks in
  reverse order (each rank then holds the other rank's shards).

Checkpoints every iteration through pmsnap.CheckpointedOptimizer into one
pool per rank, restoring first (or, with --init-from, starting from the
pools of a run on another number of ranks, after writing what it loaded);
the kill plan (ddp_trainer.py) SIGKILLs a rank a fraction of its step time
after a step. --plain trains without pmsnap
(the reference). At the end every rank writes its parameters and optimizer
state gathered to full tensors, its per-rank pool bytes, and the error of a
failed restore (--expect-mismatch: the restore must fail, nothing trains).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import pmsnap
from ddp_trainer import exit_after_gloo, train_steps

torch.set_num_threads(1)


def fsdp2_model(world):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class DTensorMLP(torch.nn.Module):
    """Weights sharded by rows and by columns, biases replicated."""

    def __init__(self, mesh):
        super().__init__()
        torch.manual_seed(0)
        # The placement for each mesh dimension: sharded along the last one
        # (of size world), replicated along the others.
        def placed(shard):
            return [Replicate()] * (mesh.ndim - 1) + [shard] if mesh.ndim > 1 and \
                mesh.shape[-1] > 1 else [shard] + [Replicate()] * (mesh.ndim - 1)

        def param(shape, placement):
            return torch.nn.Parameter(distribute_tensor(torch.randn(shape) * 0.3, mesh,
                                                        placement))

        self.w1 = param((12, 32), placed(Shard(1)))
        self.b1 = param((32,), [Replicate()] * mesh.ndim)
        self.w2 = param((32, 4), placed(Shard(0)))
        self.b2 = param((4,), placed(Shard(0)))

    def forward(self, x):
        h = torch.tanh(x @ self.w1.full_tensor() + self.b1.full_tensor())
        return h @ self.w2.full_tensor() + self.b2.full_tensor()


def dtensor_model(world, spec, reverse):
    dims = tuple(int(d) for d in spec.split("x"))
    assert dims and torch.tensor(dims).prod().item() == world, f"mesh {spec} for {world} ranks"
    ranks = list(range(world))[::-1] if reverse else list(range(world))
    mesh = DeviceMesh("cpu", torch.tensor(ranks).view(dims))
    return DTensorMLP(mesh)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def gathered(model, optimizer):
    """Every parameter and optimizer state tensor, gathered to full tensors."""
    return {"params": {name: full(p) for name, p in model.named_parameters()},
            "state": {f"{name}.{key}": full(value) for name, p in model.named_parameters()
                      for key, value in optimizer.state[p].items()}}


def dcp_load(model, optimizer, template, out):
    """The model and optimizer state from the pools of `template` through
    dcp.load (pmsnap.dcp.PoolReader), as get_state_dict lays them out;
    writes them gathered to `out`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state},
             storage_reader=pmsnap.dcp.PoolReader(template))
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    torch.save(gathered(model, optimizer), out)
    exit_after_gloo()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kills", default="",
                        help="rank:step:fraction per attempt, comma-separated")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--model", choices=("fsdp2", "dtensor"), default="fsdp2")
    parser.add_argument("--mesh", default="2")
    parser.add_argument("--reverse-ranks", action="store_true")
    parser.add_argument("--expect-mismatch", action="store_true")
    parser.add_argument("--init-from", default=None,
                        help="start from the pools of a run on another number of ranks")
    parser.add_argument("--dcp-load", default=None,
                        help="only dcp.load the pools of a run (PoolReader) and write them")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = (fsdp2_model(world) if args.model == "fsdp2"
             else dtensor_model(world, args.mesh, args.reverse_ranks))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    start, opt = 1, optimizer
    if args.dcp_load:
        dcp_load(model, optimizer, args.dcp_load, os.path.join(args.out, f"dcp{rank}.pt"))
        return
    if args.init_from:
        opt = pmsnap.CheckpointedOptimizer(optimizer, args.pool, model=model, every=1,
                                           init_from=args.init_from)
        start = opt.iteration + 1
        torch.save(gathered(model, optimizer), os.path.join(args.out, f"restored{rank}.pt"))
    elif not args.plain:
        opt = pmsnap.CheckpointedOptimizer(optimizer, args.pool, model=model, every=1)
        try:
            _, extra = opt.restore()
            start = extra["batch"] + 1
        except pmsnap.NotFoundError:
            pass  # no rank holds a checkpoint yet (the same answer on every rank)
        except pmsnap.ModelMismatchError as e:
            if not args.expect_mismatch:
                raise
            with open(os.path.join(args.out, f"rank{rank}.error"), "w") as f:
                f.write(str(e))
            exit_after_gloo()
    train_steps(model, opt, optimizer, args, start, rank,
                rank if args.model == "fsdp2" else 0, attempt)
    pool_bytes = None
    if not args.plain:
        opt.close()
        pool_bytes = opt.stats()["bytes_written"] // max(1, opt.stats()["epochs_committed"])
    torch.save(dict(gathered(model, optimizer), start=start, epoch_bytes=pool_bytes,
                    local_bytes=sum(p.to_local().numel() * p.element_size()
                                    for p in model.parameters()),
                    global_bytes=sum(p.numel() * p.element_size() for p in model.parameters())),
               os.path.join(args.out, f"rank{rank}.pt"))
    exit_after_gloo()


if __name__ == "__main__":
    main()
