"""Everything a training loop resumes from, checkpointed in one call.

A torchtitan-style loop keeps more than the model and the optimizer: a
learning-rate scheduler, the data loader's position, the RNG states, a step
counter. TrainingState holds them together and checkpoints them with every
step into one pool (through CheckpointedOptimizer, weight by weight); resume()
brings all of them back, bit-exact:

    state = pmsnap.TrainingState("/dev/shm/run.pool", model, optimizer,
                                 lr_scheduler=scheduler, stateful={"data": loader})
    with state:
        for step in range(state.resume(), total_steps + 1):
            batch = next(loader)
            loss = model(batch).mean()
            state.zero_grad()
            loss.backward()
            state.step()            # optimizer step + checkpoint, then scheduler step

What each step's checkpoint holds:
  * parameters, optimizer state, module buffers (CheckpointedOptimizer);
  * the RNG states (torch CPU and CUDA, Python, numpy) as they are at step();
  * every object in `stateful` through its state_dict() at step() (after the
    step's batch was drawn), restored with load_state_dict(): a
    torchdata StatefulDataLoader, a sampler, any object with the two methods;
  * the LR scheduler's state_dict() as it is before its step() of this
    step, the metric given to step() for ReduceLROnPlateau, and the
    optimizer's hyperparameters. resume() loads them and then repeats that
    scheduler step, the same computation on the same inputs as the
    interrupted run, so the learning rates continue bit-exact.

Thread-safety: one training thread, like CheckpointedOptimizer.
"""

import os
import warnings

import torch

from . import _pmsnap
from .checkpoints import has_checkpoint
from .errors import make_error
from .optimizer import CheckpointedOptimizer

_STATE_KEY = "pmsnap.training_state"  # the entry of CheckpointedOptimizer.extra_state


class TrainingState:
    """Model, optimizer, LR scheduler, stateful objects and RNG, checkpointed
    with every step() into `pool` and restored by resume().

    `model` and `optimizer` are the plain torch objects; `lr_scheduler` a
    torch.optim.lr_scheduler scheduler of `optimizer` or None; `stateful` a
    dict {name: object with state_dict() and load_state_dict()}.
    `extra_state` (a picklable dict) travels with each checkpoint too and
    is the dict resume() returns it in (self.extra_state). Any other keyword
    goes to CheckpointedOptimizer (every, device, strategy, process_group,
    sharding, ...); `self.optimizer` is that CheckpointedOptimizer.

    InvalidArgumentError for a scheduler of another optimizer or a stateful
    object without state_dict/load_state_dict."""

    def __init__(self, pool, model, optimizer, lr_scheduler=None, stateful=None,
                 **checkpoint_kwargs):
        self.pool = os.fspath(pool)
        if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", None) is not optimizer:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"lr_scheduler {type(lr_scheduler).__name__} does not schedule the "
                             "optimizer given to TrainingState")
        self.stateful = dict(stateful or {})
        for name, obj in self.stateful.items():
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise make_error(_pmsnap.InvalidArgumentError,
                                 f"stateful['{name}'] ({type(obj).__name__}) has no "
                                 "state_dict() and load_state_dict()")
        self.model = model
        self.lr_scheduler = lr_scheduler
        self.optimizer = CheckpointedOptimizer(optimizer, self.pool, model=model,
                                               **checkpoint_kwargs)
        self.extra_state = {}
        self._process_group = checkpoint_kwargs.get("process_group")

    def resume(self):
        """Restores everything from the pool's newest checkpoint, if there is
        one, and returns the number of the next step (1 for a fresh pool).
        With a process_group, every rank restores if any rank's pool holds a
        checkpoint (a rank whose pool was lost takes it from its replicas).
        Before the first step(). Errors as CheckpointedOptimizer.restore."""
        if not self._any_rank_has_checkpoint():
            return 1
        iteration, extra = self.optimizer.restore()
        saved = extra.get(_STATE_KEY)
        if saved is None:
            raise make_error(_pmsnap.FailedPreconditionError,
                             f"pool {self.pool} was not written by a TrainingState (its "
                             "checkpoints hold no scheduler or stateful entries): restore it "
                             "with CheckpointedOptimizer.restore()")
        missing = sorted(set(self.stateful) - set(saved["stateful"]))
        if missing:
            raise make_error(_pmsnap.ModelMismatchError,
                             f"pool {self.pool} holds no state for stateful {missing} "
                             f"(it has {sorted(saved['stateful'])})")
        for name, obj in self.stateful.items():
            obj.load_state_dict(saved["stateful"][name])
        if (self.lr_scheduler is None) != (saved["lr_scheduler"] is None):
            raise make_error(_pmsnap.ModelMismatchError,
                             f"pool {self.pool} was written "
                             f"{'with' if saved['lr_scheduler'] is not None else 'without'} an "
                             "LR scheduler; this TrainingState has "
                             f"{'one' if self.lr_scheduler is not None else 'none'}")
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(saved["lr_scheduler"])
            self._scheduler_step(saved["lr_metric"], replay=True)
        self.extra_state = dict(saved["user"])
        return int(iteration) + 1

    def step(self, metric=None, extra_state=None):
        """The optimizer step, checkpointed with the scheduler's and the
        stateful objects' states and the RNG, then the scheduler's step
        (with `metric` for ReduceLROnPlateau). `extra_state` replaces
        self.extra_state. Errors as CheckpointedOptimizer.step."""
        if extra_state is not None:
            self.extra_state = dict(extra_state)
        saved = {
            "stateful": {name: obj.state_dict() for name, obj in self.stateful.items()},
            "lr_scheduler": (self.lr_scheduler.state_dict() if self.lr_scheduler is not None
                             else None),
            "lr_metric": metric,
            "user": self.extra_state,
        }
        self.optimizer.step(extra_state={_STATE_KEY: saved})
        if self.lr_scheduler is not None:
            self._scheduler_step(metric)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def iteration(self):
        """The last step taken (or restored)."""
        return self.optimizer.iteration

    def stats(self):
        return self.optimizer.stats()

    def close(self, abandon=False):
        """Commits the checkpoint in flight (unless abandon) and closes the pool."""
        self.optimizer.close(abandon=abandon)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(abandon=exc_type is not None)
        return False

    def _scheduler_step(self, metric, replay=False):
        with warnings.catch_warnings():
            if replay:
                # The optimizer step before it was the interrupted run's.
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*optimizer.step")
            if metric is None:
                self.lr_scheduler.step()
            else:
                self.lr_scheduler.step(metric)

    def _any_rank_has_checkpoint(self):
        mine = has_checkpoint(self.pool)
        group = self._process_group
        if group is None:
            return mine
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
        return bool(flag.item())
