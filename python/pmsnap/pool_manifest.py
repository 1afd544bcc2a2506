"""The model against an existing pool's manifest (_pmsnap.read_pool's "units").

Before the engine opens an existing pool, CheckpointedOptimizer compares the
model with what the pool records, so that a mismatch names the parameter
(check_pool_names) or the embedding table (check_pool_tables). restore()
then creates the optimizer state torch has not made yet from the manifest
(create_state_from_manifest): torch creates state lazily, on a parameter's
first update, but the engine restores into registered tensors. A parameter's
state may be split between its unit and companion units (an embedding
table's "#dense", the CPU state of a CUDA parameter in "#host":
_pmsnap.companion_units); they are read here as one parameter's.

Thread-safety: the training thread that owns the CheckpointedOptimizer.
"""

import torch

from . import _pmsnap
from .errors import make_error
from .units import (PARAM_ROLE, dtype_name, is_dtensor, local_tensor, new_state_tensor, shape_text,
                    state_tensors, torch_dtype)


def check_pool_tables(info, tables, pool):
    """ModelMismatchError if the pool's embedding tables differ from `tables`."""
    encoded = set(info.get("encoded_units", []))
    for name in sorted(encoded - set(tables)):
        raise make_error(_pmsnap.ModelMismatchError,
                         f"pool {pool} checkpoints '{name}' as an embedding table but this "
                         "optimizer does not (pass embeddings= / embedding_policy= as when it "
                         "was made)")
    for name in sorted(set(tables) - encoded):
        raise make_error(_pmsnap.ModelMismatchError,
                         f"pool {pool} checkpoints '{name}' as a dense parameter, not as an "
                         "embedding table; use a new pool to switch it to embedding checkpoints")


def check_pool_names(info, named, pool, sharded=False):
    """ModelMismatchError naming the first parameter the pool was not made for.

    A sharded pool (sharding="replicated") holds only the parameters its rank
    writes: each must still be one of ours, of the same dtype and shape."""
    units = {name: tensors for name, tensors in info["units"]
             if not _pmsnap.is_buffers_unit(name)}  # see check_pool_buffers
    ours = {name for name, _ in named}
    units = {name: tensors for name, tensors in units.items()
             if _pmsnap.parameter_of_companion(name) not in ours}
    for name, p in named:
        tensors = units.get(name)
        if tensors is None and sharded:
            continue
        if tensors is None:
            raise make_error(_pmsnap.ModelMismatchError,
                             f"pool {pool} has no unit for parameter '{name}' (it holds "
                             f"{len(units)} units, e.g. {', '.join(list(units)[:3])}): it was "
                             "made for another model")
        role, dtype, shape = tensors[0]
        local = local_tensor(p)  # what the pool holds of a sharded parameter
        if role != PARAM_ROLE or dtype != dtype_name(p.dtype) or list(shape) != list(local.shape):
            raise make_error(_pmsnap.ModelMismatchError,
                             f"pool {pool}: parameter '{name}' is {dtype_name(p.dtype)} "
                             f"{shape_text(local.shape)} but the pool holds {dtype} "
                             f"{shape_text(shape)}")
    if len(units) != len(named) and not (sharded and units.keys() <= ours):
        extra = [name for name in units if name not in ours]
        raise make_error(_pmsnap.ModelMismatchError,
                         f"pool {pool} holds units the optimizer does not have, e.g. "
                         f"'{extra[0]}'")


def with_companions(units):
    """{parameter: its unit's tensors followed by its companions'} from a
    manifest's {unit name: tensors}; companions do not appear on their own."""
    return {name: list(tensors) + [t for companion in _pmsnap.companion_units(name)
                                   for t in units.get(companion, [])]
            for name, tensors in units.items() if _pmsnap.parameter_of_companion(name) is None}


