"""Shared fixtures of the pmsnap Python tests (pytest).

Pools live in $PMSNAP_POOL_DIR (default /dev/shm) under unique names and are
removed after each test. torch runs on one thread so the suite stays fast and
deterministic on a shared 2-core machine. The tests import `pmsnap` from
PYTHONPATH (the build tree's python/ folder; ctest sets it).

Thread-safety: pytest runs the tests of one process sequentially.
"""

import glob
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

torch.set_num_threads(1)


DEFAULT_TEST_SEED = 20261127  # testutil/test_seed.h's kDefaultTestSeed


def seed_for(salt=0):
    """The seed of a randomized test: $PMSNAP_TEST_SEED (else a fixed
    default, the same as the C++ tests'), mixed with `salt` so that each
    test draws its own numbers. scripts/flake_hunt.sh runs the randomized
    tests with fresh seeds; a failure reproduces with the seed it printed."""
    text = os.environ.get("PMSNAP_TEST_SEED") or str(DEFAULT_TEST_SEED)
    if not text.isdigit():
        raise ValueError(f"PMSNAP_TEST_SEED={text!r} is not a decimal number")
    return (int(text) * 0x9E3779B97F4A7C15 + salt) % 2 ** 64


@pytest.fixture
def rng(request):
    """A random.Random seeded from seed_for() and the test's name; the
    seed is printed (pytest shows it with a failure)."""
    salt = zlib.crc32(request.node.nodeid.encode())
    print(f"PMSNAP_TEST_SEED={os.environ.get('PMSNAP_TEST_SEED') or DEFAULT_TEST_SEED} "
          f"({request.node.nodeid})")
    return random.Random(seed_for(salt))


# Test files whose tests fork gloo ranks (run_ranks with "fork"): a process
# that opened a pmsnap engine refuses engines in children forked after that,
# so pytest runs these files first whatever their names
# (pytest_collection_modifyitems).
FORKING_FILES = ("test_distributed.py",)


def pytest_collection_modifyitems(session, config, items):
    """Runs FORKING_FILES' tests before any other (a stable sort)."""
    del session, config
    items.sort(key=lambda item: item.path.name not in FORKING_FILES)


def pool_dir():
    return os.environ.get("PMSNAP_POOL_DIR", "/dev/shm")


@pytest.fixture
def pool_path():
    """A unique pool path; the file is removed afterwards."""
    path = os.path.join(pool_dir(), f"pmsnap-pytest-{os.getpid()}-{uuid.uuid4().hex[:12]}.pool")
    yield path
    # A process killed while creating the pool leaves "<path>.creating-<pid>".
    for leftover in [path] + glob.glob(glob.escape(path) + ".creating-*"):
        if os.path.exists(leftover):
            os.remove(leftover)


def _rank_main(rank, world, init_file, body, results):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        try:
            results[rank] = ("ok", body(rank, world))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results[rank] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


def run_ranks(world, body, start_method="fork"):
    """Runs body(rank, world) in `world` gloo processes; returns their results
    (asserting every rank returned).

    "fork" takes any body (lambdas too) but must run before the calling
    process opens any pmsnap engine: pmsnap refuses engines in a child forked
    after that (oneTBB's workers are not copied; README, "Python"). ctest runs
    the files that fork in processes of their own, or they are listed in
    FORKING_FILES, which pytest runs first. "spawn" starts fresh interpreters, so it works at any
    time, for bodies that pickle (module-level functions, functools.partial)."""
    with tempfile.TemporaryDirectory() as d, mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank_main, args=(world, os.path.join(d, "init"), body, results),
                           nprocs=world, join=True, start_method=start_method)
        out = [results[r] for r in range(world)]
    for status, value in out:
        assert status == "ok", value
    return [value for _, value in out]


def random_kills(rng, world, steps, kills, distinct=True):
    """A trainer's --kills plan, one per restart attempt: a rank 0..world-1
    SIGKILLs itself 0..2 of its step times after a step (inside the next
    update, its commit, or between steps), at increasing steps in
    2..steps-5 (`distinct`: no step twice) so that every attempt makes
    progress."""
    pick = rng.sample if distinct else rng.choices
    return [f"{rng.randrange(world)}:{step}:{rng.uniform(0, 2):.2f}"
            for step in sorted(pick(range(2, steps - 4), k=kills))]


def remove_rank_pools(template, world):
    """Removes the pools of `template` ("{rank}") for ranks 0..world-1."""
    for r in range(world):
        path = template.replace("{rank}", str(r))
        if os.path.exists(path):
            os.remove(path)


def torchrun(trainer, out, steps, extra, expect_kill=False, world=2):
    """Runs tests/python/<trainer> under torchrun (`world` gloo ranks on this
    machine, one torch thread each) with --out OUT --steps STEPS + extra;
    returns its stdout. Fails on a non-zero exit, except, with expect_kill,
    the planned SIGKILL of a rank."""
    here = os.path.dirname(os.path.abspath(__file__))
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", os.path.join(here, trainer), "--out", str(out),
           "--steps", str(steps)] + extra
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, OMP_NUM_THREADS="1",
                                     PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", "")))
    if not expect_kill:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    elif result.returncode != 0:
        # Only the planned SIGKILL may end an attempt early.
        assert "Signal 9 (SIGKILL)" in result.stderr or "exitcode  : -9" in result.stderr, \
            result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout


