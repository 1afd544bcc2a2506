"""Train, SIGKILL at a random step, restore, continue == an uninterrupted run.

crash_trainer.py checkpoints every iteration; the test kills it with SIGKILL
at random steps (several times per run), checks the killed pool with
`python -m pmsnap verify`, restarts it until it finishes, and compares the
final parameters, optimizer state (each tensor on the device it lives on)
and RNG state bit for bit with a run of the bare optimizer that was never
interrupted. Every optimizer of crash_trainer.OPTIMIZERS, as torch builds it.

$PMSNAP_TEST_DEVICE=cuda (scripts/gpu_check.sh) trains on the GPU, where
torch keeps Adam's `step` on the CPU beside GPU tensors, and adds each
conflict strategy, continuous checkpoints and updates inside backward.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import assert_equal_nested
from crash_trainer import CUDA_ONLY, OPTIMIZERS

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = os.path.join(HERE, "crash_trainer.py")
STEPS = 60
DEVICE = os.environ.get("PMSNAP_TEST_DEVICE", "cpu")
ON_CUDA = DEVICE.startswith("cuda")

# (optimizer, every (0: continuous), strategy, update in backward, kills)
CASES = [(name, 1, "adaptive", False, 4 if name in ("adam", "sgd") else 2)
         for name in OPTIMIZERS if ON_CUDA or name not in CUDA_ONLY]
if ON_CUDA:
    CASES += [("adamw", 1, strategy, False, 2) for strategy in ("1", "2", "3", "4")]
    CASES += [("adamw", 0, "adaptive", False, 2), ("adam", 1, "adaptive", True, 2),
              ("adamw-capturable", 0, "1", True, 2)]


# $PMSNAP_TEST_SHARD="i/n": only every n-th case from the i-th (gpu_check.sh
# runs the shards at once).
_shard, _shards = (int(v) for v in os.environ.get("PMSNAP_TEST_SHARD", "0/1").split("/"))
CASES = CASES[_shard::_shards]


def trainer(*args):
    return [sys.executable, TRAINER, "--steps", str(STEPS), "--device", DEVICE, *args]


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


@pytest.mark.parametrize("optimizer,every,strategy,in_backward,kills", CASES,
                         ids=[f"{c[0]}-{'every1' if c[1] else 'continuous'}-s{c[2]}"
                              f"{'-in-backward' if c[3] else ''}" for c in CASES])
def test_killed_and_resumed_run_equals_uninterrupted(optimizer, every, strategy, in_backward,
                                                     kills, pool_path, tmp_path, rng):
    reference = tmp_path / "reference.pt"
    run_to_end(["--plain", "--optimizer", optimizer, "--out", str(reference)])

    resumed = tmp_path / "resumed.pt"
    args = ["--pool", pool_path, "--optimizer", optimizer, "--out", str(resumed), "--every",
            str(every), "--strategy", strategy] + (["--update-in-backward"] if in_backward else [])
    # `kills` kills (or $PMSNAP_CRASH_TRIALS, up to one per step) at
    # increasing random steps, each 0..2 step times after the step ended:
    # inside the next step's update, its checkpoint, or between. The killed
    # pool must verify as it is.
    kills = min(int(os.environ.get("PMSNAP_CRASH_TRIALS") or kills), STEPS - 17)
    kill_points = sorted(rng.sample(range(2, STEPS - 15), kills))
    last_reported = None
    for kill_at in kill_points:
        last_reported = run_and_kill(args, kill_at, rng.uniform(0.0, 2.0)) or last_reported
        verify = subprocess.run([sys.executable, "-m", "pmsnap", "verify", pool_path],
                                capture_output=True, text=True)
        assert verify.returncode == 0, (kill_at, verify.stdout, verify.stderr)
    out = run_to_end(args)
    assert out.startswith("resumed "), out[:200]
    resumed_from = int(out.split()[1])
    # every=1: step k begins only after the checkpoint of step k-1 committed.
    lowest = last_reported - 1 if every == 1 else 1
    assert lowest <= resumed_from <= STEPS, (kill_points, last_reported, resumed_from)

    ref = torch.load(reference)
    got = torch.load(resumed)
    for i, (a, b) in enumerate(zip(ref["params"], got["params"])):
        assert torch.equal(a, b), f"parameter {i} differs (kills at {kill_points})"
    assert_equal_nested(ref["buffers"], got["buffers"], "buffers")
    assert_equal_nested(ref["optimizer"], got["optimizer"], "optimizer")
    assert torch.equal(ref["rng"], got["rng"]), "torch RNG state differs"
