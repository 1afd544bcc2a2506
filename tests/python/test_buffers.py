"""Module buffers ([lossless] item 1): a model's persistent buffers
(BatchNorm's running statistics, a custom registered buffer) are checkpointed
with every step, captured at the step boundary, restored by restore(),
exported by every format and read by load_state_dict; non-persistent
buffers stay out. The first user of a BatchNorm model found restore() and
every export silently without them (SIGKILL/resume with BatchNorm:
test_crash_resume.py)."""

import os

import pytest
import safetensors.torch
import torch

import pmsnap


class Net(torch.nn.Module):
    """BatchNorm (running_mean, running_var, num_batches_tracked), a custom
    persistent buffer changed by every forward, and a non-persistent one."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 2)
        self.register_buffer("seen", torch.zeros(2, dtype=torch.float64))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x):
        self.seen += torch.tensor([1.0, float(x.sum())], dtype=torch.float64)
        self.scratch += 1
        return self.out(torch.relu(self.bn(self.fc(x))))


def make(seed=0):
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model, opt, first, last):
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(5, 6, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def buffers_of(model):
    return {name: b.clone() for name, b in model.state_dict().items()
            if name in dict(model.named_buffers())}


def test_buffers_are_restored_bitwise_with_the_parameters(pool_path):
    model, opt = make()
    with pmsnap.CheckpointedOptimizer(opt, pool_path, model=model, every=1) as copt:
        train(model, copt, 1, 7)
        want = buffers_of(model)
        scratch = model.scratch.clone()
    assert set(want) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "seen"}
    model2, opt2 = make(seed=1)
    with pmsnap.CheckpointedOptimizer(opt2, pool_path, model=model2) as copt2:
        iteration, _ = copt2.restore()
        assert iteration == 7
        got = buffers_of(model2)
        for name, value in want.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
        # Non-persistent: not the model's state, left as it was.
        assert torch.equal(model2.scratch, torch.zeros(3))
        assert not torch.equal(scratch, model2.scratch)
        # Training goes on from the restored statistics, as without a break.
        train(model2, copt2, 8, 9)
    train(model, opt, 8, 9)
    for name, value in buffers_of(model).items():
        assert torch.equal(buffers_of(model2)[name], value), name
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_a_checkpoint_holds_the_buffers_of_its_own_step_boundary(pool_path):
    """The next forward changes the buffers in place before the next step's
    hooks: the checkpoint of step k must still hold step k's values."""
    model, opt = make()
    with pmsnap.CheckpointedOptimizer(opt, pool_path, model=model, every=2) as copt:
        train(model, copt, 1, 4)
        at_four = buffers_of(model)
        train(model, copt, 5, 5)  # forward of 5 changed them; 5 is not checkpointed
    state = pmsnap.load_state_dict(pool_path)
    assert state["pmsnap"]["iteration"] == 4
    for name, value in at_four.items():
        assert torch.equal(state["model"][name], value), name


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "dcp"])
def test_every_export_loads_strictly_into_a_fresh_model(pool_path, tmp_path, fmt):
    model, opt = make()
    with pmsnap.CheckpointedOptimizer(opt, pool_path, model=model, every=1) as copt:
        train(model, copt, 1, 3)
    fresh, _ = make(seed=3)
    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp
        out = tmp_path / "dcp"
        pmsnap.export(pool_path, out, format="dcp")
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=str(out))
        fresh.load_state_dict(state["model"], strict=True)
    else:
        out = tmp_path / f"model.{fmt}"
        pmsnap.export(pool_path, out, model_only=True)
        if fmt == "safetensors":
            tensors = safetensors.torch.load_file(str(out))
        else:
            tensors = torch.load(out, weights_only=True)
            tensors = tensors.get("model", tensors)
        fresh.load_state_dict(tensors, strict=True)
    for name, value in model.state_dict().items():
        if name == "scratch":
            continue
        assert torch.equal(fresh.state_dict()[name], value), name


def test_load_state_dict_reads_buffers_and_names_them(pool_path):
    model, opt = make()
    with pmsnap.CheckpointedOptimizer(opt, pool_path, model=model, every=1) as copt:
        train(model, copt, 1, 2)
    state = pmsnap.load_state_dict(pool_path)
    assert "scratch" not in state["model"]
    assert torch.equal(state["model"]["bn.running_var"], model.bn.running_var)
    assert "bn.running_var" not in state["optimizer"]["state"]
    assert all("bn.running_var" not in g["params"]
               for g in state["optimizer"]["param_groups"])
    only = pmsnap.load_state_dict(pool_path, names=["bn.num_batches_tracked"])
    assert list(only["model"]) == ["bn.num_batches_tracked"]
    assert int(only["model"]["bn.num_batches_tracked"]) == 2


def test_a_pool_without_buffers_opens_only_with_buffers_false(pool_path):
    model, opt = make()
    with pmsnap.CheckpointedOptimizer(opt, pool_path, model=model, every=1,
                                      buffers=False) as copt:
        train(model, copt, 1, 2)
    model2, opt2 = make()
    with pytest.raises(pmsnap.ModelMismatchError, match="buffers=False"):
        pmsnap.CheckpointedOptimizer(opt2, pool_path, model=model2)
    with pmsnap.CheckpointedOptimizer(opt2, pool_path, model=model2, buffers=False) as copt2:
        assert copt2.restore()[0] == 2
        assert torch.equal(model2.bn.running_var, torch.ones(8))  # left as they were


def test_a_buffer_that_changes_shape_is_named(pool_path):
    model, opt = make()
    with pmsnap.CheckpointedOptimizer(opt, pool_path, model=model, every=1) as copt:
        train(model, copt, 1, 2)
        copt.zero_grad()
        model(torch.randn(5, 6)).square().mean().backward()
        model.seen = torch.zeros(3, dtype=torch.float64)  # rebound, another shape
        with pytest.raises(pmsnap.ModelMismatchError, match="'seen'"):
            copt.step()


def test_stats_say_what_pmsnap_holds_in_memory_shadows_included(pool_path):
    model, opt = make()
    copt = pmsnap.CheckpointedOptimizer(opt, pool_path, model=model, every=1)
    train(model, copt, 1, 3)
    memory = copt.stats()["memory"]
    assert memory["pool_mapped_bytes"] == os.path.getsize(pool_path)
    assert 0 < memory["pool_resident_bytes"] <= memory["pool_mapped_bytes"]
    assert memory["staging_bytes"] == 0 and memory["registered_bytes"] == 0  # host, no staging
    # One shadow per persistent buffer: running_mean and running_var (8
    # floats each), num_batches_tracked (one int64), seen (2 doubles).
    assert memory["python_copies_bytes"] == 8 * 4 * 2 + 8 + 2 * 8
    assert memory["python_copies_device_bytes"] == 0
    copt.close()
    at_close = copt.stats()["memory"]  # as at close()
    for key in ("pool_mapped_bytes", "python_copies_bytes", "registered_bytes"):
        assert at_close[key] == memory[key], key
    assert at_close["pool_resident_bytes"] > 0
