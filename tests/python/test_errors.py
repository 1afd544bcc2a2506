"""Every error path raises a pmsnap.Error subclass with a message a person can act on.

Messages come from the C++ runtime (the pool file, the unit, what was
expected) or from the Python layer for checks only it can make (a parameter
whose storage moved). Each exception also carries .code.
"""

import os

import pytest
import torch

import pmsnap
from conftest import make_model, train_step


def wrap(model, pool, **kwargs):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return pmsnap.CheckpointedOptimizer(opt, pool=pool, model=model, **kwargs), opt


def make_pool(pool, steps=2, **model_kwargs):
    model = make_model(**model_kwargs)
    copt, _ = wrap(model, pool, every=1)
    with copt:
        for step in range(steps):
            train_step(model, copt, step)
    return model


def test_wrong_model_names_the_parameter(pool_path):
    make_pool(pool_path)
    other = make_model(widths=(12, 32, 20, 4))  # layers.1 and layers.2 change shape
    with pytest.raises(pmsnap.ModelMismatchError, match=r"layers\.1\.weight") as info:
        wrap(other, pool_path)
    assert isinstance(info.value, ValueError)
    assert pool_path in str(info.value)
    opt = torch.optim.Adam(other.parameters())
    with pytest.raises(pmsnap.ModelMismatchError, match=r"layers\.1\.weight"):
        pmsnap.restore(pool_path, other, opt)


def test_other_optimizer_state_is_a_model_mismatch(pool_path):
    make_pool(pool_path)  # Adam: exp_avg, exp_avg_sq, step per parameter
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.state[next(model.parameters())]["momentum_buffer"] = torch.zeros(32, 12)
    with pytest.raises(pmsnap.ModelMismatchError, match="momentum_buffer") as info:
        pmsnap.restore(pool_path, model, opt)
    assert "layers.0.weight" in str(info.value)
    assert info.value.code == "ModelMismatch"
    # Nothing was added to the optimizer's state.
    assert sorted(opt.state[next(model.parameters())]) == ["momentum_buffer"]
    assert len(opt.state) == 1


def test_unnamed_parameters_mismatch_names_the_unit(pool_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path) as copt:  # no model: group0.paramN
        train_step(model, copt, 0)
    with pytest.raises(pmsnap.ModelMismatchError, match="group0.param0"):
        wrap(make_model(), pool_path)


def test_shape_change_after_wrapping(pool_path):
    model = make_model()
    copt, _ = wrap(model, pool_path)
    with copt:
        train_step(model, copt, 0)
        with torch.no_grad():
            model.layers[2].weight.data = torch.zeros(4, 17)
        with pytest.raises(pmsnap.ModelMismatchError,
                           match=r"layers\.2\.weight.*\[4, 16\].*\[4, 17\]"):
            copt.step()


def test_replaced_storage_stays_alive_for_the_checkpoint_in_flight(pool_path):
    # The checkpoint of step 0 may still be copying layers.2.weight in the
    # background when the training thread swaps the tensor's storage; the old
    # storage must outlive that copy (freed, the engine read freed memory:
    # AddressSanitizer's heap-use-after-free in Pool::WritePart).
    from torch.multiprocessing.reductions import StorageWeakRef
    model = make_model()
    copt, _ = wrap(model, pool_path)
    with copt:
        train_step(model, copt, 0)
        old_storage = StorageWeakRef(model.layers[2].weight.untyped_storage())
        with torch.no_grad():
            model.layers[2].weight.data = torch.zeros(4, 16)
        assert not old_storage.expired()
        with pytest.raises(pmsnap.ModelMismatchError, match=r"layers\.2\.weight.*moved"):
            copt.step()


def test_moved_storage_is_refused(pool_path):
    model = make_model()
    copt, _ = wrap(model, pool_path)
    with copt:
        train_step(model, copt, 0)
        model.layers[0].bias.data = model.layers[0].bias.data.clone()
        with pytest.raises(pmsnap.ModelMismatchError, match=r"layers\.0\.bias.*storage"):
            train_step(model, copt, 1)


def test_pool_larger_than_the_file_system(pool_path):
    model = make_model()
    copt, _ = wrap(model, pool_path, extra_state_capacity=1 << 50)  # 1 PiB per slot
    with copt:
        with pytest.raises(pmsnap.NoSpaceError, match="needs") as info:
            train_step(model, copt, 0)
    assert isinstance(info.value, OSError)
    assert pool_path in str(info.value)
    assert not os.path.exists(pool_path)


