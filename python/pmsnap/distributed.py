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
import warnings

import torch
import torch.distributed as dist

from . import _pmsnap
from . import extra_state as _extra
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


class PeerReplicas:
    """Each rank's per-rank state (RNG states, data position, user extra
    state) kept by the ranks that keep its replicas, so that a rank whose
    pool is lost (a replaced node) restores its own, not another rank's
    ([lossless]). With R replicas, rank r's state is sent to ranks r+1 ..
    r+R-1 (mod the world size) at every checkpointed step and stored in
    their checkpoints; any R-1 lost pools leave a copy of each rank's.

    The exchange is point-to-point on a gloo group of its own (not the
    coordinator's, whose all-reduce the engine keeps in flight across
    steps), and so collective: every rank calls send_and_receive at the
    same steps (the checkpointed ones, which all ranks agree on), and
    recover after the same restore.

    Thread-safety: the training thread."""

    def __init__(self, coordinator, replicas, process_group=None):
        self.rank, self.world = coordinator.rank(), coordinator.world_size()
        ranks = (dist.get_process_group_ranks(process_group) if process_group is not None
                 else list(range(dist.get_world_size())))
        self._group = dist.new_group(ranks=ranks, backend="gloo")
        count = min(replicas, self.world) - 1
        self.targets = sorted({(self.rank + k) % self.world for k in range(1, count + 1)})
        self.sources = sorted({(self.rank - k) % self.world for k in range(1, count + 1)})

    def _exchange(self, tensor_of_target, tensor_of_source):
        ops = [dist.P2POp(dist.isend, tensor_of_target(t), dist.get_global_rank(self._group, t),
                          self._group) for t in self.targets]
        ops += [dist.P2POp(dist.irecv, tensor_of_source(s), dist.get_global_rank(self._group, s),
                           self._group) for s in self.sources]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def send_and_receive(self, own):
        """Sends this rank's `own` bytes to its targets; returns {source rank:
        bytes} from the ranks whose state this rank keeps."""
        size = torch.tensor([len(own)], dtype=torch.int64)
        sizes = {s: torch.zeros(1, dtype=torch.int64) for s in self.sources}
        self._exchange(lambda t: size, lambda s: sizes[s])
        payload = torch.frombuffer(bytearray(own), dtype=torch.uint8) if own else \
            torch.zeros(0, dtype=torch.uint8)
        received = {s: torch.empty(int(sizes[s]), dtype=torch.uint8) for s in self.sources}
        self._exchange(lambda t: payload, lambda s: received[s])
        return {s: received[s].numpy().tobytes() for s in self.sources}

    def recover(self, kept, own):
        """After a restore, on every rank: `kept` ({rank: bytes} this rank's
        checkpoint kept for its sources; {} where the pool was lost) and
        whether this rank's own state came back (`own`). Returns this rank's
        own bytes from a peer's copy where it did not, else None (also when
        no surviving peer kept one: more pools lost than replicas cover)."""
        everything = [None] * self.world
        dist.all_gather_object(everything, (own, kept), group=self._group)
        if own:
            return None
        for holder_own, holder_kept in everything:
            if holder_own and self.rank in holder_kept:
                return holder_kept[self.rank]
        return None

    def own_extra_state(self, blob, own, pool):
        """This rank's own extra state after a restore of `pool`: `blob` (the
        unpacked extra state the engine restored) where it is this rank's
        (`own`), else the copy a peer kept. Where the pool was lost and no
        surviving rank kept a copy, warns and returns `blob` (another rank's
        state: not bit-exact for per-rank state). Collective, like recover."""
        recovered = self.recover(blob.get("peers", {}) if own else {}, own)
        if recovered is not None:
            return _extra.unpack(recovered)
        if not own:
            warnings.warn(f"pmsnap: rank {self.rank}'s pool {pool} was lost and no "
                          "surviving rank kept its extra state (RNG states, data position, "
                          f"extra_state): it resumes with rank {self.rank}'s neighbour's, "
                          "which is not bit-exact for per-rank state", RuntimeWarning,
                          stacklevel=4)
        return blob


def one_rank_at_a_time(coordinator, read):
    """read() on each rank in turn (alone: once), each turn under together()
    so that a failing rank fails every rank; returns this rank's result. For
    reads that cannot overlap, such as opening pool files, which libpmemobj
    locks to one process at a time."""
    if coordinator is None:
        return read()
    result = None
    for turn in range(coordinator.world_size()):
        with together(coordinator):
            if turn == coordinator.rank():
                result = read()
    return result


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
