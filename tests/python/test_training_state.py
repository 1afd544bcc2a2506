"""pmsnap.TrainingState ([integrations] item 3): a torchtitan-style loop's
whole state (model with buffers, AdamW, an LR scheduler, a stateful data
stream, the RNG) checkpointed with every step and resumed in one call,
bit-exact after a SIGKILL against the uninterrupted run without pmsnap;
with SequentialLR (warm-up then cosine) and ReduceLROnPlateau (metric-driven).
Wrong pools and wrong objects are refused by name.

Thread-safety: the training runs in child processes (loop_trainer.py).
"""

import os

import pytest
import torch

import pmsnap
from conftest import assert_equal_nested, run_to_kill

TRAINER = os.path.join(os.path.dirname(__file__), "loop_trainer.py")
STEPS = 14


def run(mode, pool, out, kill_at=0, scheduler="sequential"):
    """Runs the trainer; with kill_at, SIGKILLs it once it reported that
    step (committed). Returns (first step it took, exit code)."""
    args = [TRAINER, mode, pool, str(STEPS), out] + ([str(kill_at)] if kill_at else [])
    return run_to_kill(args, kill_at, env={"LOOP_SCHEDULER": scheduler})


@pytest.mark.parametrize("scheduler", ["sequential", "plateau"])
def test_a_loop_killed_twice_resumes_bit_exact_scheduler_data_and_rng_included(
        pool_path, tmp_path, rng, scheduler):
    reference = str(tmp_path / "plain.pt")
    run("plain", pool_path, reference, scheduler=scheduler)
    first, second = sorted(rng.sample(range(2, STEPS - 1), 2))
    print(f"kills after steps {first} and {second}")
    resumed = str(tmp_path / "resumed.pt")
    assert run("pmsnap", pool_path, resumed, kill_at=first, scheduler=scheduler) == (1, -9)
    assert run("pmsnap", pool_path, resumed, kill_at=second, scheduler=scheduler)[0] == first + 1
    assert run("pmsnap", pool_path, resumed, scheduler=scheduler)[0] == second + 1
    assert_equal_nested(torch.load(reference, weights_only=False),
                        torch.load(resumed, weights_only=False))


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def small():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer


def train(state, steps):
    for _ in range(steps):
        state.model(torch.ones(1, 3)).sum().backward()
        state.step()
        state.zero_grad()


def test_a_fresh_pool_starts_at_step_one_and_user_extra_state_round_trips(pool_path):
    model, optimizer = small()
    counter = Counter()
    with pmsnap.TrainingState(pool_path, model, optimizer, stateful={"counter": counter}) as state:
        assert state.resume() == 1
        counter.n = 5
        train(state, 2)
        model(torch.ones(1, 3)).sum().backward()
        state.step(extra_state={"epoch": 2})
    model, optimizer = small()
    counter = Counter()
    with pmsnap.TrainingState(pool_path, model, optimizer, stateful={"counter": counter}) as state:
        assert state.resume() == 4
        assert counter.n == 5 and state.iteration == 3
        assert state.extra_state == {"epoch": 2}


def test_wrong_objects_and_wrong_pools_are_refused_by_name(pool_path):
    model, optimizer = small()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(other, step_size=1)
    with pytest.raises(pmsnap.InvalidArgumentError, match="does not schedule"):
        pmsnap.TrainingState(pool_path, model, optimizer, lr_scheduler=scheduler)
    with pytest.raises(pmsnap.InvalidArgumentError, match=r"stateful\['loader'\]"):
        pmsnap.TrainingState(pool_path, model, optimizer, stateful={"loader": object()})

    with pmsnap.TrainingState(pool_path, model, optimizer, stateful={"a": Counter()}) as state:
        train(state, 2)
    model, optimizer = small()
    state = pmsnap.TrainingState(pool_path, model, optimizer, stateful={"b": Counter()})
    with pytest.raises(pmsnap.ModelMismatchError, match=r"no state for stateful \['b'\]"):
        state.resume()
    state.close()
    model, optimizer = small()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    state = pmsnap.TrainingState(pool_path, model, optimizer, lr_scheduler=scheduler,
                                 stateful={"a": Counter()})
    with pytest.raises(pmsnap.ModelMismatchError, match="without an LR scheduler"):
        state.resume()
    state.close()


def test_a_pool_of_a_bare_checkpointed_optimizer_is_refused(pool_path):
    model, optimizer = small()
    with pmsnap.CheckpointedOptimizer(optimizer, pool_path, model=model) as opt:
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    model, optimizer = small()
    state = pmsnap.TrainingState(pool_path, model, optimizer)
    with pytest.raises(pmsnap.FailedPreconditionError, match="not written by a TrainingState"):
        state.resume()
    state.close()