class MLP(torch.nn.Module):
    """A small MLP; `widths` changes the layer shapes (model-mismatch tests)."""

    def __init__(self, widths=(12, 32, 16, 4), dropout=0.0):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = self.dropout(torch.relu(x))
        return x


def run_to_kill(args, kill_at=0, env=None, timeout=300):
    """Runs a trainer script (`args` after the interpreter) that prints
    "start N" (the first step it takes) and "step k" after each step, and
    waits at step KILL_AT once it committed; with kill_at, SIGKILLs it
    when it printed that step. Returns (N, exit code); without kill_at the
    run must succeed (the assertion shows its stderr)."""
    child = subprocess.Popen([sys.executable] + list(args), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, **(env or {})))
    start = None
    for line in child.stdout:
        if line.startswith("start "):
            start = int(line.split()[1])
        if kill_at and line.strip() == f"step {kill_at}":
            child.kill()
            break
    child.wait(timeout=timeout)
    stderr = child.stderr.read()
    if not kill_at:
        assert child.returncode == 0, stderr
    return start, child.returncode


def make_model(seed=0, **kwargs):
    torch.manual_seed(seed)
    return MLP(**kwargs)


def train_step(model, optimizer, step, batch=8):
    """One deterministic step: the batch depends only on `step`."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch, model.layers[0].in_features, generator=g)
    y = torch.randn(batch, model.layers[-1].out_features, generator=g)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def device_slower_than_the_steps(steps=20, **model_kwargs):
    """A simulated device spec whose link takes about `steps` of this
    machine's steps (measured here, plain) for one checkpoint of
    make_model(**model_kwargs) with Adam, so that the next steps find it in
    flight at any speed of the machine."""
    model = make_model(**model_kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, opt, 0)
    began = time.perf_counter()
    for step in range(1, 6):
        train_step(model, opt, step)
    step_seconds = (time.perf_counter() - began) / 5
    checkpoint_bytes = 3 * 4 * sum(p.numel() for p in model.parameters())
    return f"simulated:{checkpoint_bytes / (steps * step_seconds) / 1e9:.9f}:64"


def assert_equal_nested(a, b, where="state"):
    """Nested states (dicts, lists, tensors) are equal, tensors bitwise and
    on the same device; a failure names the path to what differs."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert a.device == b.device, f"{where}: on {b.device}, was on {a.device}"
        assert torch.equal(a, b), where
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


def assert_same_training_state(model_a, opt_a, model_b, opt_b):
    """Parameters and optimizer state are bitwise equal (tensors) or equal (others)."""
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), f"parameter {name} differs"
        sa, sb = opt_a.state.get(a, {}), opt_b.state.get(b, {})
        assert sorted(sa) == sorted(sb), f"state keys of {name}: {sorted(sa)} vs {sorted(sb)}"
        for key in sa:
            va, vb = sa[key], sb[key]
            if isinstance(va, torch.Tensor):
                assert isinstance(vb, torch.Tensor), f"{name} state {key}"
                assert va.dtype == vb.dtype and va.shape == vb.shape, f"{name} state {key}"
                assert torch.equal(va, vb), f"{name} state {key} differs"
            else:
                assert va == vb, f"{name} state {key}: {va!r} vs {vb!r}"
    for ga, gb in zip(opt_a.param_groups, opt_b.param_groups):
        assert {k: v for k, v in ga.items() if k != "params"} == \
            {k: v for k, v in gb.items() if k != "params"}


def check_epochs_against_history(path, history):
    """Every committed epoch of pool `path`: each of its tensors must equal,
    bit for bit, history[iteration][(unit, role)], the tensor as a plain run
    left it after the epoch's own iteration (test_one_step.py); returns the
    iterations checked."""
    import pmsnap  # here: the fixtures above work without the extension
    reader = pmsnap._pmsnap.CheckpointReader(path)
    try:
        units = [(name, [role for role, *_ in tensors])
                 for name, _, tensors in reader.describe()["units"]]
        checked = []
        for epoch in reader.epochs():
            iteration = epoch["iteration"]
            expected = history[iteration]
            seen = set()
            for unit_index, (unit, roles) in enumerate(units):
                for index, role in enumerate(roles):
                    want = expected[(unit, role)]
                    got = torch.empty_like(want)
                    reader.read_tensor(epoch["epoch"], unit_index, index, got.data_ptr())
                    assert torch.equal(got, want), \
                        (f"{path}: epoch {epoch['epoch']} of iteration {iteration}: {unit}.{role} "
                         f"is not the tensor of that iteration")
                    seen.add((unit, role))
            assert seen == set(expected), f"{path}: the pool lacks {set(expected) - seen}"
            checked.append(iteration)
        return checked
    finally:
        reader.close()
