"""pmsnap.hf ([integrations] item 2): one TrainerCallback checkpoints every
optimizer step of a Hugging Face Trainer (a tiny GPT-2 built from a config);
train(resume_from_checkpoint=resume_dir(pool)) resumes bit-exact after a
SIGKILL (weights, AdamW, the warm-up + cosine schedule, the data order
across epochs, dropout's RNG) against an uninterrupted Trainer run without
pmsnap. Misuse is refused by name.

Thread-safety: the killed runs are child processes (hf_trainer.py).
"""

import os

import pytest
import torch
from transformers import Trainer

import pmsnap
from conftest import assert_equal_nested, run_to_kill
from hf_trainer import BATCH, SEQUENCES, Tokens, tiny_gpt2, training_args
from pmsnap.hf import PmsnapCallback, resume_dir

TRAINER = os.path.join(os.path.dirname(__file__), "hf_trainer.py")
STEPS_PER_EPOCH = SEQUENCES // BATCH
STEPS = 2 * STEPS_PER_EPOCH + 2


def run(mode, pool, out, kill_at=0):
    args = [TRAINER, mode, pool, str(STEPS), out] + ([str(kill_at)] if kill_at else [])
    return run_to_kill(args, kill_at)


@pytest.mark.parametrize("kills", ["epoch-ends", "random"])
def test_a_trainer_killed_twice_resumes_bit_exact_from_its_pool(pool_path, tmp_path, rng, kills):
    reference = str(tmp_path / "plain.pt")
    run("plain", pool_path, reference)
    if kills == "epoch-ends":  # the last step of an epoch: the resume starts a new one
        first, second = STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH
    else:
        first, second = sorted(rng.sample(range(1, STEPS), 2))
    print(f"kills after steps {first} and {second}")
    resumed = str(tmp_path / "resumed.pt")
    try:
        assert run("pmsnap", pool_path, resumed, kill_at=first) == (1, -9)
        assert run("pmsnap", pool_path, resumed, kill_at=second) == (first + 1, -9)
        assert run("pmsnap", pool_path, resumed)[0] == second + 1
    finally:
        remove_resume_dir(pool_path)
    got = torch.load(resumed, weights_only=False)
    assert got["global_step"] == STEPS
    assert_equal_nested(torch.load(reference, weights_only=False), got)


def remove_resume_dir(pool_path):
    folder = pool_path + ".resume"
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)


def train(pool_path, output_dir, steps, resume=None):
    trainer = Trainer(model=tiny_gpt2(), args=training_args(str(output_dir), steps),
                      train_dataset=Tokens(), callbacks=[PmsnapCallback(pool_path)])
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_a_pool_is_never_overwritten_by_a_fresh_or_an_older_start(pool_path, tmp_path):
    trainer = train(pool_path, tmp_path, 2)
    old = resume_dir(pool_path, str(tmp_path / "at2"))
    try:
        # The same Trainer again: its optimizer is wrapped once, not twice.
        trainer.args.max_steps = 3
        trainer.train(resume_from_checkpoint=resume_dir(pool_path))
        assert pmsnap.read_pool(pool_path)["latest"]["iteration"] == 3
        train(pool_path, tmp_path, 4, resume=resume_dir(pool_path))
        assert pmsnap.read_pool(pool_path)["latest"]["iteration"] == 4
        with pytest.raises(pmsnap.FailedPreconditionError,
                           match=f"pool {pool_path} holds step 4 but the Trainer starts after "
                                 "step 0.*resume_dir"):
            train(pool_path, tmp_path, 6)
        with pytest.raises(pmsnap.FailedPreconditionError, match="holds step 4 .* after step 2"):
            train(pool_path, tmp_path, 6, resume=old)
        assert pmsnap.read_pool(pool_path)["latest"]["iteration"] == 4
    finally:
        remove_resume_dir(pool_path)


def test_resume_dir_refuses_foreign_pools_and_folders(pool_path, tmp_path):
    model = torch.nn.Linear(3, 2)
    with pmsnap.CheckpointedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pool_path,
                                      model=model) as optimizer:
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    with pytest.raises(pmsnap.FailedPreconditionError, match="not written by pmsnap.hf"):
        resume_dir(pool_path, str(tmp_path / "resume"))
    os.remove(pool_path)
    train(pool_path, tmp_path / "out", 1)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(pmsnap.FailedPreconditionError, match=r"foreign holds files .*notes\.txt"):
        resume_dir(pool_path, str(foreign))
    assert (foreign / "notes.txt").read_text() == "mine"
    with pytest.raises(pmsnap.InvalidArgumentError, match=r"sets \['model'\] itself"):
        PmsnapCallback(pool_path, model=model)
