"""One step, one checkpoint: no committed epoch mixes two iterations.

A 2-rank FSDP2 job whose every checkpointed tensor changes distinctly at
every step (weights, Adam's moments and `step`, a buffer counting forward
passes; one_step_trainer.py) is SIGKILLed at random moments and relaunched.
After every attempt, each rank's pool is read without a model: every tensor
of every committed epoch must equal, bit for bit, that tensor as the plain
run left it after the epoch's own iteration; a later `step` with earlier
weights (a torn snapshot) fails here. Both the every-step mode and the
continuous one (copies run while the next steps train)."""

import os

import pytest
import torch

import conftest

STEPS = 24
WORLD = 2


def torchrun(out, extra, expect_kill=False):
    return conftest.torchrun("one_step_trainer.py", out, STEPS, extra, expect_kill, world=WORLD)


@pytest.mark.parametrize("mode", ["every", "continuous"])
def test_no_committed_epoch_mixes_two_iterations_under_fsdp2(tmp_path, pool_path, mode, rng):
    recorded = tmp_path / "recorded"
    torchrun(recorded, ["--pool", "unused", "--record"])
    histories = [torch.load(recorded / f"history{r}.pt") for r in range(WORLD)]
    assert any(role == "step" for unit, role in histories[0][1])
    # Every tensor tells every step apart: an epoch mixing two steps fails.
    for history in histories:
        for k in range(1, STEPS):
            for key, value in history[k].items():
                assert not torch.equal(value, history[k + 1][key]), (k, key)
    template = pool_path.replace(".pool", ".{rank}.pool")
    plan = conftest.random_kills(rng, WORLD, STEPS, 3)
    checked = []
    try:
        for kill in plan + [None]:
            extra = ["--pool", template, "--mode", mode]
            torchrun(tmp_path / "run", extra + (["--kills", kill] if kill else []),
                     expect_kill=kill is not None)
            for r in range(WORLD):
                path = template.replace("{rank}", str(r))
                if os.path.exists(path):
                    checked += conftest.check_epochs_against_history(path, histories[r])
    finally:
        conftest.remove_rank_pools(template, WORLD)
    # Continuous mode with several ranks captures at most every second step
    # (README, "Multi-GPU"): its last epoch may be the step before the last.
    last = STEPS if mode == "every" else STEPS - 2
    assert max(checked) >= last, f"the last run's final epoch was not checked: {checked}"
    assert len(set(checked)) >= 3, checked
