"""Hugging Face Trainer: every optimizer step checkpointed into a pool, by one callback.

    from pmsnap.hf import PmsnapCallback, resume_dir

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[PmsnapCallback("/dev/shm/run.pool")])
    trainer.train()
    # after a crash, the same script with:
    trainer.train(resume_from_checkpoint=resume_dir("/dev/shm/run.pool"))

The callback wraps the Trainer's optimizer in a CheckpointedOptimizer
(weight-grained capture) when training begins, and ends each step's
checkpoint in on_step_end, after the LR scheduler stepped and the
TrainerState counted the step: the checkpoint holds the parameters, buffers,
optimizer state, learning rates and RNG states, the TrainerState and the LR
scheduler's state, as a Trainer checkpoint folder of that step would.

resume_dir(pool) turns the pool's newest checkpoint into the folder that
resume_from_checkpoint takes: trainer_state.json, rng_state.pth, the model's
weights (model.safetensors, exported from the pool) and a note naming the
pool. The Trainer then skips the data it trained on and restores the RNG
where it always does; the callback restores the optimizer and scheduler
state from the pool itself (bit-exact, no optimizer.pt is written).

Limits: one process (the keyword arguments reach CheckpointedOptimizer,
whose process_group= serves DDP, but this module is tested with one
process); no DeepSpeed, FSDP or mixed-precision grad scaler. The states of
ExportableState callbacks other than the TrainerControl (EarlyStopping...)
are those the Trainer last saved, not every step's.

Thread-safety: the Trainer's training thread.
"""

import dataclasses
import json
import os

import torch
from transformers import TrainerCallback

from . import _pmsnap
from .checkpoints import latest_checkpoint
from .errors import make_error
from .export import export
from .optimizer import CheckpointedOptimizer
from .options import check_not_given
from .state_dict import PoolCheckpoint

_STATE_KEY = "pmsnap.hf"  # the entry of the pool's extra state
_NOTE = "pmsnap_resume.json"  # resume_dir's note naming the pool and its step


