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
The ranks read at once: CheckpointReader maps a pool read-only, unlocked.

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


def layouts(named, sharding, tables=()):
    """{name: layout} of the DTensor parameters among `named` [(name, p)]
    and of the fused tables `tables` (fused_tables.FusedTable), or None when
    there are none. InvalidArgumentError for sharded parameters under
    sharding="replicated"."""
    out = {name: layout for name, p in named
           if (layout := sharded_layout(name, p)) is not None}
    out.update({t.name: t.layout for t in tables})
    if out and sharding == "replicated":
        name = next(iter(out))
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"parameter '{name}' is sharded (FSDP2 / distribute_tensor / a torchrec "
                         "plan): every rank already checkpoints only its own shards, so "
                         "sharding='replicated' (for ranks that hold the same tensors) does "
                         "not apply; leave sharding at its default")
    return out or None


def fingerprint(named, plan=""):
    """The whole model's identity for the ranks' agreement (the engine's
    model_fingerprint): every parameter's name, dtype and global shape, and
    `plan` (fused_tables.plan_fingerprint: the sharded tables). Each rank
    registers its own shards, whose shapes differ between ranks when a
    dimension does not divide evenly (or, under a torchrec plan, which tables
    they hold), so the default (this rank's manifest) would call the ranks'
    models different."""
    text = ";".join(f"{name}:{dtype_name(p.dtype)}:{list(p.shape)}" for name, p in named) + plan
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
    text = f"a shard at offsets {layout['offsets']} of {layout['global_shape']}"
    if "placements" in layout:
        text += f" placed {layout['placements']} on a mesh of {layout['mesh_shape']}"
    return text


def is_pool_template(path):
    """Whether init_from=`path` names the pools of a multi-rank run."""
    return "{rank}" in os.fspath(path)


def load_resharded(template, model, optimizer, named, tables=()):
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
    pools hold no iteration in common. The pools are mapped read-only
    (CheckpointReader takes no lock): every rank may read at once.

    `tables` (fused_tables.FusedTable, whose weights are among `named` and
    whose state `optimizer` shows: fused_tables.StateView) are loaded by
    their layouts too: a plan's table-wise or row-wise shards from another
    plan's, whichever pools hold them."""
    paths = rank_pools(template)
    readers = [_pmsnap.CheckpointReader(path) for path in paths]
    try:
        iteration, epochs = common_iteration(readers, paths)
        blobs = [_extra.unpack(r.extra_state(e)) for r, e in zip(readers, epochs)]
        manifests, encoded = zip(*[read_manifest(r) for r in readers])
        fused = {t.name: t.layout for t in tables}
        for name, p in named:
            _load_parameter(name, p, optimizer, readers, epochs, blobs, manifests, paths,
                            fused.get(name), encoded)
        _load_buffers(model, readers[0], epochs[0], manifests[0], paths[0])
        _extra.apply_to_optimizer(blobs[0], optimizer, named, paths[0], restore_rng=False)
        return {"iteration": iteration, "extra": dict(blobs[0]["user"]), "optimizer": True}
    finally:
        for r in readers:
            r.close()


def rank_pools(template):
    """The pool paths of `template` for ranks 0, 1, ... while they exist;
    NotFoundError if rank 0's does not."""
    template = os.fspath(template)
    paths = []
    while os.path.exists(template.replace("{rank}", str(len(paths)))):
        paths.append(template.replace("{rank}", str(len(paths))))
    if not paths:
        raise make_error(_pmsnap.NotFoundError,
                         f"no pool matches {template} (looked for "
                         f"{template.replace('{rank}', '0')})")
    return paths


def common_iteration(readers, paths):
    """The newest iteration every pool holds, and each pool's epoch of it."""
    held = [{e["iteration"]: e["epoch"] for e in r.epochs()} for r in readers]
    common = set(held[0]).intersection(*held[1:])
    if not common:
        raise make_error(_pmsnap.FailedPreconditionError,
                         f"the {len(paths)} pools {paths[0]} .. {paths[-1]} hold no iteration in "
                         f"common (they hold {[sorted(h) for h in held]})")
    iteration = max(common)
    return iteration, [h[iteration] for h in held]


def read_manifest(reader):
    """{unit name: (unit index, {role: (tensor index, dtype, shape)})}, and
    the names of the units encoded as embedding tables (their rows are
    recovered through the chunk heap, not read from the slot)."""
    units = reader.describe()["units"]
    return ({name: (u, {role: (t, dtype, list(shape))
                        for t, (role, dtype, shape, *_) in enumerate(tensors)})
             for u, (name, _, tensors) in enumerate(units)},
            {name for name, encoded, _ in units if encoded})


