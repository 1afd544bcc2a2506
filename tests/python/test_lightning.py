"""pmsnap.lightning.PmsnapCheckpoint ([integrations] item 1): one callback in
Trainer(...) checkpoints every step; trainer.fit(ckpt_path=pool) resumes
bit-exact after a SIGKILL (model with buffers, AdamW, a per-step LR
schedule, a shuffled stateful loader across epochs, the RNG) against an
uninterrupted Lightning run without pmsnap. Misuse is refused by name.

Thread-safety: the killed runs are child processes (lightning_trainer.py).
"""

import os

import lightning.pytorch as pl
import pytest
import torch

import pmsnap
from conftest import assert_equal_nested, run_to_kill
from lightning_trainer import BATCHES_PER_EPOCH, Regressor, ShuffledBatches
from pmsnap.lightning import PmsnapCheckpoint

TRAINER = os.path.join(os.path.dirname(__file__), "lightning_trainer.py")
STEPS = 3 * BATCHES_PER_EPOCH - 1  # three epochs, the last one cut short


def run(mode, pool, out, kill_at=0):
    args = [TRAINER, mode, pool, str(STEPS), out] + ([str(kill_at)] if kill_at else [])
    return run_to_kill(args, kill_at)


@pytest.mark.parametrize("kills", ["epoch-ends", "random"])
def test_a_trainer_killed_twice_resumes_bit_exact_from_its_pool(pool_path, tmp_path, rng,
                                                                 kills):
    reference = str(tmp_path / "plain.pt")
    run("plain", pool_path, reference)
    if kills == "epoch-ends":  # the last batch of an epoch, where the loops roll over
        first, second = BATCHES_PER_EPOCH, 2 * BATCHES_PER_EPOCH
    else:
        first, second = sorted(rng.sample(range(1, STEPS), 2))
    print(f"kills after steps {first} and {second}")
    resumed = str(tmp_path / "resumed.pt")
    assert run("pmsnap", pool_path, resumed, kill_at=first) == (1, -9)
    assert run("pmsnap", pool_path, resumed, kill_at=second) == (first + 1, -9)
    assert run("pmsnap", pool_path, resumed)[0] == second + 1
    expected = torch.load(reference, weights_only=False)
    got = torch.load(resumed, weights_only=False)
    assert got["global_step"] == STEPS
    assert_equal_nested(expected, got)


def trainer_with(callback, steps):
    return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[callback])


def test_fit_without_ckpt_path_never_overwrites_a_pool_that_holds_checkpoints(pool_path):
    trainer_with(PmsnapCheckpoint(pool_path), 2).fit(Regressor(), ShuffledBatches(seed=1))
    assert pmsnap.read_pool(pool_path)["latest"]["iteration"] == 2
    with pytest.raises(pmsnap.FailedPreconditionError,
                       match=f"pool {pool_path} already holds a checkpoint.*ckpt_path="):
        trainer_with(PmsnapCheckpoint(pool_path), 4).fit(Regressor(), ShuffledBatches(seed=1))
    assert pmsnap.read_pool(pool_path)["latest"]["iteration"] == 2


def test_a_pool_written_without_the_callback_is_refused_as_a_ckpt_path(pool_path):
    model = torch.nn.Linear(3, 2)
    with pmsnap.CheckpointedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pool_path,
                                      model=model) as optimizer:
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    trainer = trainer_with(PmsnapCheckpoint(pool_path), 2)
    with pytest.raises(pmsnap.FailedPreconditionError, match="not written by pmsnap.lightning"):
        trainer.fit(Regressor(), ShuffledBatches(seed=1), ckpt_path=pool_path)


class TwoOptimizers(Regressor):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                torch.optim.SGD(self.net[4].parameters(), lr=0.1)]


def test_more_than_one_optimizer_and_reserved_keywords_are_refused(pool_path):
    with pytest.raises(pmsnap.InvalidArgumentError, match=r"sets \['model'\] itself"):
        PmsnapCheckpoint(pool_path, model=torch.nn.Linear(1, 1))
    model = TwoOptimizers()
    with pytest.raises(pmsnap.InvalidArgumentError, match="2 optimizers"):
        trainer_with(PmsnapCheckpoint(pool_path), 2).fit(model, ShuffledBatches(seed=1))
    assert not os.path.exists(pool_path)


def test_another_pool_as_ckpt_path_is_refused_instead_of_losing_its_optimizer_state(pool_path,
                                                                                   tmp_path):
    other = str(tmp_path / "other.pool")
    trainer_with(PmsnapCheckpoint(other), 2).fit(Regressor(), ShuffledBatches(seed=1))
    with pytest.raises(pmsnap.InvalidArgumentError,
                       match=f"ckpt_path {other} is a pmsnap pool, but this PmsnapCheckpoint "
                             f"writes {pool_path}.*init_from"):
        trainer_with(PmsnapCheckpoint(pool_path), 4).fit(Regressor(), ShuffledBatches(seed=1),
                                                         ckpt_path=other)
    assert not os.path.exists(pool_path)
