"""update_in_backward: each parameter is updated inside backward, as soon as
its gradient is accumulated, so its checkpoint copy starts while backward
still runs on earlier layers. The result must be bitwise that of
backward() then step(), and the pool must restore to it."""

import pytest
import torch

import pmsnap
from conftest import assert_same_training_state, make_model, train_step
from test_equivalence import OPTIMIZERS, run

STEPS = 20
IN_BACKWARD_OPTIMIZERS = ["sgd_momentum", "adam", "adam_foreach", "adamw_fused", "adagrad",
                          "rmsprop"]


@pytest.mark.parametrize("name", IN_BACKWARD_OPTIMIZERS)
def test_update_in_backward_is_bitwise_equal_to_step_after_backward(name, pool_path):
    plain_model, plain_opt = run(OPTIMIZERS[name], steps=STEPS)
    model, opt, stats = run(OPTIMIZERS[name], pool_path, steps=STEPS, every=1,
                            update_in_backward=True, with_stats=True)
    assert_same_training_state(plain_model, plain_opt, model, opt)
    assert stats["epochs_committed"] >= STEPS - 1

    fresh_model = make_model(seed=99)
    fresh_opt = OPTIMIZERS[name](fresh_model.parameters())
    iteration, _ = pmsnap.restore(pool_path, fresh_model, fresh_opt)
    assert iteration == STEPS
    assert_same_training_state(model, opt, fresh_model, fresh_opt)


def test_updates_happen_inside_backward(pool_path):
    """After backward() returns (before step()) every parameter already moved."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pmsnap.CheckpointedOptimizer(opt, pool_path, model=model,
                                      update_in_backward=True) as copt:
        for step in range(3):
            before = [p.detach().clone() for p in model.parameters()]
            copt.zero_grad()
            x = torch.randn(4, model.layers[0].in_features)
            model(x).square().sum().backward()
            moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
            assert all(moved), f"step {step}: parameters not updated in backward: {moved}"
            copt.step()


def test_update_in_backward_under_conflicts(pool_path):
    """A slow simulated link: copies started in backward conflict with the
    next iteration's updates; results stay bitwise equal."""
    widths = (64, 256, 256, 8)
    plain_model, plain_opt = run(OPTIMIZERS["adam"], steps=10, widths=widths)
    model, opt, stats = run(OPTIMIZERS["adam"], pool_path, steps=10, widths=widths,
                            device="simulated:0.02:0.5", strategy="2", part_bytes=4096,
                            update_in_backward=True, with_stats=True)
    assert_same_training_state(plain_model, plain_opt, model, opt)
    assert stats["conflicts"] > 0


def test_gradient_accumulation_is_a_clear_error(pool_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    copt = pmsnap.CheckpointedOptimizer(opt, pool_path, model=model, update_in_backward=True)
    try:
        train_step(model, copt, 0)
        x = torch.randn(4, model.layers[0].in_features)
        model(x).sum().backward()
        with pytest.raises(pmsnap.InvalidArgumentError, match="several backward passes"):
            model(x).sum().backward()
    finally:
        copt.close(abandon=True)


def test_hand_set_gradients_are_updated_by_step(pool_path):
    """A gradient that did not come from backward (no hook fired) is applied
    by step(), as the plain optimizer would."""
    def hand_step(model, opt, step):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()

    plain = make_model()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(5):
        hand_step(plain, plain_opt, step)
    with pmsnap.CheckpointedOptimizer(opt, pool_path, model=model,
                                      update_in_backward=True) as copt:
        for step in range(5):
            hand_step(model, copt, step)
    assert_same_training_state(plain, plain_opt, model, opt)
