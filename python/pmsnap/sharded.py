"""Sharded parameters (FSDP2's fully_shard, distribute_tensor): DTensors.

A DTensor parameter and its DTensor optimizer state are checkpointed as
their local shards: each rank's pool holds the shards that rank owns, weight
by weight as for any parameter (units.local_tensor), so the bytes a rank
writes are its 1/N of the model. Beside them each checkpoint's extra state
records every sharded parameter's layout on that rank (units.sharded_layout:
global shape, placements, mesh shape, the shard's offsets: what DCP keeps of
a shard), so that a restore can tell a pool of another layout from its own.

Restore at the same world size is bit-exact (every rank restores its own
pool into its shards; ranks agree on the epoch as for DDP). A rank whose
shard of a parameter covers another region of the global tensor than the
one its pool holds (another world size, another rank order) is refused with
ModelMismatchError naming the rank and the parameter; a new mesh that gives
every rank the same region restores as it is.

Another world size: CheckpointedOptimizer(..., init_from="<old>.{rank}.pool")
starts a new run's pools from the pools of a run on any number of ranks
(load_resharded). Each new rank computes its shards' regions, finds the old
shards that overlap them from their recorded layouts, and reads of each only
the rows it needs (CheckpointReader.read_range: the pool parts those rows
lie in, each checked against its checksum); replicated regions are read
once. No process holds more than its own shards plus one old shard's rows
at a time. The newest iteration every old pool holds is the one loaded.

The engine's ranks agree that they run the same model through a
fingerprint of the global shapes (fingerprint), since local shapes differ
between ranks when a dimension does not divide evenly.

sharding="replicated" assumes every rank holds the same tensors and spreads
their writes; sharded parameters already are spread, so the two are not
combined (InvalidArgumentError).

Thread-safety: the training thread that owns the CheckpointedOptimizer.
"""

import hashlib
import math
import os

import torch

from . import _pmsnap
from . import extra_state as _extra
from .errors import make_error
from .units import (PARAM_ROLE, dtype_name, is_dtensor, local_tensor, new_state_tensor,
                    shape_text, sharded_layout, torch_dtype)


def layouts(named, sharding):
    """{name: layout} of the DTensor parameters among `named` [(name, p)],
    or None when there are none. InvalidArgumentError for sharded
    parameters under sharding="replicated"."""
    out = {name: layout for name, p in named
           if (layout := sharded_layout(name, p)) is not None}
    if out and sharding == "replicated":
        name = next(iter(out))
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"parameter '{name}' is a sharded DTensor (FSDP2 / distribute_tensor): "
                         "every rank already checkpoints only its own shards, so "
                         "sharding='replicated' (for ranks that hold the same tensors) does "
                         "not apply; leave sharding at its default")
    return out or None


def fingerprint(named):
    """The whole model's identity for the ranks' agreement (the engine's
    model_fingerprint): every parameter's name, dtype and global shape. Each
    rank registers its own shards, whose shapes differ between ranks when a
    dimension does not divide evenly, so the default (this rank's manifest)
    would call the ranks' models different."""
    text = ";".join(f"{name}:{dtype_name(p.dtype)}:{list(p.shape)}" for name, p in named)
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return value or 1


def check_restored(recorded, current, pool, rank):
    """ModelMismatchError naming `rank`, `pool` and the first parameter whose
    shard in the restored checkpoint (`recorded`, from its extra state)
    covers another region than this run's (`current`)."""
    recorded, current = recorded or {}, current or {}
    for name in sorted(set(recorded) | set(current)):
        was, now = recorded.get(name), current.get(name)
        if _region(was) == _region(now):
            continue
        where = f"rank {rank}: " if rank is not None else ""
        raise make_error(_pmsnap.ModelMismatchError,
                         f"{where}pool {pool}: parameter '{name}' was checkpointed as "
                         f"{_describe(was)} but is {_describe(now)} in this run; a pool "
                         "restores at the world size it was written with, each rank holding "
                         "the same shards")


