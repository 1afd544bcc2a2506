"""Context manager, flush/close, stats, modes and restore flows of CheckpointedOptimizer."""

import gc
import os
import random
import signal
import weakref

import numpy
import pytest
import torch

import pmsnap
from conftest import (assert_same_training_state, device_slower_than_the_steps, make_model,
                      train_step)


def test_context_manager_commits_the_last_step(pool_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1) as copt:
        for step in range(7):
            train_step(model, copt, step)
    assert pmsnap.read_pool(pool_path)["latest"]["iteration"] == 7
    s = copt.stats()
    assert s["open"] is False and s["iteration"] == 7 and s["steps"] == 7
    assert s["epochs_committed"] == 7
    assert s["policy"] == "every-1" and s["device"] == "host"
    assert len(s["units"]) == 6 and s["units"][0]["name"] == "layers.0.weight"
    assert "pmsnap:" in s["summary"]


def test_tensors_in_the_extra_state_restore_with_their_dtype_shape_and_bits(pool_path):
    # Plain CPU tensors are pickled as their bytes (torch's own pickling
    # costs ~0.1 ms a tensor every step); what restore() returns is the same.
    weird = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()  # not contiguous
    user = {"data_rng": torch.Generator().manual_seed(7).get_state(),
            "bf16": torch.tensor([1.5, -2.25, 3e38], dtype=torch.bfloat16),
            "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4, dtype=torch.int32),
            "mask": torch.tensor([[True, False], [False, True]]), "transposed": weird,
            "ids": torch.arange(-3, 3, dtype=torch.int64),
            "trained": torch.ones(2, requires_grad=True)}  # pickled by torch, as before
    blob = pmsnap.extra_state.pack(user, pmsnap.extra_state.capture_rng(), [], {})
    assert b"_tensor_from_bytes" in blob
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1) as copt:
        train_step(model, copt, 0)
        copt.zero_grad()
        model(torch.ones(2, model.layers[0].in_features)).sum().backward()
        copt.step(extra_state=user)
        rng_then = torch.get_rng_state()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1) as copt:
        torch.manual_seed(99)
        iteration, extra = copt.restore()
    assert iteration == 2 and torch.equal(torch.get_rng_state(), rng_then)
    assert set(extra) == set(user) | {"rng"}
    for key, tensor in user.items():
        back = extra[key]
        assert type(back) is torch.Tensor, key
        assert (back.dtype, back.shape, back.requires_grad) == (
            tensor.dtype, tensor.shape, tensor.requires_grad), key
        bits = [t.detach().reshape(-1).view(torch.uint8) for t in (back, tensor)]
        assert torch.equal(*bits), key
    extra["data_rng"][0] = 1  # a writable tensor of its own
    assert torch.Generator().set_state(extra["data_rng"]) is not None


def test_rng_states_packed_as_words_unpack_to_the_same_states_and_draws():
    """The Python and numpy generator states are pickled as their 32-bit
    words (faster than 625 ints every step); what unpack() gives back is the
    usual tuples, and the draws after apply_rng() are the captured ones',
    numpy's cached Gaussian included. A state of another shape pickles as it
    is."""
    extra_state = pmsnap.extra_state
    random.seed(3)
    random.random()
    numpy.random.seed(5)
    numpy.random.standard_normal()  # draws two, caches the second: has_gauss 1
    rng = extra_state.capture_rng()
    assert rng["numpy"][3] == 1
    blob = extra_state.pack({}, rng, [], {})
    assert b"_python_rng_state" in blob and b"_numpy_rng_state" in blob
    back = extra_state.unpack(blob)["rng"]
    assert type(back["python"]) is tuple and back["python"] == rng["python"]
    assert type(back["numpy"][1]) is numpy.ndarray and back["numpy"][1].dtype == numpy.uint32
    assert numpy.array_equal(back["numpy"][1], rng["numpy"][1])
    assert back["numpy"][0] == rng["numpy"][0] and back["numpy"][2:] == rng["numpy"][2:]
    expected = (random.random(), numpy.random.standard_normal(), torch.rand(3))
    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)
    extra_state.apply_rng(back)
    drawn = (random.random(), numpy.random.standard_normal(), torch.rand(3))
    assert drawn[:2] == expected[:2] and torch.equal(drawn[2], expected[2])
    odd = {"python": (3, (1 << 40, -1), None), "numpy": ("MT19937", [1, 2], 0, 0, 0.0)}
    assert extra_state.unpack(extra_state.pack({}, odd, [], {}))["rng"] == odd


