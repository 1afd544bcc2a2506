"""Reading checkpoints back: restore(), has_checkpoint(), list_checkpoints(),
recover_table().

restore() and has_checkpoint() work on a model and optimizer, as
CheckpointedOptimizer.restore() does; list_checkpoints() and recover_table()
read an embedding table's retained checkpoints from a pool file or from an
open CheckpointedOptimizer (whose engine holds the pool).

Thread-safety: the training thread; a pool path must not be open elsewhere.
"""

import os

import torch

from . import _pmsnap
from .errors import make_error
from .optimizer import CheckpointedOptimizer
from .units import PARAM_ROLE


def restore(pool, model, optimizer, *, restore_rng=True, device="host", verify_on_open=True,
            **embedding_kwargs):
    """Restores `model`'s parameters and `optimizer`'s state from `pool`.

    Returns (iteration, extra_state): the last committed iteration and the
    dict given to CheckpointedOptimizer.step() at that iteration, with an "rng"
    entry holding the RNG states (applied unless restore_rng=False). Continue
    with CheckpointedOptimizer(optimizer, pool, model=model,
    start_iteration=iteration). Raises NotFoundError (no pool or no
    checkpoint), ModelMismatchError (naming the parameter), CorruptionError.
    A pool with embedding tables needs the same embeddings= /
    embedding_policy= keyword arguments as the CheckpointedOptimizer that
    wrote it (embedding_kwargs are passed on).
    """
    wrapper = CheckpointedOptimizer(optimizer, pool, model=model, device=device,
                                    verify_on_open=verify_on_open, **embedding_kwargs)
    try:
        return wrapper.restore(restore_rng=restore_rng)
    finally:
        wrapper.close()


def has_checkpoint(pool):
    """True if `pool` exists and holds a committed checkpoint.

    Raises (e.g. NotAPoolError, CorruptionError) for a file that exists but
    cannot be read, so a damaged pool is never silently replaced.
    """
    return latest_checkpoint(pool) is not None


def latest_checkpoint(pool):
    """read_pool(pool)["latest"] (the newest committed checkpoint's record),
    or None when `pool` does not exist or holds none; raises as
    has_checkpoint does for a file that cannot be read."""
    if not os.path.exists(pool):
        return None
    return _pmsnap.read_pool(os.fspath(pool))["latest"]


def _table_source(pool, table):
    """(open CheckpointedOptimizer or None, path) to read table checkpoints from."""
    if isinstance(pool, CheckpointedOptimizer):
        if pool.is_open:
            return pool, pool.pool
        pool = pool.pool
    path = os.fspath(pool)
    if not os.path.exists(path):
        raise make_error(_pmsnap.NotFoundError, f"pool {path} does not exist")
    return None, path


def list_checkpoints(pool, table):
    """Retained checkpoints of embedding table `table`, oldest first.

    `pool` is a pool path (not open elsewhere) or an open CheckpointedOptimizer.
    Returns [{"epoch", "iteration", "chunks", "chunk_bytes"}]. NotFoundError
    naming the table if the pool has no such table or no checkpoint of it.
    """
    live, path = _table_source(pool, table)
    if live is not None:
        return live.list_table_checkpoints(table)
    return _pmsnap.list_checkpoints(path, table)


def recover_table(pool, table, epoch=None, *, state=False, with_info=False):
    """Embedding table `table` as of retained checkpoint `epoch` (default: newest).

    Returns a float32 torch tensor shaped like the parameter (dequantized if
    the checkpoints are quantized), or with state=True a dict {role: tensor}
    holding the parameter ("param") and its row-shaped optimizer state
    ("sum", "momentum_buffer", ...). with_info=True returns (result, info)
    with info = {"epoch", "iteration", "rows"}. `pool` is a pool path or an
    open CheckpointedOptimizer. NotFoundError naming the table for an unknown
    table or an epoch that is not retained; CorruptionError naming table and
    checkpoint for a damaged chunk.
    """
    live, path = _table_source(pool, table)
    if live is not None:
        info, roles, arrays = live.recover_table_arrays(table, epoch)
    else:
        info, arrays = _pmsnap.recover_table(path, table, epoch)
        units = dict(_pmsnap.read_pool(path)["units"])
        roles = [(role, tuple(shape)) for role, _, shape in units[table]]
    if roles is None or len(roles) != len(arrays):
        raise make_error(_pmsnap.InternalError,
                         f"table '{table}': {len(arrays)} recovered tensors, expected "
                         f"{len(roles or [])}")
    tensors = {role: torch.from_numpy(array).reshape(shape)
               for (role, shape), array in zip(roles, arrays)}
    result = tensors if state else tensors[PARAM_ROLE]
    return (result, dict(info)) if with_info else result
