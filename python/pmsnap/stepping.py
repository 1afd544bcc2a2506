"""ParameterStepper: a torch.optim optimizer stepped one parameter at a time.

pmsnap checkpoints weight by weight while training runs, so it must see every
parameter's update as its own event (docs/ARCHITECTURE.md, "From an optimizer
hook to a committed epoch"). A torch.optim optimizer updates all parameters
inside one step() and skips the ones whose .grad is None; the stepper uses
exactly that: it hides every gradient, then for each parameter (last first,
the order backward produces gradients) shows only that parameter's gradient
and calls the wrapped optimizer's own step(), between the observer's
before_update and after_update (the unit's engine hooks). The arithmetic is
the optimizer's own code on the same tensors, so results are bitwise
identical to one plain step() (tests/python/test_equivalence.py). The C++
hooks::ParameterStepper does the same for libtorch's optimizers.

Thread-safety: not thread-safe; the training thread that owns the
CheckpointedOptimizer.
"""

from . import _pmsnap


class ParameterStepper:
    """Steps `optimizer` over `params` (a list, in registration order) one at a time.

    An observer has before_update(index) and after_update(index), which may
    raise pmsnap.Error, and after_optimizer_step(index), called right after
    the optimizer updated parameter `index` (also once a hook failed), whose
    errors propagate.
    """

    def __init__(self, optimizer, params):
        self.optimizer = optimizer
        self._params = list(params)

    def step(self, observer, indices=None):
        """Updates every parameter with a gradient (all, or `indices`; default
        last first) between the observer's hooks (observer None: unobserved).
        After a hook error the remaining parameters are still updated, without
        hooks, and the first error is raised at the end. Any other exception
        (from the optimizer, Ctrl-C) leaves the update half done and
        propagates. Every gradient is left as it was."""
        if indices is None:
            indices = range(len(self._params) - 1, -1, -1)
        error = None
        with self._only_gradient_shown() as shown:
            for index in indices:
                error = self._update(observer, index, shown, error)
        if error is not None:
            raise error

    def step_one(self, observer, index):
        """Updates parameter `index` alone, as step() would; returns the
        hook's pmsnap.Error, or None (the update completes either way)."""
        with self._only_gradient_shown() as shown:
            return self._update(observer, index, shown, None)

    def _only_gradient_shown(self):
        """Context: every gradient hidden from the optimizer; shown(index)
        gives the one the optimizer may see while it steps (torch.optim skips
        parameters whose .grad is None). Everything is put back at exit."""
        params = self._params
        grads = [p.grad for p in params]

        class _Shown:
            def __enter__(inner):
                for p in params:
                    p.grad = None
                return inner

            def __call__(inner, index):
                return grads[index]

            def __exit__(inner, *exc):
                for p, grad in zip(params, grads):
                    p.grad = grad
                return False

        return _Shown()

    def _update(self, observer, index, shown, error):
        """Updates parameter `index` between its hooks (none once a hook
        failed: `error`, returned with any new one)."""
        grad = shown(index)
        if grad is None:
            return error  # the engine counts it as updated at the step's end
        p = self._params[index]
        hooked = observer is not None and error is None
        if hooked:
            try:
                observer.before_update(index)
            except _pmsnap.Error as e:
                error, hooked = e, False
        p.grad = grad
        try:
            self.optimizer.step()
        finally:
            p.grad = None
        if observer is not None:
            observer.after_optimizer_step(index)
        if hooked:
            try:
                observer.after_update(index)
            except _pmsnap.Error as e:
                error = e
        return error