@pytest.mark.filterwarnings("ignore:get_state and legacy:RuntimeWarning")  # PCG64's get_state
def test_numpy_rng_captures_follow_every_change_of_the_global_generator():
    """A capture reuses the last one while numpy's global generator drew
    nothing; every change shows: draws, a consumed cached Gaussian (no
    draw), a reseed, set_state, another global bit generator."""
    extra_state = pmsnap.extra_state

    def assert_captures_now():
        captured, now = extra_state.capture_rng()["numpy"], numpy.random.get_state()
        if isinstance(now, dict):  # not MT19937: get_state()'s dict
            assert captured == now
            return
        assert captured[0] == now[0] and numpy.array_equal(captured[1], now[1])
        assert captured[2:] == now[2:]

    original = numpy.random.get_bit_generator()
    try:
        numpy.random.seed(11)
        assert_captures_now()
        assert_captures_now()  # nothing drawn
        numpy.random.random(3)
        assert_captures_now()
        numpy.random.standard_normal()  # draws two, caches one
        assert_captures_now()
        numpy.random.standard_normal()  # the cached one: the key is unchanged
        assert_captures_now()
        numpy.random.seed(11)
        assert_captures_now()
        before = numpy.random.get_state()
        numpy.random.random()
        extra_state.apply_rng({"numpy": before})
        assert_captures_now()
        # A restore to the same key with a cached Gaussian: no raw change.
        extra_state.apply_rng({"numpy": before[:3] + (1, 0.5)})
        assert_captures_now()
        numpy.random.set_bit_generator(numpy.random.MT19937(5))
        assert_captures_now()
        numpy.random.random()
        assert_captures_now()
        numpy.random.set_bit_generator(numpy.random.PCG64(5))
        assert_captures_now()
    finally:
        numpy.random.set_bit_generator(original)


def test_python_rng_captures_follow_every_change_of_the_global_generator(monkeypatch):
    """A capture reuses the last one while the random module's generator
    drew nothing; every change shows: draws, a cached Gaussian made and
    consumed (no draw), a reseed, setstate. Where the raw layout does not
    match getstate(), every capture reads getstate()."""
    extra_state = pmsnap.extra_state

    def assert_captures_now():
        captured = extra_state.capture_rng()["python"]
        assert captured == random.getstate()
        back = extra_state.unpack(extra_state.pack({}, {"python": captured}, [], {}))
        assert back["rng"]["python"] == random.getstate()
        return captured

    original = random.getstate()
    try:
        random.seed(11)
        first = assert_captures_now()
        assert assert_captures_now() is first  # nothing drawn: reused
        random.random()
        assert_captures_now()
        random.gauss()  # draws, caches a second Gaussian in gauss_next
        assert_captures_now()
        random.gauss()  # the cached one: the generator's words are unchanged
        assert_captures_now()
        random.seed(11)
        assert_captures_now()
        random.getrandbits(32)
        drawn = random.getstate()
        random.setstate(first)
        assert assert_captures_now() == first
        random.setstate(drawn)
        assert_captures_now()
        monkeypatch.setattr(type(extra_state._python_global), "_raw_address",
                            lambda self, generator: id(generator))  # the header: no match
        extra_state._python_global.forget()
        reread = assert_captures_now()
        assert assert_captures_now() is not reread
    finally:
        random.setstate(original)