def check_pool_buffers(info, buffers, pool, sharded=False):
    """ModelMismatchError naming the first module buffer (units.ModuleBuffers,
    or None for none) that differs from the pool's "#buffers" units, or a
    pool that holds buffers this model lacks or lacks this model's (a pool
    written before pmsnap saved buffers: buffers=False opens it). A sharded
    pool may hold no buffers (another rank writes them)."""
    pooled = {role: (dtype, list(shape)) for name, tensors in info["units"]
              if _pmsnap.is_buffers_unit(name) for role, dtype, shape in tensors}
    ours = {} if buffers is None else buffers.specs()
    if not pooled and ours:
        if sharded:
            return
        raise make_error(_pmsnap.ModelMismatchError,
                         f"pool {pool} holds no module buffers but the model has "
                         f"{len(ours)} (e.g. '{next(iter(ours))}'): it was written without them "
                         "(buffers=False, or a pmsnap that did not save buffers); pass "
                         "buffers=False to use it as it is, or use a new pool")
    for name, (dtype, shape) in ours.items():
        if name not in pooled:
            raise make_error(_pmsnap.ModelMismatchError,
                             f"pool {pool} has no module buffer '{name}' (it holds "
                             f"{sorted(pooled)[:3]}...): it was made for another model")
        if pooled[name] != (dtype, shape):
            raise make_error(_pmsnap.ModelMismatchError,
                             f"pool {pool}: module buffer '{name}' is {dtype} "
                             f"{shape_text(shape)} but the pool holds {pooled[name][0]} "
                             f"{shape_text(pooled[name][1])}")
    extra = sorted(set(pooled) - set(ours))
    if extra:
        raise make_error(_pmsnap.ModelMismatchError,
                         f"pool {pool} holds module buffer '{extra[0]}' that the model does not "
                         "have" + ("" if buffers is not None else
                                   " (open it with model= and buffers=True)"))


def merge_rank_units(per_rank_units):
    """One manifest's units from every rank's sharded pool (the first rank
    holding a unit describes it; all holders describe it alike)."""
    merged = {}
    for units in per_rank_units:
        for name, tensors in units:
            merged.setdefault(name, tensors)
    return list(merged.items())


def check_every_parameter_held(info, named, pool):
    """Sharded restore: NotFoundError when no rank's pool exists, else
    CorruptionError naming a parameter that no rank's pool holds (more pools
    lost than replicas cover)."""
    if not info["units"]:
        raise make_error(_pmsnap.NotFoundError,
                         f"no rank's pool exists (this rank's: {pool})")
    held = {name for name, _ in info["units"]}
    for name, _ in named:
        if name not in held:
            raise make_error(_pmsnap.CorruptionError,
                             f"parameter '{name}' is in no rank's pool (this rank's: {pool}); "
                             "more pools were lost than replicas= covers")


def create_state_from_manifest(info, optimizer, named):
    """Creates optimizer state tensors the pool records but torch has not made yet.

    Checks every parameter first, so a mismatch leaves the optimizer untouched.
    """
    manifest = {name: tensors for name, tensors in info["units"]}
    units = with_companions(manifest)
    # State a "#host" companion holds was on the CPU beside a CUDA parameter
    # (Adam's `step`): made there again, where torch keeps it.
    on_host = {(_pmsnap.parameter_of_companion(name), role)
               for name, tensors in manifest.items() if name.endswith("#host")
               for role, _, _ in tensors}
    for name, p in named:
        roles = {role: (dtype, list(shape)) for role, dtype, shape in units[name][1:]}
        for key, value in state_tensors(optimizer, p):
            if key not in roles:
                raise make_error(_pmsnap.ModelMismatchError,
                                 f"parameter '{name}': the optimizer holds state '{key}' that "
                                 f"the pool does not (pool roles: {sorted(roles)}); was the "
                                 "pool written by another optimizer?")
            local = local_tensor(value)  # what the pool holds of sharded state
            if (dtype_name(value.dtype), list(local.shape)) != roles[key]:
                dtype, shape = roles[key]
                raise make_error(_pmsnap.ModelMismatchError,
                                 f"parameter '{name}': optimizer state '{key}' is "
                                 f"{dtype_name(value.dtype)} {shape_text(local.shape)}, the "
                                 f"pool holds {dtype} {shape_text(shape)}")
    for name, p in named:
        for role, dtype, shape in units[name][1:]:
            state = optimizer.state[p]
            current = state.get(role)
            local = local_tensor(current) if isinstance(current, torch.Tensor) else None
            if (local is not None and dtype_name(current.dtype) == dtype
                    and list(local.shape) == list(shape) and local.is_contiguous()):
                continue
            if current is not None and not isinstance(current, torch.Tensor):
                raise make_error(_pmsnap.ModelMismatchError,
                                 f"parameter '{name}': optimizer state '{role}' is a "
                                 f"{type(current).__name__} here but a tensor in the pool")
            device = "cpu" if (name, role) in on_host else p.device
            # State shaped like a sharded parameter is sharded like it.
            state[role] = new_state_tensor(
                p, shape, torch_dtype(dtype), device,
                like_param=is_dtensor(p) and list(shape) == list(local_tensor(p).shape))
