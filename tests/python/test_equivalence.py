"""CheckpointedOptimizer gives bitwise the same training as the plain optimizer.

Per-parameter stepping (stepping.py) must not change a single bit of the
parameters or the optimizer state, for every supported optimizer, under every
conflict strategy and on a slow simulated device where conflicts happen. The
pool written along the way must restore to the final state bit for bit.
"""

import pytest
import torch

import pmsnap
from conftest import (assert_same_training_state, device_slower_than_the_steps, make_model,
                      train_step)

STEPS = 30

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "sgd_nesterov_dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
    # torch 2.x implementations: multi-tensor (foreach) and fused kernels, and
    # the single-tensor loop forced where a default might pick another.
    "sgd_momentum_foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam_single_tensor": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05, foreach=True),
    "adamw_single_tensor": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05,
                                                       foreach=False),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05, fused=True),
    "adagrad_foreach": lambda p: torch.optim.Adagrad(p, lr=0.1, foreach=True),
    "rmsprop_foreach": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, foreach=True),
}


def run(make_opt, pool=None, steps=STEPS, widths=(12, 32, 16, 4), **kwargs):
    model = make_model(widths=widths)
    opt = make_opt(model.parameters())
    if pool is None:
        for step in range(steps):
            train_step(model, opt, step)
        return model, opt
    with_stats = kwargs.pop("with_stats", False)
    with pmsnap.CheckpointedOptimizer(opt, pool=pool, model=model, **kwargs) as copt:
        for step in range(steps):
            train_step(model, copt, step)
    return (model, opt, copt.stats()) if with_stats else (model, opt)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bitwise_equal_to_plain_optimizer(name, pool_path):
    plain_model, plain_opt = run(OPTIMIZERS[name])
    model, opt = run(OPTIMIZERS[name], pool_path, every=1)
    assert_same_training_state(plain_model, plain_opt, model, opt)

    # Every step was checkpointed and the close committed the last one.
    fresh_model = make_model(seed=123)
    fresh_opt = OPTIMIZERS[name](fresh_model.parameters())
    iteration, extra = pmsnap.restore(pool_path, fresh_model, fresh_opt)
    assert iteration == STEPS
    assert "rng" in extra
    assert_same_training_state(model, opt, fresh_model, fresh_opt)


@pytest.mark.parametrize("strategy", ["1", "2", "3", "4", "adaptive"])
def test_bitwise_equal_under_conflicts(strategy, pool_path):
    # A slow link (0.02 GB/s: ~40 ms for the 256x256 layer's weight and Adam
    # state) and small parts make snapshots lag behind the next update even
    # when a loaded machine slows the training steps, so every strategy's
    # conflict path runs. 0.5 MiB of simulated device memory holds the small
    # units' in-device copies but never the large one's, which falls back to
    # waiting: strategy 1, whose in-device copies finish in microseconds,
    # conflicts there.
    widths = (64, 256, 256, 8)
    plain_model, plain_opt = run(OPTIMIZERS["adam"], steps=12, widths=widths)
    model, opt, stats = run(OPTIMIZERS["adam"], pool_path, steps=12, widths=widths,
                            device="simulated:0.02:0.5", strategy=strategy, part_bytes=4096,
                            with_stats=True)
    assert_same_training_state(plain_model, plain_opt, model, opt)
    assert stats["conflicts"] > 0
    assert stats["epochs_committed"] >= 1


def test_param_without_grad_is_skipped_like_plain(pool_path):
    """A parameter with no gradient in some steps is left alone, as torch does.

    Step 0 gives every parameter a gradient (the pool is laid out after the
    first step, with the state torch made then); later steps sometimes reach
    only the first layer.
    """
    def train(model, opt, steps=10):
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4, 12, generator=g)
            opt.zero_grad(set_to_none=True)
            if step % 3 == 2:
                loss = model.layers[0](x).sum()
            else:
                loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()

    plain = make_model()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    train(plain, plain_opt)
    wrapped = make_model()
    opt = torch.optim.Adam(wrapped.parameters(), lr=1e-2)
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=wrapped, every=1) as copt:
        train(wrapped, copt)
    assert_same_training_state(plain, plain_opt, wrapped, opt)


@pytest.mark.parametrize("step_groups", [None, 1, 2, 3, 100])
def test_step_groups_bound_the_optimizer_calls_while_a_copy_is_in_flight(step_groups, pool_path):
    """While an earlier checkpoint still copies, step_groups=G steps the
    wrapped optimizer at most G times per step (a group ends once it holds
    1/G of the parameter bytes), None once per parameter; a step begun with
    no copy in flight steps it once, captured or not. Neither changes a bit
    of the training, and both leave every gradient in place."""
    widths = (12, 32, 32, 16, 4)  # 8 tensors of unequal sizes
    plain_model, plain_opt = run(OPTIMIZERS["adamw"], widths=widths)
    model = make_model(widths=widths)
    opt = OPTIMIZERS["adamw"](model.parameters())
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    params = len(list(model.parameters()))
    in_flight_steps = 0
    # Continuous mode on a link slower than the steps: a boundary that
    # finds the checkpoint in flight skips it, and the step's updates may
    # wait for its copies.
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, mode="continuous",
                                      device=device_slower_than_the_steps(50, widths=widths),
                                      step_groups=step_groups) as copt:
        for step in range(STEPS):
            flushed = step % 4 == 1
            if flushed:
                copt.flush()
            started = copt.stats()["epochs_started"] if step else 0
            calls.clear()
            train_step(model, GradientsKept(copt, model), step)
            # In flight after a step that opened no epoch: in flight all
            # through it (it only ever goes from true to false).
            in_flight_all_through = (copt.stats()["epochs_started"] == started
                                     and copt._engine.epoch_in_flight)
            if step == 0 or flushed:
                assert len(calls) == 1, f"step {step}"
            elif in_flight_all_through:
                in_flight_steps += 1
                if step_groups is None:
                    assert len(calls) == params, f"step {step}"
                else:
                    assert 1 <= len(calls) <= min(step_groups, params), f"step {step}"
                    assert len(calls) > 1 or step_groups == 1, f"step {step}"
    assert in_flight_steps > 0
    assert_same_training_state(plain_model, plain_opt, model, opt)


class GradientsKept:
    """`optimizer`, whose step() must leave each of `model`'s gradients the
    same tensor (the stepping hides them from the wrapped optimizer only
    while it runs groups)."""

    def __init__(self, optimizer, model):
        self._optimizer = optimizer
        self._params = list(model.parameters())

    def zero_grad(self):
        self._optimizer.zero_grad()

    def step(self):
        before = [p.grad for p in self._params]
        self._optimizer.step()
        moved = [i for i, (p, g) in enumerate(zip(self._params, before)) if p.grad is not g]
        assert not moved, f"step() replaced the gradients of parameters {moved}"


def test_step_groups_must_be_a_count(pool_path):
    model = make_model()
    with pytest.raises(pmsnap.InvalidArgumentError, match="step_groups"):
        pmsnap.CheckpointedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pool=pool_path,
                                     model=model, step_groups=-1)
