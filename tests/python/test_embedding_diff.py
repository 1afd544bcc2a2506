"""Differential embedding checkpoints from Python.

A DLRM-like model (nn.EmbeddingBag + MLP) trained with Adagrad / SGD through
pmsnap.CheckpointedOptimizer with an embedding policy: the table's rows reach
the C++ RowTracker from the EmbeddingTracker's lookups (or the gradient),
each checkpoint writes far fewer bytes than the table, every retained
checkpoint recovers (pmsnap.recover_table) exactly the table and its
optimizer state at that iteration, a restore into a fresh model + optimizer is
bitwise equal and keeps training equal, quantized checkpoints stay within the
quantizer's bound, and misuse raises pmsnap errors carrying the message.
"""

import pytest
import torch

import pmsnap
from conftest import assert_same_training_state

ROWS, DIM, BATCH, BAG = 20000, 8, 32, 4
TABLE = "bag.weight"


class Dlrm(torch.nn.Module):
    def __init__(self, seed=0, max_norm=None):
        super().__init__()
        torch.manual_seed(seed)
        self.bag = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", max_norm=max_norm)
        self.fc1 = torch.nn.Linear(DIM + 4, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, dense, ids, offsets):
        pooled = self.bag(ids, offsets)
        return self.fc2(torch.relu(self.fc1(torch.cat([pooled, dense], dim=1))))


def batch(step):
    g = torch.Generator().manual_seed(4242 + step)
    u = torch.rand(BATCH * BAG, generator=g, dtype=torch.float64)
    ids = (u ** 3 * ROWS).long().clamp_(max=ROWS - 1)  # Zipf-like: skewed to low rows
    offsets = torch.arange(0, BATCH * BAG, BAG)
    dense = torch.randn(BATCH, 4, generator=g)
    return dense, ids, offsets, torch.randn(BATCH, 1, generator=g)


def train_step(model, opt, step):
    dense, ids, offsets, target = batch(step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(dense, ids, offsets), target).backward()
    opt.step()


OPTIMIZERS = {
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.1),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
}


def table_state(model, optimizer):
    """{role: tensor} of the table and its row-shaped optimizer state."""
    out = {"param": model.bag.weight.detach().clone()}
    for key, value in optimizer.state[model.bag.weight].items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == ROWS:
            out[key] = value.clone()
    return out


@pytest.mark.parametrize("policy", ["intermittent", "incrcp"])
@pytest.mark.parametrize("opt_name", ["adagrad", "sgd"])
def test_differential_checkpoints_recover_and_restore_bitwise(pool_path, policy, opt_name):
    steps = 10
    model = Dlrm(seed=1)
    optimizer = OPTIMIZERS[opt_name](model.parameters())
    reference = {}
    table_bytes = ROWS * DIM * 4 * (2 if opt_name == "adagrad" else 1)
    with pmsnap.CheckpointedOptimizer(optimizer, pool=pool_path, model=model, every=1,
                                      embedding_policy=policy, retain=3) as opt:
        assert opt.embedding_tables == [TABLE]
        assert not opt.marks_all_rows(TABLE)
        differential = 0
        for step in range(1, steps + 1):
            if step > 1:
                # The previous checkpoint took its rows; this step's lookups
                # reach the C++ tracker at step().
                assert opt.marked_rows(TABLE).numel() == 0
            train_step(model, opt, step)
            opt.flush()
            reference[step] = table_state(model, optimizer)
            last = opt.last_checkpoint(TABLE)
            assert last["epoch"] >= 1
            if step == 1:
                assert last["full"]
            elif not last["full"]:
                differential += 1
                assert last["bytes_written"] * 8 < table_bytes, last
                if policy == "incrcp":
                    assert last["rows_written"] == torch.unique(batch(step)[1]).numel()
        assert differential >= steps - 3
        assert opt.stats()["encoded_bytes_written"] > 0
        # Through the open optimizer (the pool file is locked while open).
        newest = pmsnap.recover_table(opt, TABLE)
        assert torch.equal(newest, reference[steps]["param"])

    checkpoints = pmsnap.list_checkpoints(pool_path, TABLE)
    assert [c["iteration"] for c in checkpoints] == [steps - 2, steps - 1, steps]
    for c in checkpoints:
        state, info = pmsnap.recover_table(pool_path, TABLE, c["epoch"], state=True,
                                           with_info=True)
        assert info["iteration"] == c["iteration"]
        expect = reference[c["iteration"]]
        assert sorted(state) == sorted(expect)
        for role, tensor in expect.items():
            assert state[role].shape == tensor.shape
            assert torch.equal(state[role], tensor), (c, role)

    # A fresh model + optimizer restore bitwise and keep training equal.
    restored = Dlrm(seed=99)
    restored_optimizer = OPTIMIZERS[opt_name](restored.parameters())
    with pmsnap.CheckpointedOptimizer(restored_optimizer, pool=pool_path, model=restored,
                                      every=1, embedding_policy=policy, retain=3) as opt:
        iteration, _ = opt.restore()
        assert iteration == steps
        assert_same_training_state(model, optimizer, restored, restored_optimizer)
        for step in range(steps + 1, steps + 5):
            train_step(model, optimizer, step)
            train_step(restored, opt, step)
            assert_same_training_state(model, optimizer, restored, restored_optimizer)
        opt.flush()
        assert not opt.last_checkpoint(TABLE)["full"] or policy == "incrcp"
    assert torch.equal(pmsnap.recover_table(pool_path, TABLE), model.bag.weight.detach())


