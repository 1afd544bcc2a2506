"""ParameterStepper: a torch.optim optimizer stepped a few parameters at a time.

pmsnap checkpoints weight by weight while training runs, so it must see each
parameter's update as an event of its own (docs/ARCHITECTURE.md, "From an
optimizer hook to a committed epoch"). A torch.optim optimizer updates all
parameters inside one step() and skips the ones whose .grad is None; the
stepper uses exactly that: it hides every gradient, then for each group of
parameters (last first, the order backward produces gradients) shows only
that group's gradients and calls the wrapped optimizer's own step(), between
the observer's before_update and after_update of each parameter in the group
(the units' engine hooks). The arithmetic is the optimizer's own code on the
same tensors, so results are bitwise identical to one plain step()
(tests/python/test_equivalence.py). The C++ hooks::ParameterStepper does the
same for libtorch's optimizers, one parameter at a time.

Why groups: every torch.optim step() call costs 0.1-0.5 ms of Python
whatever it updates (its decorators, profiler record, default-to-foreach
check, a pass over the whole param group), so stepping the 72 tensors of a
small transformer one by one added 8 ms of CPU to a 13 ms AdamW step
(bench/RESULTS.md, "The Python transformer loop"). Groups of about equal
bytes keep at most `groups` calls per step whatever the number of tensors,
while the first group's updates need not wait for the other groups' copies.
The optimizer steps groups only while an earlier checkpoint still copies;
a step no copy can make wait is one call (`one_call`).

Thread-safety: not thread-safe; the training thread that owns the
CheckpointedOptimizer.
"""

from . import _pmsnap


class ParameterStepper:
    """Steps `optimizer` over `params` (a list, in registration order) in
    about `groups` optimizer.step() calls per step (None or 0: one call per
    parameter).

    An observer has before_update(index) and after_update(index), which may
    raise pmsnap.Error, and after_optimizer_step(index), called right after
    the optimizer updated parameter `index` (also once a hook failed), whose
    errors propagate.
    """

    def __init__(self, optimizer, params, groups=None):
        self.optimizer = optimizer
        self._params = list(params)
        if groups:
            total = sum(p.numel() * p.element_size() for p in self._params)
            self._group_bytes = max(1, -(-total // groups))
        else:
            self._group_bytes = 0

    def step(self, observer, indices=None, one_call=False):
        """Updates every parameter with a gradient (all, or `indices`; default
        last first) between the observer's hooks (observer None: unobserved).
        one_call: in a single optimizer.step(), every before_update first
        (for a step no copy in flight can make wait, where groups would only
        add calls; always when unobserved). After a hook error the remaining parameters
        are still updated, without hooks, and the first error is raised at
        the end. Any other exception (from the optimizer, Ctrl-C) leaves the
        update half done and propagates. Every gradient is left as it was."""
        one_call = one_call or observer is None
        every_parameter = indices is None
        if every_parameter:
            indices = range(len(self._params) - 1, -1, -1)
        if every_parameter and one_call:
            # Nothing to hide from the optimizer: the gradients stay in
            # place, 4 swaps per parameter fewer.
            error = self._update(observer, indices, None, None)
        else:
            error = None
            with self._only_gradient_shown() as shown:
                groups = [list(indices)] if one_call else self._groups_of(indices)
                for group in groups:
                    error = self._update(observer, group, shown, error)
        if error is not None:
            raise error

    def step_one(self, observer, index):
        """Updates parameter `index` alone, as step() would; returns the
        hook's pmsnap.Error, or None (the update completes either way)."""
        with self._only_gradient_shown() as shown:
            return self._update(observer, (index,), shown, None)

    def _groups_of(self, indices):
        """`indices` in order, cut into runs of about _group_bytes each."""
        group, size = [], 0
        for index in indices:
            group.append(index)
            p = self._params[index]
            size += p.numel() * p.element_size()
            if size >= self._group_bytes:
                yield group
                group, size = [], 0
        if group:
            yield group

    def _only_gradient_shown(self):
        """Context: every gradient hidden from the optimizer; shown(index)
        gives the one the optimizer may see while it steps (torch.optim skips
        parameters whose .grad is None). Everything is put back at exit."""
        return _HiddenGradients(self._params)

    def _update(self, observer, group, shown, error):
        """Updates the parameters `group` in one optimizer step, each between
        its hooks (none once a hook failed: `error`, returned with the first
        new one). `shown`: the hidden gradients' context, or None when
        `group` is every parameter and the gradients stay in place.
        Parameters without a gradient are left to the engine, which counts
        them as updated at the step's end."""
        if shown is None:
            present = [index for index in group if self._params[index].grad is not None]
        else:
            present = [index for index in group if shown(index) is not None]
        if not present:
            return error
        hooked = []
        if observer is not None:
            for index in present:
                if error is not None:
                    break
                try:
                    observer.before_update(index)
                    hooked.append(index)
                except _pmsnap.Error as e:
                    error = e
        if shown is None:
            self.optimizer.step()
        else:
            for index in present:
                self._params[index].grad = shown(index)
            try:
                self.optimizer.step()
            finally:
                for index in present:
                    self._params[index].grad = None
        if observer is not None:
            for index in present:
                observer.after_optimizer_step(index)
        for index in hooked:
            try:
                observer.after_update(index)
            except _pmsnap.Error as e:
                error = error or e
        return error


class _HiddenGradients:
    """ParameterStepper._only_gradient_shown's context. A module-level class
    with no reference cycle: a class made per call is cyclic garbage, which
    kept each step's gradients alive until the cycle collector ran (7-10
    steps' gradients, 133 MB of heap on a 4.7M-parameter transformer)."""

    __slots__ = ("_params", "_grads")

    def __init__(self, params):
        self._params = params
        self._grads = [p.grad for p in params]

    def __enter__(self):
        for p in self._params:
            p.grad = None
        return self

    def __call__(self, index):
        return self._grads[index]

    def __exit__(self, *exc):
        for p, grad in zip(self._params, self._grads):
            p.grad = grad
        self._grads = None
        return False


class EngineObserver:
    """ParameterStepper's observer: parameter `index`'s units' engine hooks
    around its update, and its registered state kept in place after it."""

    __slots__ = ("_engine", "_unit_ids", "_units", "_optimizer")

    def __init__(self, engine, unit_ids, units, optimizer):
        self._engine = engine
        self._unit_ids = unit_ids
        self._units = units
        self._optimizer = optimizer

    def before_update(self, index):
        for unit in self._unit_ids[index]:
            self._engine.before_update(unit)

    def after_optimizer_step(self, index):
        self._units[index].repin_state(self._optimizer)

    def after_update(self, index):
        for unit in self._unit_ids[index]:
            self._engine.after_update(unit)