def _region(layout):
    """What a shard holds: its global tensor's shape and its offsets in it."""
    return None if layout is None else (layout["global_shape"], layout["offsets"])


def _describe(layout):
    if layout is None:
        return "a plain (unsharded) tensor"
    return (f"a shard at offsets {layout['offsets']} of {layout['global_shape']} placed "
            f"{layout['placements']} on a mesh of {layout['mesh_shape']}")


def is_pool_template(path):
    """Whether init_from=`path` names the pools of a multi-rank run."""
    return "{rank}" in os.fspath(path)


def load_resharded(template, model, optimizer, named):
    """Loads the newest iteration every pool of `template` ("{rank}": the
    pools of a run on any number of ranks) holds into this rank's shards of
    `named` [(name, parameter)], their optimizer state (created as DTensors
    like the parameter) and the model's buffers, reading of each old pool
    only the rows that overlap this rank's shards (CheckpointReader.read_range,
    every part read checked). Plain tensors come whole from rank 0's pool.
    Returns {"iteration", "extra" (rank 0's user extra state), "optimizer":
    True}; the param groups' hyperparameters and non-tensor state are set.

    NotFoundError if no pool matches; ModelMismatchError naming the pool and
    the parameter for pools of another model; FailedPreconditionError if the
    pools hold no iteration in common. A pool file opens in one process at
    once: call it one rank at a time."""
    paths = _rank_pools(template)
    readers = [_pmsnap.CheckpointReader(path) for path in paths]
    try:
        iteration, epochs = _common_iteration(readers, paths)
        blobs = [_extra.unpack(r.extra_state(e)) for r, e in zip(readers, epochs)]
        manifests = [_manifest(r) for r in readers]
        for name, p in named:
            _load_parameter(name, p, optimizer, readers, epochs, blobs, manifests, paths)
        _load_buffers(model, readers[0], epochs[0], manifests[0], paths[0])
        _extra.apply_to_optimizer(blobs[0], optimizer, named, paths[0], restore_rng=False)
        return {"iteration": iteration, "extra": dict(blobs[0]["user"]), "optimizer": True}
    finally:
        for r in readers:
            r.close()


def _rank_pools(template):
    template = os.fspath(template)
    paths = []
    while os.path.exists(template.replace("{rank}", str(len(paths)))):
        paths.append(template.replace("{rank}", str(len(paths))))
    if not paths:
        raise make_error(_pmsnap.NotFoundError,
                         f"no pool matches {template} (looked for "
                         f"{template.replace('{rank}', '0')})")
    return paths


def _common_iteration(readers, paths):
    """The newest iteration every pool holds, and each pool's epoch of it."""
    held = [{e["iteration"]: e["epoch"] for e in r.epochs()} for r in readers]
    common = set(held[0]).intersection(*held[1:])
    if not common:
        raise make_error(_pmsnap.FailedPreconditionError,
                         f"the {len(paths)} pools {paths[0]} .. {paths[-1]} hold no iteration in "
                         f"common (they hold {[sorted(h) for h in held]})")
    iteration = max(common)
    return iteration, [h[iteration] for h in held]


def _manifest(reader):
    """{unit name: (unit index, {role: (tensor index, dtype, shape)})}."""
    return {name: (u, {role: (t, dtype, list(shape))
                       for t, (role, dtype, shape, *_) in enumerate(tensors)})
            for u, (name, _, tensors) in enumerate(reader.describe()["units"])}


