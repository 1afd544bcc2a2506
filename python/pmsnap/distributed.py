"""pmsnap across the ranks of torch.distributed.

Every rank checkpoints into its own pool; the ranks agree, through
torch.distributed collectives only, on which iterations they capture and
which one they restore, so that the pools together hold one consistent
checkpoint (docs/ARCHITECTURE.md, "Many ranks"). This module holds the
coordination over torch.distributed; CheckpointedOptimizer(process_group=...)
uses it.

    coordinator = pmsnap.distributed.TorchDistributedCoordinator()  # world group
    agreement = pmsnap.distributed.EpochAgreement(coordinator)
"""

import contextlib
import pickle

import torch
import torch.distributed as dist

from . import _pmsnap
from .errors import make_error

EpochAgreement = _pmsnap.EpochAgreement


class TorchDistributedCoordinator(_pmsnap.Coordinator):
    """runtime::Coordinator on torch.distributed.

    pmsnap's exchanges (a few integers per step, bytes at restore) run on a
    gloo side group over the ranks of `process_group` (default: the world),
    so they stay on the CPU and never queue behind the training's NCCL
    collectives. Creating it is itself a collective: every rank of the
    default group must create one, in the same order as its other groups.

    Raises FailedPreconditionError when torch.distributed is not initialized.
    Thread-safety: one training thread (pmsnap's engine calls it from there).
    """

    def __init__(self, process_group=None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise make_error(_pmsnap.FailedPreconditionError,
                         "torch.distributed is not initialized: call "
                         "torch.distributed.init_process_group first (torchrun sets it up)")
        self._rank = dist.get_rank(process_group)
        self._world_size = dist.get_world_size(process_group)
        ranks = (dist.get_process_group_ranks(process_group) if process_group is not None
                 else list(range(dist.get_world_size())))
        self._group = dist.new_group(ranks=ranks, backend="gloo")
        self._pending = None

    def rank(self):
        return self._rank

    def world_size(self):
        return self._world_size

    def start_min_all_reduce(self, values):
        if self._pending is not None:
            raise make_error(_pmsnap.FailedPreconditionError,
                         f"rank {self._rank}: an all-reduce is already in flight")
        values = torch.tensor(values, dtype=torch.int64)
        work = dist.all_reduce(values, op=dist.ReduceOp.MIN, group=self._group, async_op=True)
        self._pending = (work, values)

    def finish_min_all_reduce(self):
        if self._pending is None:
            raise make_error(_pmsnap.FailedPreconditionError,
                         f"rank {self._rank}: no all-reduce in flight")
        (work, values), self._pending = self._pending, None
        work.wait()
        return values.tolist()

    def broadcast(self, data, root):
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
            torch.empty(0, dtype=torch.uint8)
        dist.broadcast(buffer, group=self._group, group_src=root)
        return buffer.numpy().tobytes()


def coordinator_for(process_group):
    """The coordinator CheckpointedOptimizer uses: None for a single process
    (torch.distributed not initialized, or a group of one rank)."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(process_group) == 1:
        return None
    return TorchDistributedCoordinator(process_group)


def rank_pool_path(template, coordinator):
    """`template` with "{rank}" replaced by this rank (unchanged alone).

    InvalidArgumentError when several ranks share a template without
    "{rank}": two ranks must never write one pool file."""
    if coordinator is None:
        return template
    if "{rank}" not in template:
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"{coordinator.world_size()} ranks cannot share pool {template}: put "
                         "{rank} in the path, e.g. /mnt/pmem/run.{rank}.pool")
    return template.replace("{rank}", str(coordinator.rank()))


def gather_objects(coordinator, obj):
    """Every rank's picklable `obj`, in rank order, on every rank (a
    collective: every rank calls it). Sizes travel in one MIN all-reduce
    (each rank fills its own entry), then one broadcast per rank."""
    data = pickle.dumps(obj)
    world, rank = coordinator.world_size(), coordinator.rank()
    sizes = [2**63 - 1] * world
    sizes[rank] = len(data)
    coordinator.start_min_all_reduce(sizes)
    sizes = coordinator.finish_min_all_reduce()
    return [pickle.loads(coordinator.broadcast(data if r == rank else bytes(sizes[r]), r))
            for r in range(world)]


@contextlib.contextmanager
def together(coordinator):
    """Runs the block on every rank; if it raised a pmsnap.Error on any rank,
    raises on every rank (the lowest failing rank's error, its class and
    message) instead of leaving the others waiting in a collective. Alone
    (coordinator None) it changes nothing."""
    if coordinator is None:
        yield
        return
    error = None
    try:
        yield
    except _pmsnap.Error as e:
        error = e
    world, rank = coordinator.world_size(), coordinator.rank()
    coordinator.start_min_all_reduce([world if error is None else rank])
    failed = coordinator.finish_min_all_reduce()[0]
    if failed >= world:
        return
    mine = f"{type(error).__name__}\0rank {rank}: {error}" if failed == rank else ""
    text = coordinator.broadcast(mine.encode()[:4095].ljust(4096, b"\0"), failed)
    if failed == rank:
        raise error
    name, _, message = text.rstrip(b"\0").decode(errors="replace").partition("\0")
    raise make_error(getattr(_pmsnap, name, _pmsnap.Error), message)