def test_extra_state_changed_in_place_is_checkpointed_as_it_was_when_the_step_ended(
        pool_path):
    """A caller's dict changed in place between steps (not replaced) is
    stored with each step as it was when that step ended: the change made
    after the last step, before close() commits it, is not in it."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1) as copt:
        copt.extra_state = {"position": {"batch": 0}}
        for step in range(4):
            train_step(model, copt, step)
            copt.extra_state["position"]["batch"] += 1
    model = make_model()
    iteration, extra = pmsnap.restore(pool_path, model,
                                      torch.optim.SGD(model.parameters(), lr=0.1))
    assert iteration == 4 and extra["position"] == {"batch": 3}


def test_continuous_mode_checkpoints_the_step_after_a_flush(pool_path):
    # A slow simulated device keeps checkpoints in flight across steps, so
    # continuous mode skips some; the step after flush() finds none in flight
    # and is checkpointed. Holds at any speed of this machine.
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, mode="continuous",
                                      device="simulated:0.05:64") as copt:
        for step in range(6):
            train_step(model, copt, step)
        copt.flush()
        train_step(model, copt, 6)
        copt.flush()
        assert copt.stats()["last_committed_iteration"] == 7


def test_continuous_mode_close_checkpoints_a_skipped_last_step_as_it_ended(pool_path):
    # The last step's boundary may find a checkpoint in flight and skip it
    # (the H200 benchmark and TrainingState's tests met that under load):
    # close() then checkpoints it, with the RNG states and hyperparameters
    # as that step ended, not as they are at close. Training stops at the
    # first step that opened no checkpoint (the slow device makes one come
    # soon at any speed of this machine).
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    copt = pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, mode="continuous",
                                        device=device_slower_than_the_steps())
    last = None
    for step in range(200):
        started = copt.stats()["epochs_started"] if step else 0
        train_step(model, copt, step)
        if step and copt.stats()["epochs_started"] == started:
            last = step + 1
            break
    assert last is not None, copt.stats()["summary"]
    want = [p.detach().clone() for p in model.parameters()]
    rng_after_step = torch.get_rng_state()
    torch.rand(100)  # drawn after the last step: not part of its checkpoint
    opt.param_groups[0]["lr"] = 0.5  # a scheduler stepping after it: neither
    copt.close()
    assert copt.stats()["epochs_abandoned"] == 0
    assert pmsnap.read_pool(pool_path)["latest"]["iteration"] == last
    model2 = make_model(seed=1)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.3)
    with pmsnap.CheckpointedOptimizer(opt2, pool=pool_path, model=model2) as restored:
        assert restored.restore()[0] == last
    for a, b in zip(want, model2.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(torch.get_rng_state(), rng_after_step)
    assert opt2.param_groups[0]["lr"] == 0.01


def test_exception_in_block_closes_and_keeps_last_commit(pool_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(KeyError):
        with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1) as copt:
            for step in range(4):
                train_step(model, copt, step)
            raise KeyError("user error")
    assert pmsnap.read_pool(pool_path)["latest"]["iteration"] == 4
    with pytest.raises(pmsnap.FailedPreconditionError):
        copt.step()


def test_stats_while_training_and_per_step(pool_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    copt = pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model,
                                        device="simulated:12:64", strategy="2")
    assert copt.stats()["open"] is False
    for step in range(5):
        train_step(model, copt, step)
    copt.flush()
    s = copt.stats(per_step=True)
    assert s["open"] and s["steps"] == 5 and len(s["blocked_per_step"]) == 5
    assert s["device"].startswith("simulated") and s["strategy"].startswith("wait-snapshot")
    assert s["epochs_committed"] >= 1 and s["bytes_written"] > 0
    copt.close()


@pytest.mark.parametrize("mode,kwargs,expect", [
    ("continuous", {}, "continuous"),
    (None, {"every": 3}, "every-3"),
    ("checkfreq", {}, "checkfreq"),
])
def test_modes(mode, kwargs, expect, pool_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, mode=mode,
                                      **kwargs) as copt:
        for step in range(9):
            train_step(model, copt, step)
    assert copt.stats()["policy"].startswith(expect)
    latest = pmsnap.read_pool(pool_path)["latest"]["iteration"]
    assert 1 <= latest <= 9
    if expect == "every-3":
        assert latest == 9


def test_restore_then_continue_in_the_same_object(pool_path):
    """Resume in place: restore() on the wrapper, then keep stepping."""
    def fresh():
        model = make_model(seed=5)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    ref_model, ref_opt = fresh()
    for step in range(12):
        train_step(ref_model, ref_opt, step)

    model, opt = fresh()
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1) as copt:
        for step in range(7):
            train_step(model, copt, step)
    model, opt = fresh()
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1) as copt:
        iteration, extra = copt.restore()
        assert iteration == 7 and copt.iteration == 7
        for step in range(iteration, 12):
            train_step(model, copt, step)
    assert_same_training_state(ref_model, ref_opt, model, opt)

    # The module-level restore plus start_iteration gives the same.
    model, opt = fresh()
    iteration, _ = pmsnap.restore(pool_path, model, opt)
    assert iteration == 12
    assert_same_training_state(ref_model, ref_opt, model, opt)
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model,
                                      start_iteration=iteration) as copt:
        train_step(model, copt, 12)
    assert copt.stats()["iteration"] == 13


def test_lr_scheduler_state_travels_with_the_checkpoint(pool_path):
    """param_groups hyperparameters (lr after a scheduler) are restored."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1) as copt:
        for step in range(5):
            train_step(model, copt, step)
            sched.step()
            copt.extra_state = {"scheduler": sched.state_dict()}
    # extra_state is stored at the step, so the scheduler state of step 4 is
    # stored with step 5 (checkpoints capture what step() saw).
    model2 = make_model(seed=9)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    iteration, extra = pmsnap.restore(pool_path, model2, opt2)
    assert iteration == 5
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)
    assert extra["scheduler"]["last_epoch"] == 4