def _load_parameter(name, p, optimizer, readers, epochs, blobs, manifests, paths):
    if name not in manifests[0]:
        raise make_error(_pmsnap.ModelMismatchError,
                         f"pool {paths[0]} has no unit for parameter '{name}'")
    roles = manifests[0][name][1]
    param_like = roles[PARAM_ROLE][2]  # a role shaped like the parameter is sharded like it
    state = optimizer.state[p]
    for role, (_, dtype, shape) in roles.items():
        if role == PARAM_ROLE:
            target = p
        else:
            if role not in state:
                state[role] = new_state_tensor(p, shape, torch_dtype(dtype), local_tensor(p).device,
                                               like_param=shape == param_like)
            target = state[role]
        local = local_tensor(target)
        layout = sharded_layout(name, target) if is_dtensor(target) else None
        with torch.no_grad():
            if layout is None:
                _read_whole(readers[0], epochs[0], manifests[0], name, role, local, paths[0])
            else:
                _read_overlaps(name, role, local, layout, readers, epochs, blobs, manifests, paths)


def _read_whole(reader, epoch, manifest, unit, role, out, path):
    u, roles = manifest[unit]
    t, dtype, shape = roles[role]
    if shape != list(out.shape) or dtype != dtype_name(out.dtype):
        raise make_error(_pmsnap.ModelMismatchError,
                         f"pool {path}: {unit}.{role} is {dtype} {shape_text(shape)}, this run's "
                         f"is {dtype_name(out.dtype)} {shape_text(out.shape)}")
    reader.read_tensor(epoch, u, t, out.data_ptr())


def _read_overlaps(name, role, out, layout, readers, epochs, blobs, manifests, paths):
    """Fills `out` (this rank's shard at layout["offsets"]) from every old
    shard it overlaps: rows of the old shard read with read_range."""
    new_lo, new_shape = layout["offsets"], list(out.shape)
    covered, read = 0, set()
    for reader, epoch, blob, manifest, path in zip(readers, epochs, blobs, manifests, paths):
        old = (blob.get("shards") or {}).get(name)
        if old is None or old["global_shape"] != layout["global_shape"]:
            raise make_error(_pmsnap.ModelMismatchError,
                             f"pool {path}: parameter '{name}' is not a shard of "
                             f"{shape_text(layout['global_shape'])} there ({_describe(old)})")
        u, roles = manifest[name]
        t, dtype, old_shape = roles[role]
        lo = [max(a, b) for a, b in zip(new_lo, old["offsets"])]
        hi = [min(a + n, b + m) for a, n, b, m in zip(new_lo, new_shape, old["offsets"], old_shape)]
        region = (tuple(old["offsets"]), tuple(old_shape))
        if any(h <= l for l, h in zip(lo, hi)) or region in read:
            continue  # no overlap, or a replica of a region already read (Replicate())
        read.add(region)
        # The old shard's rows lo[0]..hi[0] are one contiguous byte range.
        row_elems = math.prod(old_shape[1:])
        first_row = lo[0] - old["offsets"][0]
        rows = torch.empty([hi[0] - lo[0]] + old_shape[1:], dtype=out.dtype, device="cpu")
        reader.read_range(epoch, u, t, first_row * row_elems * out.element_size(),
                          rows.numel() * out.element_size(), rows.data_ptr())
        source = rows[(slice(None),) + tuple(slice(l - o, h - o) for l, h, o in
                                            zip(lo[1:], hi[1:], old["offsets"][1:]))]
        out[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, new_lo))].copy_(source)
        covered += source.numel()
    if covered != out.numel():
        raise make_error(_pmsnap.ModelMismatchError,
                         f"the pools {paths[0]} .. {paths[-1]} cover {covered} of the "
                         f"{out.numel()} elements of this rank's shard of {name}.{role}")


def _load_buffers(model, reader, epoch, manifest, path):
    if model is None or _pmsnap.BUFFERS_UNIT not in manifest:
        return
    buffers = dict(model.named_buffers())
    _, roles = manifest[_pmsnap.BUFFERS_UNIT]
    with torch.no_grad():
        for key in roles:
            if key in buffers:
                _read_whole(reader, epoch, manifest, _pmsnap.BUFFERS_UNIT, key, buffers[key], path)
