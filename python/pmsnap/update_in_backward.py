"""CheckpointedOptimizer(update_in_backward=True): each update inside backward().

A post-accumulate-grad hook (Tensor.register_post_accumulate_grad_hook) on
every parameter updates it the moment its gradient is ready, between its
units' engine hooks, so its checkpoint copy starts while backward still runs
on earlier layers; step() then updates what backward did not (gradients set
by hand) and ends the iteration. The first hook of an iteration begins the
engine's step. A second gradient for a parameter before step() (gradient
accumulation) raises InvalidArgumentError out of backward(). The C++
counterpart is hooks::UpdateMode::kInBackward.

UpdateInBackward is a part of CheckpointedOptimizer (a base class it
mixes in): it uses the optimizer's engine, stepper, tables and iteration.

Thread-safety: the hooks run on the autograd thread that accumulates the
gradient (for CPU tensors the thread calling backward()); one training
thread owns the optimizer and calls backward().
"""

import torch

from . import _pmsnap
from .errors import make_error


class UpdateInBackward:
    """The update_in_backward part of CheckpointedOptimizer (module doc)."""

    def _init_update_in_backward(self, enabled):
        # Indices updated since the last step(), whether this iteration's
        # epoch step has begun, the first hook error.
        self._backward_hooks = []
        self._updated_in_backward = set()
        self._backward_step_begun = False
        self._backward_error = None
        if enabled:
            self._register_backward_hooks()

    def _register_backward_hooks(self):
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            raise make_error(_pmsnap.InvalidArgumentError,
                             "update_in_backward needs torch >= 2.1 "
                             "(Tensor.register_post_accumulate_grad_hook); this is torch "
                             f"{torch.__version__}")
        for index, (_, p) in enumerate(self._named):
            self._backward_hooks.append(p.register_post_accumulate_grad_hook(
                lambda param, index=index: self._update_in_backward(index)))

    def _remove_backward_hooks(self):
        for handle in self._backward_hooks:
            handle.remove()
        self._backward_hooks = []

    def _update_in_backward(self, index):
        """Post-accumulate-grad hook of parameter `index`: its update, now."""
        if self._closed:
            return
        name = self._named[index][0]
        if index in self._updated_in_backward:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"parameter '{name}' got a second gradient before step(): with "
                             "update_in_backward=True each parameter is updated as soon as its "
                             "gradient is accumulated, so accumulating gradients over several "
                             "backward passes would change the result; call step() after every "
                             "backward pass, or use update_in_backward=False")
        engine = self._engine
        if engine is not None and not self._backward_step_begun and self._backward_error is None:
            try:
                self._finish_open_step()
                self._check_unchanged()
                engine.begin_step(self.iteration + 1)
            except _pmsnap.Error as e:
                self._backward_error = e
        elif engine is None and not self._backward_step_begun:
            self.check_resumes_pool(self.iteration + 1)
        self._backward_step_begun = True
        if self._backward_error is not None:
            engine = None  # finish the update unobserved; step() raises
        elif engine is not None and name in self._tables:
            try:
                self._mark_table(name)
            except _pmsnap.Error as e:
                self._backward_error, engine = e, None
        error = self._stepper.step_one(self._observer_of(engine), index)
        if error is not None and self._backward_error is None:
            self._backward_error = error
        self._updated_in_backward.add(index)

    def _finish_backward_step(self, step, loss):
        """step() under update_in_backward: updates what backward did not
        (parameters whose gradient was set by hand), then ends the step."""
        remaining = [i for i in range(len(self._named) - 1, -1, -1)
                     if i not in self._updated_in_backward]
        begun, error = self._backward_step_begun, self._backward_error
        self._updated_in_backward = set()
        self._backward_step_begun = False
        self._backward_error = None
        if self._engine is None:
            if not begun:
                self.check_resumes_pool(step)
            self._first_step(step, remaining)
            return loss
        # After a hook error the rest is updated unobserved (the model stays
        # consistent), then the epoch in flight is abandoned, as in step().
        engine = self._engine if error is None else None
        try:
            if engine is not None and not begun:
                self._check_unchanged()
                engine.begin_step(step)
            if engine is not None:
                for index in remaining:
                    name = self._named[index][0]
                    if name in self._tables and self._named[index][1].grad is not None:
                        self._mark_table(name)
        except _pmsnap.Error as e:
            error, engine = e, None
        self._update_and_end_step(step, engine, remaining, error)
        return loss