def test_finish_step_later_checkpoints_the_state_after_the_scheduler_step(pool_path):
    """finish_step_later=True: each checkpoint holds the lr and extra state
    of finish_step(), after the scheduler stepped; the next step(), flush()
    and close() end a step left open."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1,
                                      finish_step_later=True) as copt:
        for step in range(3):
            train_step(model, copt, step)
            assert copt.step_open
            sched.step()
            copt.finish_step(extra_state={"scheduler": sched.state_dict()})
            assert not copt.step_open
    model2 = make_model(seed=9)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    with pmsnap.CheckpointedOptimizer(opt2, pool=pool_path, model=model2, every=1,
                                      finish_step_later=True) as copt2:
        iteration, extra = copt2.restore()
        assert iteration == 3 and extra["scheduler"]["last_epoch"] == 3
        assert opt2.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5)
        assert_same_training_state(model, opt, model2, opt2)
        train_step(model2, copt2, 3)  # left open: the next step() ends it
        train_step(model2, copt2, 4)
        assert copt2.step_open
        copt2.flush()
        assert not copt2.step_open
        train_step(model2, copt2, 5)  # left open: close() ends and commits it
    assert pmsnap.read_pool(pool_path)["latest"]["iteration"] == 6
    model3 = make_model(seed=5)
    opt3 = torch.optim.SGD(model3.parameters(), lr=0.1)
    assert pmsnap.restore(pool_path, model3, opt3)[0] == 6
    assert_same_training_state(model2, opt2, model3, opt3)


@pytest.mark.skipif(pmsnap.cuda_support_compiled() and torch.cuda.is_available(),
                    reason="a usable GPU: no fallback to test")
def test_cuda_spec_falls_back_to_host_with_a_note(pool_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, device="cuda") as copt:
        assert "using the host device" in copt.device_note
        train_step(model, copt, 0)
    stats = copt.stats()
    assert stats["device"] == "host"
    # The host device has no queues: nothing ordered by events, nothing staged.
    assert stats["compute_waits_on_copies"] == 0
    assert stats["staging_peak_bytes"] == 0


def test_worker_cpus_reach_the_engine_and_a_missing_cpu_is_refused(pool_path):
    # The machine's own CPU works (and the run checkpoints); a CPU number the
    # machine cannot have is refused at open, naming it.
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    cpu = sorted(os.sched_getaffinity(0))[-1]
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1,
                                      worker_cpus=[cpu]) as copt:
        for step in range(3):
            train_step(model, copt, step)
    assert copt.stats()["epochs_committed"] == 3
    opt = torch.optim.Adam(model.parameters())
    copt = pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1,
                                        worker_cpus=[100000])
    with pytest.raises(pmsnap.InvalidArgumentError, match="100000"):
        copt.restore()


def test_default_workers_grow_with_the_cpus_on_a_gpu_and_stay_two_on_the_host(pool_path,
                                                                                 monkeypatch):
    from pmsnap.optimizer import default_workers
    # On the H200 host (16 CPUs) GPT-2 small every step: 2 workers 130 ms a
    # step, 8 workers 50 (bench/RESULTS.md).
    assert default_workers("cuda", 16) == 8
    assert default_workers("cuda:1", 64) == 8
    assert default_workers("cuda", 6) == 3
    assert default_workers("host", 16) == 2
    assert default_workers("simulated:10:1024", 16) == 2
    # Never more than oneTBB lends (cpu_count - 1), never none.
    for device in ("cuda", "host"):
        assert default_workers(device, 2) == 1
        assert default_workers(device, 1) == 1
        assert default_workers(device, None) == 1
    # The optimizer asks it with its device and this machine's CPU count.
    asked = []
    monkeypatch.setattr(pmsnap.optimizer, "default_workers",
                        lambda device, cpus: asked.append((device, cpus)) or 1)
    model = make_model()
    pmsnap.CheckpointedOptimizer(torch.optim.Adam(model.parameters()), pool=pool_path,
                                 model=model, device="host").close()
    assert asked == [("host", os.cpu_count())]


def test_simulated_pm_is_labelled_in_the_stats(pool_path, monkeypatch):
    # PMSNAP_PM_WRITE_GBPS / _READ_GBPS throttle the pool (PmBandwidth) and
    # every stats output says the PM is simulated.
    monkeypatch.setenv("PMSNAP_PM_WRITE_GBPS", "50")
    monkeypatch.setenv("PMSNAP_PM_READ_GBPS", "60")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1) as copt:
        for step in range(2):
            train_step(model, copt, step)
    s = copt.stats()
    assert s["pm"] == "simulated PM (50 GB/s write, 60 GB/s read)"
    assert "simulated PM" in s["summary"]


def test_a_forked_child_gets_an_error_instead_of_a_hang(pool_path):
    """fork() after an engine opened: oneTBB's worker threads are not in the
    child, where an engine would wait for them forever. The child's engines
    are refused with an error naming the pool and the parent; the parent
    goes on checkpointing."""
    model = make_model(seed=3)
    opt = pmsnap.CheckpointedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pool=pool_path,
                                       model=model, every=1)
    train_step(model, opt, 1)
    child_pool = pool_path.replace(".pool", "-child.pool")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        signal.alarm(60)  # a hang becomes SIGALRM: a failure, not a stuck suite
        try:
            other = make_model(seed=4)
            child_opt = pmsnap.CheckpointedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                                     pool=child_pool, model=other, every=1)
            train_step(other, child_opt, 1)  # the first step opens the pool
            message = "opened"
        except pmsnap.FailedPreconditionError as e:
            message = str(e)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            message = f"{type(e).__name__}: {e}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        message = f.read().decode()
    assert os.WIFEXITED(status), f"child ended with status {status} (14: it hung)"
    assert child_pool in message and f"forked from process {os.getpid()}" in message, message
    assert "spawn" in message, message
    train_step(model, opt, 2)
    opt.close()
    assert pmsnap.read_pool(pool_path)["latest"]["iteration"] == 2
    assert not os.path.exists(child_pool)


@pytest.mark.parametrize("update_in_backward", [False, True])
def test_a_step_keeps_no_gradient_alive_after_zero_grad(pool_path, update_in_backward):
    """Once zero_grad() drops them, a step's gradients are freed at once,
    not when the cycle collector runs: a reference cycle in the stepping
    once held 7-10 steps' gradients (133 MB of a small transformer's heap,
    and on a GPU its memory)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gc.disable()
    try:
        with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1,
                                          update_in_backward=update_in_backward) as copt:
            for step in range(6):
                if step % 2:
                    copt.flush()  # one optimizer call; otherwise groups may run
                train_step(model, copt, step)
                grads = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
                assert grads
                copt.zero_grad()
                assert [r for r in grads if r() is not None] == [], f"step {step}"
    finally:
        gc.enable()