def test_the_users_tracker_shares_the_tables_hook_and_its_removal_loses_no_row(pool_path):
    """track_embeddings with an embedding policy: one forward hook marks the
    user's tracker and the policy's rows. The user's remove() stops only the
    user's tracking: the incremental checkpoints after it still write every
    row the lookups touched, and recover the table exactly."""
    model = Dlrm(seed=1)
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    with pmsnap.CheckpointedOptimizer(optimizer, pool=pool_path, model=model, every=1,
                                      embedding_policy="incrcp", track_embeddings=True) as opt:
        assert len(model.bag._forward_hooks) == 1
        looked_up = []
        for step in range(1, 5):
            train_step(model, opt, step)
            looked_up.append(batch(step)[1])
        assert torch.equal(opt.embedding_tracker.touched("bag"), torch.unique(torch.cat(looked_up)))
        opt.embedding_tracker.remove()
        assert len(model.bag._forward_hooks) == 1  # the policy's, still marking
        incremental = 0
        for step in range(5, 9):
            train_step(model, opt, step)
            opt.flush()
            last = opt.last_checkpoint(TABLE)
            if not last["full"]:
                incremental += 1
                assert last["rows_written"] == torch.unique(batch(step)[1]).numel()
            assert torch.equal(pmsnap.recover_table(opt, TABLE), model.bag.weight.detach())
        assert incremental >= 2
        # Stopped with its removal.
        assert torch.equal(opt.embedding_tracker.touched("bag"), torch.unique(torch.cat(looked_up)))
    assert not model.bag._forward_hooks


