"""dcp.load from the pools of a CheckpointedOptimizer run on any number of ranks.

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)    # this run's shards
    dcp.load({"model": model_sd, "optim": optim_sd},
             storage_reader=pmsnap.dcp.PoolReader("/mnt/pmem/run.{rank}.pool"))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

pmsnap.dcp.PoolReader with a "{rank}" template reads the pools a run of
CheckpointedOptimizer wrote (one per rank) as one DCP checkpoint: the newest
iteration every pool holds. Its metadata describes every tensor by its
global shape and the chunks the old ranks held (the layouts the pools
recorded: FSDP2 / DTensor shards, torchrec table shards; a plain tensor is
one chunk from rank 0's pool), so DCP's planner reshards to whatever this
run holds, on any number of ranks; each rank reads only the rows of the old
chunks its shards overlap (CheckpointReader.read_range, every part read
checked), all ranks at once (CheckpointReader maps a pool read-only,
without libpmemobj's lock).

Keys: the model's parameters and buffers under "<fqn>" and "model.<fqn>";
optimizer state under "optim.state.<fqn>.<key>" and
"optimizer.state.<fqn>.<key>" (get_state_dict's layout under either
name); the param groups (hyperparameters and parameter names, as
get_state_dict gives them) under "optim.param_groups" and
"optimizer.param_groups". Non-tensor optimizer state is not offered.

Thread-safety: one thread per reader, as DCP uses them.
"""

import io
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from . import _pmsnap
from . import distributed as _distributed
from . import extra_state as _extra
from . import sharded as _sharded
from .errors import make_error
from .units import PARAM_ROLE, torch_dtype

MODEL_PREFIXES = ("", "model.")
OPTIMIZER_PREFIXES = ("optim.", "optimizer.")


@dataclass(frozen=True)
class Chunk:
    """Where one stored chunk lies: pool `pool`'s unit and tensor, its shape
    and, for a unit encoded as an embedding table, the table's name."""
    pool: int
    unit: int
    tensor: int
    shape: tuple
    table: str = None


def run_metadata(template, coordinator):
    """(paths, epochs, Metadata) of the newest iteration every pool of
    `template` holds. Rank 0 reads the pools' manifests and extra states;
    every rank gets the result (a collective when `coordinator`)."""
    def read():
        paths = _sharded.rank_pools(template)
        readers = [_pmsnap.CheckpointReader(path) for path in paths]
        try:
            _, epochs = _sharded.common_iteration(readers, paths)
            blobs = [_extra.unpack(r.extra_state(e)) for r, e in zip(readers, epochs)]
            manifests = [_sharded.read_manifest(r) for r in readers]
        finally:
            for r in readers:
                r.close()
        return paths, epochs, _metadata(blobs, manifests)
    if coordinator is None:
        return read()
    result = None
    with _distributed.together(coordinator):
        if coordinator.rank() == 0:
            result = read()
    return _distributed.gather_objects(coordinator, result)[0]