def test_steps_begun_with_no_copy_in_flight_run_in_one_optimizer_call_and_change_no_bit(
        pool_path):
    """With no copy in flight when a step begins, the optimizer is stepped
    in one call, whether an epoch captures the step (every=3) or not, and
    no extra state is packed between checkpoints; the model stays bitwise
    the plain optimizer's, and the checkpoints keep their own step's extra
    state."""
    plain_model = make_model(seed=5)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    model = make_model(seed=5)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = pmsnap.CheckpointedOptimizer(adamw, pool=pool_path, model=model, every=3)
    calls = []
    wrapped = adamw.step
    adamw.step = lambda *a, **k: (calls.append(1), wrapped(*a, **k))[1]
    for step in range(1, 8):
        opt.flush()  # no epoch in flight when the step begins
        calls.clear()
        opt.extra_state = {"step": step}
        train_step(plain_model, plain, step)
        train_step(model, opt, step)
        assert_same_training_state(plain_model, plain, model, adamw)
        assert len(calls) == 1, (step, len(calls))
    opt.close()
    fresh = make_model(seed=9)
    restored = pmsnap.CheckpointedOptimizer(torch.optim.AdamW(fresh.parameters(), lr=1e-2),
                                            pool=pool_path, model=fresh, every=3)
    iteration, extra = restored.restore()
    assert iteration == 6 and extra["step"] == 6
    restored.close()


