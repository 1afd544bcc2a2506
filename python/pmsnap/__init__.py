"""pmsnap: checkpoint PyTorch training into persistent memory every iteration.

    import pmsnap
    with pmsnap.CheckpointedOptimizer(torch.optim.Adam(model.parameters()),
                                      pool="/dev/shm/run.pool", model=model) as opt:
        start = opt.restore()[0] if pmsnap.has_checkpoint(opt.pool) else 0
        for step in range(start, steps):
            loss = model(x).sum(); opt.zero_grad(); loss.backward()
            opt.step(extra_state={"batch": step})
        print(opt.stats()["summary"])

Each parameter's update is checkpointed weight by weight while training runs
(the C++ runtime behind `_pmsnap`); a crash loses at most the iteration in
flight. Embedding tables can use differential / incremental checkpoints:

    opt = pmsnap.CheckpointedOptimizer(torch.optim.Adagrad(model.parameters()),
                                       pool=path, model=model,
                                       embedding_policy="incrcp", retain=4)
    ...
    for c in pmsnap.list_checkpoints(path, "emb.weight"):
        table = pmsnap.recover_table(path, "emb.weight", c["epoch"])

A training loop's whole state (model, optimizer, LR scheduler, data-loader
position, RNG) resumes in one call with pmsnap.TrainingState:

    state = pmsnap.TrainingState(path, model, optimizer, lr_scheduler=scheduler,
                                 stateful={"data": loader})
    for step in range(state.resume(), steps + 1):
        ...; state.zero_grad(); loss.backward(); state.step()

Checkpoints leave the pool without the model: pmsnap.load_state_dict(path)
reads any retained epoch as a state dict, pmsnap.export(path, "w.safetensors")
writes safetensors, torch.save or DCP files (also `python -m pmsnap export`).

Errors raise pmsnap.Error subclasses carrying the runtime's message.

Thread-safety: see CheckpointedOptimizer; one training thread per optimizer.
"""

from ._pmsnap import (  # noqa: F401  (re-exported)
    AbortedError,
    BusyError,
    CapacityExceededError,
    CorruptionError,
    Error,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    ModelMismatchError,
    NoSpaceError,
    NotAPoolError,
    NotFoundError,
    StorageIOError,
    UnsupportedVersionError,
    EmbeddingOptions,
    Policy,
    cuda_support_compiled,
    read_pool,
)
from .checkpoints import (  # noqa: F401
    has_checkpoint,
    list_checkpoints,
    recover_table,
    restore,
)
from .embedding import EmbeddingTracker  # noqa: F401
from .export import export, read_export  # noqa: F401
from .lowdiff_plus import LowDiffPlus  # noqa: F401
from .optimizer import CheckpointedOptimizer  # noqa: F401
from .options import PoolSettings, Ranks, Tuning  # noqa: F401
from .state_dict import PoolCheckpoint, load_state_dict  # noqa: F401
from .training_state import TrainingState  # noqa: F401



def __getattr__(name):
    # pmsnap.dcp imports torch.distributed.checkpoint: only when used.
    if name == "dcp":
        import importlib
        return importlib.import_module(".dcp", __name__)
    raise AttributeError(f"module 'pmsnap' has no attribute '{name}'")


__all__ = [
    "CheckpointedOptimizer", "Tuning", "PoolSettings", "Ranks", "TrainingState", "LowDiffPlus", "EmbeddingTracker", "EmbeddingOptions", "Policy", "restore",
    "has_checkpoint", "read_pool", "list_checkpoints", "recover_table",
    "cuda_support_compiled", "load_state_dict", "PoolCheckpoint", "export", "read_export",
    "Error", "AbortedError", "BusyError", "CapacityExceededError",
    "CorruptionError", "FailedPreconditionError", "InternalError", "InvalidArgumentError",
    "ModelMismatchError", "NoSpaceError", "NotAPoolError", "NotFoundError", "StorageIOError",
    "UnsupportedVersionError",
]