def _metadata(blobs, manifests):
    """DCP Metadata of the pools (their extra states `blobs`, manifests and
    encoded units `manifests`), and where each chunk lies (storage_data)."""
    tensors = {}  # key -> (dtype, global shape, {offsets: Chunk})
    for pool, (blob, (manifest, tables)) in enumerate(zip(blobs, manifests)):
        for name, (unit, roles) in manifest.items():
            if _pmsnap.is_buffers_unit(name):
                for key, (t, dtype, shape) in roles.items():
                    _add(tensors, [p + key for p in MODEL_PREFIXES], dtype, shape, None,
                         Chunk(pool, unit, t, tuple(shape)))
                continue
            parameter = _pmsnap.parameter_of_companion(name) or name
            shards = (blob.get("shards") or {}).get(parameter)
            param_shape = manifest[parameter][1][PARAM_ROLE][2] if parameter in manifest else None
            for role, (t, dtype, shape) in roles.items():
                layout = _sharded.role_layout(blob, parameter, role)
                if (shards is not None and "roles" not in shards and role != PARAM_ROLE
                        and shape != param_shape):
                    layout = None  # a DTensor's `step`: a plain tensor beside its shards
                if role == PARAM_ROLE:
                    keys = [p + parameter for p in MODEL_PREFIXES]
                else:
                    keys = [f"{p}state.{parameter}.{role}" for p in OPTIMIZER_PREFIXES]
                chunk = Chunk(pool, unit, t, tuple(shape), name if name in tables else None)
                _add(tensors, keys, dtype, shape, layout, chunk)
    state = {}
    storage = {}
    for key, (dtype, size, chunks) in tensors.items():
        state[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch_dtype(dtype)), size=torch.Size(size),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(c.shape))
                    for o, c in chunks.items()])
        for offsets, chunk in chunks.items():
            storage[MetadataIndex(key, torch.Size(offsets))] = chunk
    groups = _param_groups(blobs[0])
    if groups is not None:
        for prefix in OPTIMIZER_PREFIXES:
            key = prefix + "param_groups"
            state[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = groups
    return Metadata(state_dict_metadata=state, storage_data=storage)


def _add(tensors, keys, dtype, shape, layout, chunk):
    """Records `chunk` (at the offsets of `layout`, or whole) under `keys`;
    a region already recorded (a replica) is read once."""
    size = list(shape) if layout is None else list(layout["global_shape"])
    offsets = tuple([0] * len(shape) if layout is None else layout["offsets"])
    for key in keys:
        _, known_size, chunks = tensors.setdefault(key, (dtype, size, {}))
        if known_size != size:
            raise make_error(_pmsnap.ModelMismatchError,
                             f"'{key}' is {known_size} in one pool and {size} in another")
        chunks.setdefault(offsets, chunk)


def _param_groups(blob):
    """torch.save bytes of [{hyperparameter: value, "params": [names]}], the
    param groups as get_state_dict gives them, or None without names."""
    groups, names = blob.get("param_groups"), blob.get("param_names")
    if groups is None or names is None:
        return None
    buffer = io.BytesIO()
    torch.save([dict(g, params=list(n)) for g, n in zip(groups, names)], buffer)
    return buffer.getvalue()


def read_requests(paths, epochs, metadata, requests, planner, coordinator):
    """Fills DCP's read requests of this rank from the pools (a collective
    when `coordinator`: a failing rank fails every rank)."""
    def read():
        readers = {}
        try:
            for req in requests:
                source = metadata.storage_data[req.storage_index]
                if isinstance(source, bytes):
                    planner.load_bytes(req, io.BytesIO(source))
                    continue
                reader = readers.get(source.pool)
                if reader is None:
                    reader = readers[source.pool] = _pmsnap.CheckpointReader(paths[source.pool])
                _read_request(reader, epochs[source.pool], source, req, planner,
                              paths[source.pool])
        finally:
            for reader in readers.values():
                reader.close()
    with _distributed.together(coordinator):
        read()


def _read_request(reader, epoch, source, req, planner, path):
    target = planner.resolve_tensor(req).detach()
    offsets, lengths = list(req.storage_offsets), list(req.lengths)
    if not source.shape:  # a scalar (`step`)
        piece = torch.empty((), dtype=target.dtype)
        reader.read_tensor(epoch, source.unit, source.tensor, piece.data_ptr())
    else:
        rows = _sharded.read_rows(reader, epoch, source.unit, source.tensor, source.table,
                                  list(source.shape), offsets[0], lengths[0], target.dtype)
        piece = rows[(slice(None),) + tuple(slice(o, o + n) for o, n in
                                            zip(offsets[1:], lengths[1:]))]
    if target.size() != piece.size():
        raise make_error(_pmsnap.ModelMismatchError,
                         f"pool {path}: '{req.storage_index.fqn}' gives {list(piece.size())} "
                         f"where the state dict wants {list(target.size())}")
    target.copy_(piece)
    planner.commit_tensor(req, target)
