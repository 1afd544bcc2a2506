"""Train, SIGKILL at a random step, restore, continue == an uninterrupted run.

crash_trainer.py checkpoints every iteration; the test kills it with SIGKILL
at random steps (several times per run), restarts it until it finishes, and
compares the final parameters, optimizer state and RNG state bit for bit with
a run of the bare optimizer that was never interrupted.
"""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = os.path.join(HERE, "crash_trainer.py")
STEPS = 60


def trainer(*args):
    return [sys.executable, TRAINER, "--steps", str(STEPS), *args]


def run_to_end(args):
    done = subprocess.run(trainer(*args), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def run_and_kill(args, kill_after_step, steps_later):
    """Starts the trainer and SIGKILLs it `steps_later` (0..2) of its own step
    times after it finished step `kill_after_step` (or at once when it is
    already past the last step). Returns the last step it reported."""
    child = subprocess.Popen(trainer(*args, "--linger"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    last = None
    try:
        for line in child.stdout:
            if line.strip() == "done":
                break
            if not line.startswith("step "):
                continue
            _, step, seconds, ended = line.split()
            last = int(step)
            if last >= kill_after_step:
                time.sleep(max(0.0, float(ended) + steps_later * float(seconds) - time.monotonic()))
                break
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        stderr = child.stderr.read()
        child.stderr.close()
    if child.returncode != -signal.SIGKILL:
        pytest.fail(f"trainer ended with {child.returncode} before the kill: {stderr}")
    return last


def assert_equal_nested(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            assert_equal_nested(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_nested(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_killed_and_resumed_run_equals_uninterrupted(optimizer, pool_path, tmp_path):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    reference = tmp_path / "reference.pt"
    run_to_end(["--plain", "--optimizer", optimizer, "--out", str(reference)])

    resumed = tmp_path / "resumed.pt"
    args = ["--pool", pool_path, "--optimizer", optimizer, "--out", str(resumed)]
    # Four kills (or $PMSNAP_CRASH_TRIALS, up to one per step) at increasing
    # random steps, each 0..2 step times after the step ended: inside the next
    # step's update, its checkpoint, or between.
    kills = min(int(os.environ.get("PMSNAP_CRASH_TRIALS") or 4), STEPS - 17)
    kill_points = sorted(rng.sample(range(2, STEPS - 15), kills))
    last_reported = None
    for kill_at in kill_points:
        last_reported = run_and_kill(args, kill_at, rng.uniform(0.0, 2.0)) or last_reported
    out = run_to_end(args)
    assert out.startswith("resumed "), out[:200]
    resumed_from = int(out.split()[1])
    # every=1: step k begins only after the checkpoint of step k-1 committed.
    assert last_reported - 1 <= resumed_from <= STEPS, (kill_points, last_reported,
                                                        resumed_from)

    ref = torch.load(reference)
    got = torch.load(resumed)
    for i, (a, b) in enumerate(zip(ref["params"], got["params"])):
        assert torch.equal(a, b), f"parameter {i} differs (kills at {kill_points})"
    assert_equal_nested(ref["optimizer"], got["optimizer"], "optimizer")
    assert torch.equal(ref["rng"], got["rng"]), "torch RNG state differs"