def _load_parameter(name, p, optimizer, readers, epochs, blobs, manifests, paths, fused,
                    encoded):
    """Parameter `name` and its state: a fused table's by its layout `fused`,
    a DTensor's by its own, a plain tensor whole from the first pool."""
    holder = next((m for m in manifests if name in m), None)
    if holder is None:
        raise make_error(_pmsnap.ModelMismatchError,
                         f"no pool of {paths[0]} .. {paths[-1]} has a unit for parameter '{name}'")
    roles = holder[name][1]
    param_like = roles[PARAM_ROLE][2]  # a role shaped like the parameter is sharded like it
    state = optimizer.state[p]
    for role, (_, dtype, shape) in roles.items():
        if fused is not None and role != PARAM_ROLE and role not in fused["roles"]:
            raise make_error(_pmsnap.ModelMismatchError,
                             f"pool {paths[0]} .. {paths[-1]}: fused table '{name}' has optimizer "
                             f"state '{role}' there, which this run's fused optimizer does not "
                             f"(it has {sorted(fused['roles'])})")
        if role == PARAM_ROLE:
            target = p
        else:
            if role not in state:
                state[role] = new_state_tensor(p, shape, torch_dtype(dtype), local_tensor(p).device,
                                               like_param=shape == param_like)
            target = state[role]
        local = local_tensor(target)
        if fused is not None:
            layout = fused if role == PARAM_ROLE else fused["roles"][role]
        else:
            layout = sharded_layout(name, target) if is_dtensor(target) else None
        with torch.no_grad():
            if layout is None:
                _read_whole(readers[0], epochs[0], manifests[0], name, role, local, paths[0])
            else:
                _read_overlaps(name, role, local, layout, readers, epochs, blobs, manifests, paths,
                               encoded)


def _read_whole(reader, epoch, manifest, unit, role, out, path):
    u, roles = manifest[unit]
    t, dtype, shape = roles[role]
    if shape != list(out.shape) or dtype != dtype_name(out.dtype):
        raise make_error(_pmsnap.ModelMismatchError,
                         f"pool {path}: {unit}.{role} is {dtype} {shape_text(shape)}, this run's "
                         f"is {dtype_name(out.dtype)} {shape_text(out.shape)}")
    reader.read_tensor(epoch, u, t, out.data_ptr())


def _read_overlaps(name, role, out, layout, readers, epochs, blobs, manifests, paths, encoded):
    """Fills `out` (this rank's shard at layout["offsets"]) from every old
    shard it overlaps: rows of the old shard read with read_range, or of an
    old shard checkpointed as an embedding table (`encoded`: per pool, the
    names of such units) taken from the table as recovered."""
    new_lo, new_shape = layout["offsets"], list(out.shape)
    covered, read = 0, set()
    for reader, epoch, blob, manifest, path, tables in zip(readers, epochs, blobs, manifests,
                                                           paths, encoded):
        if name not in manifest:
            continue  # a plan that placed no shard of it on that rank (table-wise)
        old = role_layout(blob, name, role)
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
        first_row = lo[0] - old["offsets"][0]
        rows = read_rows(reader, epoch, u, t, name if name in tables else None, old_shape,
                         first_row, hi[0] - lo[0], out.dtype)
        source = rows[(slice(None),) + tuple(slice(l - o, h - o) for l, h, o in
                                            zip(lo[1:], hi[1:], old["offsets"][1:]))]
        out[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, new_lo))].copy_(source)
        covered += source.numel()
    if covered != out.numel():
        raise make_error(_pmsnap.ModelMismatchError,
                         f"the pools {paths[0]} .. {paths[-1]} cover {covered} of the "
                         f"{out.numel()} elements of this rank's shard of {name}.{role}")


def role_layout(blob, name, role):
    """The recorded layout (extra state `blob`'s "shards") of tensor `role`
    of parameter `name`: a fused table's state tensor has its own, any other
    role is placed like its parameter. None for a plain parameter."""
    layout = (blob.get("shards") or {}).get(name)
    if layout is not None and role != PARAM_ROLE:
        layout = layout.get("roles", {}).get(role, layout)
    return layout


def read_rows(reader, epoch, unit, tensor, table, shape, first_row, count, dtype):
    """Rows first_row..first_row+count of tensor `tensor` (of `shape`) of
    unit `unit` in `epoch`: a contiguous byte range read with read_range
    (only the pool parts it lies in, each checked), or for a unit encoded as
    embedding table `table` (its chunks: differentials, maybe quantized)
    cut from the table recovered whole."""
    if table is not None:
        _, arrays = reader.recover_table(table, epoch)
        whole = torch.from_numpy(arrays[tensor]).reshape(shape)
        return whole[first_row:first_row + count].to(dtype)
    rows = torch.empty([count] + list(shape[1:]), dtype=dtype, device="cpu")
    size = rows.element_size()
    reader.read_range(epoch, unit, tensor, first_row * math.prod(shape[1:]) * size,
                      rows.numel() * size, rows.data_ptr())
    return rows


def _load_buffers(model, reader, epoch, manifest, path):
    if model is None or _pmsnap.BUFFERS_UNIT not in manifest:
        return
    buffers = dict(model.named_buffers())
    _, roles = manifest[_pmsnap.BUFFERS_UNIT]
    with torch.no_grad():
        for key in roles:
            if key in buffers:
                _read_whole(reader, epoch, manifest, _pmsnap.BUFFERS_UNIT, key, buffers[key], path)
