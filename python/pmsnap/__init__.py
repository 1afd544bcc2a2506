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
flight. Errors raise pmsnap.Error subclasses carrying the runtime's message.

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
    cuda_support_compiled,
    read_pool,
)
from .embedding import EmbeddingTracker  # noqa: F401
from .optimizer import CheckpointedOptimizer, has_checkpoint, restore  # noqa: F401

__all__ = [
    "CheckpointedOptimizer", "EmbeddingTracker", "restore", "has_checkpoint", "read_pool",
    "cuda_support_compiled", "Error", "AbortedError", "BusyError", "CapacityExceededError",
    "CorruptionError", "FailedPreconditionError", "InternalError", "InvalidArgumentError",
    "ModelMismatchError", "NoSpaceError", "NotAPoolError", "NotFoundError", "StorageIOError",
    "UnsupportedVersionError",
]