def test_gradient_rows_and_dense_update_optimizers_stay_exact(pool_path):
    # A table without a tracked module: rows from its gradient.
    model = Dlrm(seed=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pmsnap.CheckpointedOptimizer(optimizer, pool=pool_path, model=model, every=1,
                                      embeddings=["bag"], embedding_rows="gradients",
                                      embedding_policy="one-shot") as opt:
        for step in range(1, 6):
            train_step(model, opt, step)
    restored = Dlrm(seed=3)
    restored_optimizer = torch.optim.SGD(restored.parameters(), lr=0.1)
    pmsnap.restore(pool_path, restored, restored_optimizer, embeddings=["bag"],
                   embedding_rows="gradients", embedding_policy="one-shot")
    assert_same_training_state(model, optimizer, restored, restored_optimizer)


def test_adam_marks_every_row_and_stays_exact(pool_path):
    model = Dlrm(seed=4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pmsnap.CheckpointedOptimizer(optimizer, pool=pool_path, model=model, every=1,
                                      embedding_policy="incremental") as opt:
        assert opt.marks_all_rows(TABLE)
        for step in range(1, 5):
            train_step(model, opt, step)
    restored = Dlrm(seed=5)
    restored_optimizer = torch.optim.Adam(restored.parameters(), lr=1e-2)
    pmsnap.restore(pool_path, restored, restored_optimizer, embedding_policy="incremental")
    assert_same_training_state(model, optimizer, restored, restored_optimizer)


def test_quantized_checkpoints_restore_within_the_bound(pool_path):
    model = Dlrm(seed=6)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    with pmsnap.CheckpointedOptimizer(optimizer, pool=pool_path, model=model, every=1,
                                      embedding_policy="intermittent", quantize_bits=8) as opt:
        assert opt.embedding_options.quantize and opt.embedding_options.quantize_bits == 8
        for step in range(1, 6):
            train_step(model, opt, step)
    restored = Dlrm(seed=7)
    restored_optimizer = torch.optim.Adagrad(restored.parameters(), lr=0.05)
    pmsnap.restore(pool_path, restored, restored_optimizer, embedding_policy="intermittent",
                   quantize_bits=8)
    original, back = model.bag.weight.detach(), restored.bag.weight.detach()
    # 8-bit rowwise asymmetric: half a step of the row's range, plus fp16
    # rounding of the row's scale and bias.
    row_range = original.amax(1) - original.amin(1)
    bound = row_range / 255 * 0.5 * 1.01 + original.abs().amax(1) * 1e-3 + 1e-6
    assert bool(((back - original).abs().amax(1) <= bound).all())
    assert not torch.equal(back, original)
    assert torch.equal(restored.fc1.weight, model.fc1.weight)  # dense units are exact
    assert torch.allclose(restored_optimizer.state[restored.bag.weight]["sum"],
                          optimizer.state[model.bag.weight]["sum"], rtol=1e-2, atol=1e-4)


def test_errors_raise_pmsnap_errors_with_the_message(pool_path):
    model = Dlrm(seed=8)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    with pytest.raises(pmsnap.InvalidArgumentError, match="'bag.wieght' is not a parameter"):
        pmsnap.CheckpointedOptimizer(optimizer, pool=pool_path, model=model,
                                     embeddings=["bag.wieght"])
    with pytest.raises(pmsnap.InvalidArgumentError, match="float32 \\[rows, dim\\]"):
        pmsnap.CheckpointedOptimizer(optimizer, pool=pool_path, model=model,
                                     embeddings=["fc1.bias"])
    with pytest.raises(pmsnap.InvalidArgumentError, match="unknown embedding policy 'sometimes'"):
        pmsnap.CheckpointedOptimizer(optimizer, pool=pool_path, model=model,
                                     embedding_policy="sometimes")
    with pytest.raises(pmsnap.InvalidArgumentError, match="quantize_bits must be 2, 3, 4 or 8"):
        pmsnap.CheckpointedOptimizer(optimizer, pool=pool_path, model=model,
                                     embedding_policy="full", quantize_bits=5)
    renormed = Dlrm(seed=8, max_norm=1.0)
    with pytest.raises(pmsnap.InvalidArgumentError, match="max_norm"):
        pmsnap.CheckpointedOptimizer(torch.optim.SGD(renormed.parameters(), lr=0.1),
                                     pool=pool_path, model=renormed, embedding_policy="full")
    with pytest.raises(pmsnap.InvalidArgumentError, match="needs model="):
        pmsnap.CheckpointedOptimizer(optimizer, pool=pool_path, embedding_policy="full")

    # A pool without tables.
    with pmsnap.CheckpointedOptimizer(optimizer, pool=pool_path, model=model) as opt:
        train_step(model, opt, 1)
        with pytest.raises(pmsnap.NotFoundError, match="no embedding table 'bag.weight'"):
            opt.last_checkpoint(TABLE)
    with pytest.raises(pmsnap.NotFoundError, match="has no embedding table 'bag.weight'"):
        pmsnap.recover_table(pool_path, TABLE)
    with pytest.raises(pmsnap.NotFoundError, match="has no embedding table 'emb.weight'"):
        pmsnap.list_checkpoints(pool_path, "emb.weight")
    # Switching an existing pool to embedding checkpoints is a model mismatch.
    with pytest.raises(pmsnap.ModelMismatchError, match="'bag.weight' as a dense parameter"):
        pmsnap.CheckpointedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.05),
                                     pool=pool_path, model=model, embedding_policy="incrcp")
    with pytest.raises(pmsnap.NotFoundError, match="does not exist"):
        pmsnap.recover_table(pool_path + ".missing", TABLE)


def test_unknown_table_and_epoch_in_a_pool_with_tables(pool_path):
    model = Dlrm(seed=9)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    with pmsnap.CheckpointedOptimizer(optimizer, pool=pool_path, model=model, every=1,
                                      embedding_policy="incrcp") as opt:
        for step in range(1, 4):
            train_step(model, opt, step)
        with pytest.raises(pmsnap.NotFoundError, match="no embedding table 'fc1.weight'"):
            opt.marked_rows("fc1.weight")
    with pytest.raises(pmsnap.NotFoundError, match="checkpoint 1 is not retained"):
        pmsnap.recover_table(pool_path, TABLE, 1)
    with pytest.raises(pmsnap.NotFoundError, match="no embedding table 'fc1.weight'"):
        pmsnap.recover_table(pool_path, "fc1.weight")
    # Reopening without the embedding arguments is refused, naming the table.
    with pytest.raises(pmsnap.ModelMismatchError, match="'bag.weight' as an embedding table"):
        pmsnap.CheckpointedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.05),
                                     pool=pool_path, model=model)