class PmsnapCallback(TrainerCallback):
    """Checkpoints every optimizer step into `pool` (see the module doc).

    `pool`: the pool file (created at the first step). Other keywords go to
    CheckpointedOptimizer (every=, device=, tuning=, ...), except model= and
    finish_step_later=, which this callback sets. During train(),
    `self.optimizer` is the CheckpointedOptimizer.

    train() on a pool that holds checkpoints, without resuming from
    resume_dir(pool), raises FailedPreconditionError naming the pool, so no
    run overwrites another's checkpoints; so does resuming from a folder
    whose step is not the pool's newest checkpoint."""

    def __init__(self, pool, **checkpoint_kwargs):
        check_not_given(checkpoint_kwargs, "PmsnapCallback")
        self.pool = os.fspath(pool)
        self.optimizer = None
        self._checkpoint_kwargs = checkpoint_kwargs

    def on_train_begin(self, args, state, control, model=None, optimizer=None,
                       lr_scheduler=None, **kwargs):
        # `optimizer` is Accelerate's AcceleratedOptimizer around the torch one.
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, CheckpointedOptimizer):  # wrapped by an earlier train()
            inner = inner.optimizer
        if inner is None:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"PmsnapCallback({self.pool}): the Trainer's optimizer "
                             f"{type(optimizer).__name__} wraps no torch optimizer (DeepSpeed?)")
        latest = latest_checkpoint(self.pool)
        pool_step = latest["iteration"] if latest is not None else None
        if pool_step is not None and state.global_step != pool_step:
            raise make_error(_pmsnap.FailedPreconditionError,
                             f"pool {self.pool} holds step {pool_step} but the Trainer starts "
                             f"after step {state.global_step}: resume with "
                             f"trainer.train(resume_from_checkpoint=pmsnap.hf.resume_dir("
                             f"'{self.pool}')), or delete the pool to start over")
        self.optimizer = CheckpointedOptimizer(inner, self.pool, model=model,
                                               finish_step_later=True,
                                               **self._checkpoint_kwargs)
        if pool_step is not None:
            # The Trainer restores the RNG itself, after skipping the data.
            _, extra = self.optimizer.restore(restore_rng=False)
            saved = extra.get(_STATE_KEY)
            if saved is None:
                self.optimizer.close(abandon=True)
                self.optimizer = None
                raise _not_ours(self.pool)
            if lr_scheduler is not None:
                lr_scheduler.load_state_dict(saved["lr_scheduler"])
        optimizer.optimizer = self.optimizer

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        if self.optimizer is None or not self.optimizer.step_open:
            return
        trainer_state = dataclasses.asdict(state)
        trainer_state["stateful_callbacks"] = dict(trainer_state["stateful_callbacks"],
                                                   TrainerControl=control.state())
        saved = {"trainer_state": json.dumps(trainer_state, sort_keys=True),
                 "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None}
        self.optimizer.finish_step(extra_state={_STATE_KEY: saved})

    def on_train_end(self, args, state, control, **kwargs):
        optimizer, self.optimizer = self.optimizer, None
        if optimizer is not None:
            optimizer.close()


def resume_dir(pool, directory=None):
    """Writes the pool's newest checkpoint as the folder that
    Trainer.train(resume_from_checkpoint=...) takes, and returns its path.

    `directory`: where (default: "<pool>.resume" beside the pool); replaced
    if it holds an earlier resume_dir's files, refused if it holds others.
    Writes trainer_state.json, rng_state.pth, model.safetensors (the
    model's weights, checksum-verified, streamed from the pool) and a note
    naming the pool. NotFoundError for a pool with no checkpoint;
    FailedPreconditionError for one PmsnapCallback did not write."""
    pool = os.fspath(pool)
    directory = os.fspath(directory) if directory is not None else pool + ".resume"
    with PoolCheckpoint(pool) as checkpoint:
        epoch, iteration = checkpoint.epoch, checkpoint.iteration
        extra = checkpoint.extra()
    saved = extra.get(_STATE_KEY)
    if saved is None:
        raise _not_ours(pool)
    _prepare_folder(directory)
    with open(os.path.join(directory, "trainer_state.json"), "w", encoding="utf-8") as f:
        f.write(saved["trainer_state"])
    if extra["rng"]:  # none with capture_rng=False: the Trainer then says so
        torch.save(_trainer_rng(extra["rng"]), os.path.join(directory, "rng_state.pth"))
    export(pool, os.path.join(directory, "model.safetensors"), format="safetensors",
           epoch=epoch, model_only=True)
    with open(os.path.join(directory, _NOTE), "w", encoding="utf-8") as f:
        json.dump({"pool": os.path.abspath(pool), "epoch": epoch, "step": iteration}, f)
    return directory


def _trainer_rng(rng):
    """pmsnap's RNG states under the names of the Trainer's rng_state.pth."""
    states = {"python": rng["python"], "cpu": rng["torch"]}
    if "numpy" in rng:
        states["numpy"] = rng["numpy"]
    if "cuda" in rng and torch.cuda.is_available():
        # One process: the Trainer sets the current device's state.
        states["cuda"] = rng["cuda"][torch.cuda.current_device()]
    return states


def _prepare_folder(directory):
    ours = {"trainer_state.json", "rng_state.pth", "model.safetensors", _NOTE}
    if os.path.isdir(directory):
        present = set(os.listdir(directory))
        if (present and _NOTE not in present) or present - ours:
            raise make_error(_pmsnap.FailedPreconditionError,
                             f"resume_dir: {directory} holds files resume_dir did not write "
                             f"({', '.join(sorted(present - ours)[:3]) or 'no note'})")
        for name in present:
            os.remove(os.path.join(directory, name))
    else:
        os.makedirs(directory)


def _not_ours(pool):
    return make_error(_pmsnap.FailedPreconditionError,
                      f"pool {pool} was not written by pmsnap.hf.PmsnapCallback (its checkpoints "
                      "hold no Trainer state): load it with pmsnap.load_state_dict()")
