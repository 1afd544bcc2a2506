"""torch.distributed.checkpoint (DCP) storage backed by a pmsnap pool.

    import torch.distributed.checkpoint as dcp
    dcp.save(state_dict, storage_writer=pmsnap.dcp.PoolWriter("/dev/shm/run.pool"))
    dcp.load(state_dict, storage_reader=pmsnap.dcp.PoolReader("/dev/shm/run.pool"))

Users of DCP keep their loop and get the pool's properties: every dcp.save
is one epoch of the pool, written with its commit protocol (data parts
persisted and checksummed, then one atomic commit), so a crash during a save
leaves the previous save loadable, bit for bit; every read checks the
checksums (CorruptionError naming the pool, the epoch and the tensor).

Layout: each tensor chunk DCP writes is one unit of the pool (named by its
fully qualified name, with "@offsets" for a shard that does not start at 0),
holding one tensor "value"; DCP's Metadata and its non-tensor entries are
pickled into the epoch's extra state. The pool is created by the first save
(the extra-state capacity sized for its metadata) and must be saved with the
same tensors afterwards (ModelMismatchError otherwise); it retains the last
two saves (PoolReader(path, epoch=...) reads the older).

Limits: one process (no process group, or a group of one): DCP's finish()
runs on the coordinator only, and a pool is one process's file. Tensors are
copied to CPU memory before they are written.

PoolReader("<run>.{rank}.pool") instead reads the pools of a
CheckpointedOptimizer run on any number of ranks as one DCP checkpoint, on
any number of ranks: dcp.load reshards from them (dcp_pools.py).

Thread-safety: one thread per writer or reader, as DCP uses them.
"""

import io
import os
import pickle

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import _pmsnap
from . import dcp_pools as _pools
from . import distributed as _distributed
from .errors import make_error
from .sharded import is_pool_template
from .units import dtype_name, torch_dtype

_FORMAT = "pmsnap-dcp-1"
_ROLE = "value"


def _unit_name(index):
    """The unit of a tensor chunk: its FQN, plus "@o1,o2" unless it starts at 0."""
    offsets = tuple(index.offset or ())
    if any(offsets):
        return f"{index.fqn}@{','.join(str(int(o)) for o in offsets)}"
    return index.fqn


def _check_single_process(what):
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        raise make_error(_pmsnap.FailedPreconditionError,
                         f"{what}: pmsnap.dcp pools serve one process; with "
                         f"{torch.distributed.get_world_size()} ranks use FileSystemWriter, or "
                         "CheckpointedOptimizer(process_group=...) for per-rank pools")