def test_extra_state_over_capacity(pool_path):
    model = make_model()
    # The RNG states alone take ~12 KiB.
    copt, _ = wrap(model, pool_path, every=1, extra_state_capacity=32 << 10)
    with copt:
        train_step(model, copt, 0)
        copt.extra_state = {"blob": b"x" * (64 << 10)}
        with pytest.raises(pmsnap.CapacityExceededError, match="extra state of .* bytes exceeds"):
            train_step(model, copt, 1)


@pytest.mark.parametrize("spec", ["gpu", "simulated:fast", "simulated:1:2:3", "host:1", ""])
def test_bad_device_spec(spec, pool_path):
    with pytest.raises(pmsnap.InvalidArgumentError, match="device spec") as info:
        wrap(make_model(), pool_path, device=spec)
    assert isinstance(info.value, ValueError)


def test_bad_strategy_mode_and_interval(pool_path):
    with pytest.raises(pmsnap.InvalidArgumentError, match="strategy '5'"):
        wrap(make_model(), pool_path, strategy=5)
    with pytest.raises(pmsnap.InvalidArgumentError, match="mode 'sometimes'"):
        wrap(make_model(), pool_path, mode="sometimes")
    with pytest.raises(pmsnap.InvalidArgumentError, match="every"):
        wrap(make_model(), pool_path, every=0)
    with pytest.raises(pmsnap.InvalidArgumentError, match="torch.optim.Optimizer"):
        pmsnap.CheckpointedOptimizer(object(), pool=pool_path)


def test_missing_pool_and_not_a_pool(pool_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(pmsnap.NotFoundError, match="does not exist") as info:
        pmsnap.restore(pool_path, model, opt)
    assert isinstance(info.value, FileNotFoundError)
    with open(pool_path, "wb") as f:
        f.write(b"this is not a pool" * 1000)
    with pytest.raises(pmsnap.Error) as info:
        pmsnap.restore(pool_path, model, opt)
    assert pool_path in str(info.value)
    assert pmsnap.has_checkpoint("/nonexistent/dir/x.pool") is False


def test_truncated_pool_is_an_error_not_a_crash(pool_path):
    make_pool(pool_path)
    size = os.path.getsize(pool_path)
    with open(pool_path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(pmsnap.Error) as info:
        pmsnap.restore(pool_path, make_model(), torch.optim.Adam(make_model().parameters()))
    assert pool_path in str(info.value)


def test_fresh_run_refuses_to_overwrite_checkpoints(pool_path):
    make_pool(pool_path, steps=3)
    model = make_model()
    copt, _ = wrap(model, pool_path)
    with pytest.raises(pmsnap.FailedPreconditionError, match="already holds iteration 3"):
        train_step(model, copt, 0)
    copt.close()


def test_use_after_close_and_restore_after_step(pool_path):
    model = make_model()
    copt, _ = wrap(model, pool_path)
    train_step(model, copt, 0)
    with pytest.raises(pmsnap.FailedPreconditionError, match="before the first step"):
        copt.restore()
    copt.close()
    copt.close()  # idempotent
    with pytest.raises(pmsnap.FailedPreconditionError, match="closed"):
        copt.step()


def test_state_gained_after_layout_is_reported(pool_path):
    """A parameter without a gradient in the first step cannot gain state later."""
    model = make_model()
    copt, _ = wrap(model, pool_path)
    with copt:
        x = torch.randn(2, 12)
        copt.zero_grad(set_to_none=True)
        model.layers[0](x).sum().backward()  # only layers.0 gets a gradient
        copt.step()
        with pytest.raises(pmsnap.ModelMismatchError, match=r"layers\.2\.bias.*state"):
            train_step(model, copt, 1)


def test_optimizer_exception_mid_step_abandons_the_epoch(pool_path):
    """An exception inside the wrapped optimizer's step closes the engine cleanly."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    copt = pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1)
    for step in range(3):
        train_step(model, copt, step)
    original = opt.step
    opt.step = lambda *a, **k: (_ for _ in ()).throw(FloatingPointError("boom"))
    with pytest.raises(FloatingPointError):
        train_step(model, copt, 3)
    opt.step = original
    assert all(p.grad is not None for p in model.parameters())  # grads restored
    with pytest.raises(pmsnap.FailedPreconditionError):
        copt.step()
    copt.close()
    assert pmsnap.read_pool(pool_path)["latest"]["iteration"] == 3
