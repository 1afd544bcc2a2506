"""PyTorch Lightning: every training step checkpointed into a pool, by one callback.

    import lightning as L
    from pmsnap.lightning import PmsnapCheckpoint

    trainer = L.Trainer(max_steps=1000, callbacks=[PmsnapCheckpoint("/dev/shm/run.pool")])
    trainer.fit(model, train_loader)
    # after a crash, the same script with:
    trainer.fit(model, train_loader, ckpt_path="/dev/shm/run.pool")

The callback wraps the LightningModule's optimizer in a CheckpointedOptimizer
(weight-grained capture, as in a hand-written loop). Each step's checkpoint
holds the parameters, buffers, optimizer state and RNG states, and what
Lightning resumes from, taken at the end of the batch (where ModelCheckpoint
saves): the loops' progress (and a stateful data loader's position), the LR
schedulers after their step, the callbacks' states, the precision plugin's
state. `ckpt_path=pool` is read through a CheckpointIO the callback installs
in setup(), so the Trainer restores it as it would a .ckpt file; the tensors
come from the pool, bit-exact.

Bit-exact resume mid-epoch needs what it needs without pmsnap too: a data
loader with state_dict()/load_state_dict() (torchdata's StatefulDataLoader,
or any sized iterable with the two methods; Lightning restores its position)
and, for step-based schedules, max_steps.

Limits: one optimizer, automatic optimization (what the tests cover); one
process (the keyword arguments reach CheckpointedOptimizer, whose
process_group= serves DDP, but this module is tested with one process). The
LightningModule's on_save_checkpoint additions and hyperparameters are not
part of a pool checkpoint (ModelCheckpoint beside it still writes them).

Thread-safety: Lightning's training thread.
"""

import os

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.trainer import call as _call
except ImportError:  # the standalone package
    import pytorch_lightning as pl
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
    from pytorch_lightning.trainer import call as _call

from . import _pmsnap
from .checkpoints import has_checkpoint
from .errors import make_error
from .export import _is_pool_file
from .optimizer import CheckpointedOptimizer
from .options import check_not_given
from .state_dict import load_state_dict

_STATE_KEY = "pmsnap.lightning"  # the entry of the pool's extra state