def test_continuous_mode_stages_busy_steps_in_host_memory_and_restores_them(pool_path,
                                                                            monkeypatch):
    """On PM slower than the loop (simulated), a step that finds the previous
    checkpoint still being written is captured into host memory and written
    right after it; restore brings back exactly the newest committed step."""
    monkeypatch.setenv("PMSNAP_PM_WRITE_GBPS", "0.001")  # ~12 ms per checkpoint

    def fresh():
        model = make_model(seed=3)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    model, opt = fresh()
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, mode="continuous",
                                      dram_staging_buffers=2) as copt:
        for step in range(30):
            train_step(model, copt, step)
    # Close checkpointed step 30 if its boundary skipped it.
    s = copt.stats()
    assert s["epochs_staged"] > 0, s["summary"]
    assert "staged in host memory" in s["summary"]
    committed = pmsnap.read_pool(pool_path)["latest"]["iteration"]
    assert committed == s["last_committed_iteration"]
    ref_model, ref_opt = fresh()
    for step in range(committed):
        train_step(ref_model, ref_opt, step)
    model, opt = fresh()
    iteration, _ = pmsnap.restore(pool_path, model, opt)
    assert iteration == committed
    assert_same_training_state(ref_model, ref_opt, model, opt)


def test_staging_with_a_policy_that_waits_is_refused(pool_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    copt = pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, every=1,
                                        dram_staging_buffers=1)
    # The engine opens with the first step.
    with pytest.raises(pmsnap.InvalidArgumentError, match="dram_staging_buffers=1.*continuous"):
        train_step(model, copt, 0)
