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

sharding="replicated" assumes every rank holds the same tensors and spreads
their writes; sharded parameters already are spread, so the two are not
combined (InvalidArgumentError).

Thread-safety: the training thread that owns the CheckpointedOptimizer.
"""

from . import _pmsnap
from .errors import make_error
from .units import sharded_layout


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