class PmsnapCheckpoint(pl.Callback):
    """Checkpoints every training step into `pool` (see the module doc).

    `pool`: the pool file (created on the first step). Other keywords go to
    CheckpointedOptimizer (every=, device=, tuning=, ...), except model= and
    finish_step_later=, which this callback sets. During fit,
    `self.optimizer` is the CheckpointedOptimizer.

    trainer.fit(..., ckpt_path=pool) resumes from the pool's newest
    checkpoint. fit() without ckpt_path on a pool that holds checkpoints
    raises FailedPreconditionError naming the pool (resume it or delete it),
    so no run overwrites another's checkpoints. InvalidArgumentError for a
    LightningModule with more than one optimizer."""

    def __init__(self, pool, **checkpoint_kwargs):
        check_not_given(checkpoint_kwargs, "PmsnapCheckpoint")
        self.pool = os.fspath(pool)
        self.optimizer = None
        self._checkpoint_kwargs = checkpoint_kwargs
        self._resuming = False

    # --- Lightning hooks ----------------------------------------------------------

    def setup(self, trainer, pl_module, stage):
        # Before the Trainer reads ckpt_path (Trainer._run): a pool path reaches us.
        self._resuming = False
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, _PoolCheckpointIO):
            trainer.strategy.checkpoint_io = _PoolCheckpointIO(io, self)

    def on_fit_start(self, trainer, pl_module):
        optimizers = trainer.strategy.optimizers
        if len(optimizers) != 1:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"PmsnapCheckpoint({self.pool}): the LightningModule has "
                             f"{len(optimizers)} optimizers; pmsnap checkpoints exactly one")
        if not self._resuming and has_checkpoint(self.pool):
            raise make_error(_pmsnap.FailedPreconditionError,
                             f"pool {self.pool} already holds a checkpoint: resume it with "
                             f"trainer.fit(..., ckpt_path='{self.pool}'), or delete it to "
                             "start over")
        self.optimizer = CheckpointedOptimizer(optimizers[0], self.pool, model=pl_module,
                                               finish_step_later=True,
                                               **self._checkpoint_kwargs)
        # The Trainer loads "optimizer_states" (none: see _PoolCheckpointIO)
        # after this hook; the pool's own restore brings parameters, buffers,
        # optimizer state, learning rates and RNG, and continues its numbering.
        if self._resuming:
            self.optimizer.restore()
        trainer.strategy.optimizers = [self.optimizer]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.optimizer is not None and self.optimizer.step_open:
            self.optimizer.finish_step(extra_state={_STATE_KEY: _training_state(trainer, self)})

    def on_fit_end(self, trainer, pl_module):
        self._close(abandon=False)

    def on_exception(self, trainer, pl_module, exception):
        self._close(abandon=True)

    def _close(self, abandon):
        optimizer, self.optimizer = self.optimizer, None
        self._resuming = False
        if optimizer is not None:
            optimizer.close(abandon=abandon)

    def load_checkpoint_dict(self, path):
        """The Lightning checkpoint dict of pool `path`'s newest checkpoint:
        its model tensors and the training state taken with them. Marks this
        fit as resuming. InvalidArgumentError for a pool other than this
        callback's (its optimizer state would be lost)."""
        if os.path.realpath(path) != os.path.realpath(self.pool):
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"ckpt_path {path} is a pmsnap pool, but this PmsnapCheckpoint "
                             f"writes {self.pool}: resume from that pool, or start a new pool "
                             f"from {path} with PmsnapCheckpoint(new_pool, init_from='{path}')")
        loaded = load_state_dict(path, model_only=True)
        saved = loaded["extra"].get(_STATE_KEY)
        if saved is None:
            raise make_error(_pmsnap.FailedPreconditionError,
                             f"pool {path} was not written by pmsnap.lightning.PmsnapCheckpoint "
                             "(its checkpoints hold no Lightning loop state): load it with "
                             "pmsnap.load_state_dict()")
        self._resuming = True
        checkpoint = dict(saved)
        checkpoint["state_dict"] = loaded["model"]
        checkpoint["pytorch-lightning_version"] = pl.__version__
        # The optimizer's state is restored from the pool by on_fit_start;
        # an empty list makes the Trainer's own optimizer load a no-op.
        checkpoint["optimizer_states"] = []
        return checkpoint


def _training_state(trainer, callback):
    """What Lightning resumes from, as ModelCheckpoint would save it now,
    less the model and optimizer tensors (the pool holds those)."""
    connector = trainer._checkpoint_connector
    state = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "loops": connector._get_loops_state_dict(),
        "callbacks": {key: value for key, value in _call._call_callbacks_state_dict(trainer).items()
                      if key != callback.state_key},
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }
    precision = trainer.precision_plugin
    precision_state = precision.state_dict()
    if precision_state:
        state[precision.__class__.__qualname__] = precision_state
    datamodule = trainer.datamodule
    if datamodule is not None:
        datamodule_state = datamodule.state_dict()
        if datamodule_state:
            state[datamodule.__class__.__qualname__] = datamodule_state
    return state


class _PoolCheckpointIO(CheckpointIO):
    """The Trainer's CheckpointIO, with pools read through the callback."""

    def __init__(self, inner, callback):
        super().__init__()
        self.inner = inner
        self._callback = callback

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        if _is_pool_file(os.fspath(path)):
            return self._callback.load_checkpoint_dict(os.fspath(path))
        return self.inner.load_checkpoint(path, map_location=map_location,
                                          weights_only=weights_only)

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path):
        self.inner.remove_checkpoint(path)

    def teardown(self):
        self.inner.teardown()