class PoolWriter(StorageWriter):
    """A DCP StorageWriter that commits each dcp.save as one epoch of pool `path`."""

    def __init__(self, path, *, extra_state_capacity=None, part_bytes=4 << 20):
        super().__init__()
        self.path = os.fspath(path)
        self._capacity = extra_state_capacity
        self._part_bytes = part_bytes
        self._writer = None
        self._bytes = {}

    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self):
        from torch.distributed.checkpoint.metadata import StorageMeta
        return StorageMeta(checkpoint_id=self.path)

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        _check_single_process(f"dcp.save to pool {self.path}")

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner):
        units, tensor_items = [], []
        byte_items = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                byte_items.append(item)
                continue
            props, chunk = item.tensor_data.properties, item.tensor_data.chunk
            name = dtype_name(props.dtype)
            if name not in _pmsnap.DTYPES:
                raise make_error(_pmsnap.InvalidArgumentError,
                                 f"dcp.save to pool {self.path}: '{item.index.fqn}' is {name}, "
                                 f"which a pool cannot hold ({', '.join(_pmsnap.DTYPES)})")
            units.append((_unit_name(item.index), [(_ROLE, name, list(chunk.sizes))]))
            tensor_items.append(item)
        capacity = self._capacity or (1 << 20) + 4096 * len(plan.items)
        self._writer = _pmsnap.PoolFileWriter(self.path, units, capacity, self._part_bytes)
        try:
            latest = self._writer.latest_iteration()
            self._writer.begin((latest or 0) + 1)
            results = []
            for u, item in enumerate(tensor_items):
                tensor = planner.resolve_data(item).detach().to("cpu").contiguous()
                if tensor.numel():
                    self._writer.write_tensor(u, 0, tensor.data_ptr())
                results.append(WriteResult(index=item.index,
                                           size_in_bytes=tensor.numel() * tensor.element_size(),
                                           storage_data=units[u][0]))
            for item in byte_items:
                data = planner.resolve_data(item)
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                key = f"bytes:{item.index.fqn}"
                self._bytes[key] = raw
                results.append(WriteResult(index=item.index, size_in_bytes=len(raw),
                                           storage_data=key))
        except BaseException:
            self._close(abandon=True)
            raise
        future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata, results):
        """Commits the epoch: DCP's metadata and byte entries go in its extra state."""
        if self._writer is None:
            raise make_error(_pmsnap.FailedPreconditionError,
                             f"dcp.save to pool {self.path}: finish() without write_data()")
        storage = {}
        for result_list in results:
            storage.update({r.index: r.storage_data for r in result_list})
        metadata.storage_data = storage
        blob = pickle.dumps({"format": _FORMAT, "metadata": metadata, "bytes": self._bytes},
                            protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._writer.commit(blob)
        except BaseException:
            self._close(abandon=True)
            raise
        self._close()

    def _close(self, abandon=False):
        writer, self._writer = self._writer, None
        self._bytes = {}
        if writer is not None:
            if abandon:
                writer.abandon()
            writer.close()


class PoolReader(StorageReader):
    """A DCP StorageReader of the newest (or `epoch`) dcp.save committed to
    pool `path`; or, for a `path` with "{rank}", of the newest iteration the
    pools of a CheckpointedOptimizer run hold (dcp_pools.py: any world size,
    on every rank of this one; `epoch` does not apply)."""

    def __init__(self, path, *, epoch=None):
        super().__init__()
        self.path = os.fspath(path)
        self.epoch = epoch
        self._reader = None
        self._epoch = None
        self._bytes = None
        self._units = None
        self._run = None  # (paths, epochs, Metadata) of a run's pools
        if is_pool_template(self.path) and epoch is not None:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"PoolReader({self.path!r}): epoch= names one pool's epoch; a "
                             "run's pools are read at the newest iteration they all hold")

    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return isinstance(checkpoint_id, (str, os.PathLike)) and (
            os.path.isfile(checkpoint_id) or is_pool_template(checkpoint_id))

    def _open(self):
        if self._reader is not None:
            return
        if not os.path.exists(self.path):
            raise make_error(_pmsnap.NotFoundError, f"pool {self.path} does not exist")
        self._reader = _pmsnap.CheckpointReader(self.path)
        epochs = [e["epoch"] for e in self._reader.epochs()]
        if self.epoch is None:
            if not epochs:
                self._close()
                raise make_error(_pmsnap.NotFoundError,
                                 f"pool {self.path} holds no committed dcp.save")
            self._epoch = epochs[0]
        else:
            self._epoch = int(self.epoch)
        self._units = {name: u for u, (name, _, _) in
                       enumerate(self._reader.describe()["units"])}

    def read_metadata(self):
        if is_pool_template(self.path):
            self._run = _pools.run_metadata(self.path, _distributed.coordinator_for(None))
            return self._run[2]
        self._open()
        try:
            blob = pickle.loads(self._reader.extra_state(self._epoch))
        except _pmsnap.Error:
            self._close()
            raise
        except Exception as e:  # noqa: BLE001 - whatever the bytes were
            self._close()
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"pool {self.path} epoch {self._epoch} was not written by "
                             f"pmsnap.dcp.PoolWriter ({e})") from e
        if not isinstance(blob, dict) or blob.get("format") != _FORMAT:
            self._close()
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"pool {self.path} epoch {self._epoch} was not written by "
                             "pmsnap.dcp.PoolWriter (a CheckpointedOptimizer pool? use "
                             "pmsnap.load_state_dict)")
        self._bytes = blob["bytes"]
        metadata = blob["metadata"]
        if not isinstance(metadata, Metadata):
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"pool {self.path} epoch {self._epoch}: no DCP metadata")
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        if is_pool_template(self.path):
            return
        _check_single_process(f"dcp.load from pool {self.path}")
        self._open()
        if self._bytes is None:
            self.read_metadata()

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        from torch.distributed._shard._utils import narrow_tensor_by_index

        if is_pool_template(self.path):
            paths, epochs, metadata = self._run
            _pools.read_requests(paths, epochs, metadata, plan.items, planner,
                                 _distributed.coordinator_for(None))
            future = Future()
            future.set_result(None)
            return future
        self._open()
        if self._bytes is None:
            self.read_metadata()
        units = self._reader.describe()["units"]
        metadata = planner.metadata if hasattr(planner, "metadata") else None
        cache = {}
        try:
            for req in plan.items:
                key = metadata.storage_data[req.storage_index] if metadata is not None \
                    else _unit_name(req.storage_index)
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(self._bytes[key]))
                    continue
                stored = cache.get(key)
                if stored is None:
                    u = self._units[key]
                    _, dtype, shape, _ = units[u][2][0]
                    stored = torch.empty(shape, dtype=torch_dtype(dtype))
                    if stored.numel():
                        self._reader.read_tensor(self._epoch, u, 0, stored.data_ptr())
                    cache = {key: stored}  # one stored chunk at a time
                piece = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != piece.size():
                    raise make_error(_pmsnap.ModelMismatchError,
                                     f"pool {self.path} epoch {self._epoch}: "
                                     f"'{req.storage_index.fqn}' is {list(piece.size())} in the "
                                     f"pool, {list(target.size())} in the state dict")
                target.copy_(piece)
                planner.commit_tensor(req, target)
        finally:
            self._close()
        future = Future()
        future.set_result(None)
        return future

    def _close(self):
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        self._bytes = None


__all__ = ["PoolWriter", "PoolReader"]
