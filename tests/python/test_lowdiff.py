"""LowDiff (pmsnap.lowdiff): compressed gradients of DDP reused as
differential checkpoints.

Under torchrun (2 ranks, gloo): the decompression of every recorded
compressed gradient equals what DDP handed the optimizer, bit for bit; after
a SIGKILL at a random step, restore (full checkpoint + replayed
differentials) equals the uninterrupted run's state at the restored
iteration, bit for bit, on every rank, for PowerSGD and top-k. In one
process (a world of one): the loss bound of batched writes, parallel against
sequential merge, Eq. 10 in stats, and bad configurations."""

import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import conftest
import pmsnap
from pmsnap import _pmsnap, lowdiff

WORLD = 2
STEPS = 30


def torchrun(out, extra, expect_kill=False):
    return conftest.torchrun("lowdiff_trainer.py", out, STEPS, extra, expect_kill)


@pytest.mark.parametrize("compressor", ["powersgd", "topk"])
def test_decompression_equals_the_gradient_ddp_gave_the_optimizer(tmp_path, compressor):
    torchrun(tmp_path, ["--reference", "--check-decompress", "--compressor", compressor])


@pytest.mark.parametrize("compressor,sharded", [("powersgd", False), ("topk", False),
                                                ("topk", True)])
def test_sigkilled_ranks_restore_bit_exact_to_the_uninterrupted_run(tmp_path, pool_path,
                                                                     compressor, sharded, rng):
    full_every, batch = 7, 3
    reference = tmp_path / "reference"
    torchrun(reference, ["--reference", "--compressor", compressor])
    template = pool_path.replace(".pool", ".{rank}.pool")
    # The first trial constructs a replay: the victim kills itself right
    # after step s returns, so it completed exactly s, and the other rank
    # completed s-1 (its gradient of step s met the victim's) but cannot
    # complete s+1 (that needs the victim's gradient). A step returns only
    # once every full batch of its differentials is sealed (LowDiff.step
    # waits for it), so a batch ending in (F(s), s-1], F(s) the newest full
    # checkpoint up to s, is durable on both ranks and must be replayed:
    # restore starts at F(s) or an older full checkpoint. Differentials
    # start at step 2 (step 1 is a full checkpoint): batches end at
    # 1 + k * batch. The other trials kill at any step, a random fraction of
    # the victim's own step time after it (its update, a write, or later),
    # where a replay depends on timing and is not asserted.
    def replay_certain(s):
        newest_full = s // full_every * full_every
        return any(newest_full < end <= s - 1 for end in range(1 + batch, s, batch))
    certain = [s for s in range(full_every + 2, STEPS - 4) if replay_certain(s)]
    kills = int(os.environ.get("PMSNAP_LOWDIFF_KILLS") or 3)
    try:
        for trial in range(kills):
            for r in range(WORLD):
                path = template.replace("{rank}", str(r))
                if os.path.exists(path):
                    os.remove(path)
            if trial == 0:
                step = rng.choice(certain)
                kill = f"{rng.randrange(WORLD)}:{step}:now"
            else:
                step = rng.randrange(full_every + 2, STEPS - 4)
                kill = f"{rng.randrange(WORLD)}:{step}:{rng.uniform(0, 1.5):.2f}"
            out = tmp_path / f"trial{trial}"
            args = ["--pool", template, "--compressor", compressor, "--full-every",
                    str(full_every), "--batch", str(batch)] + (["--sharded"] if sharded else [])
            torchrun(out, args + ["--kill", kill], expect_kill=True)
            torchrun(out, args)
            for r in range(WORLD):
                ref = torch.load(reference / f"reference_rank{r}.pt")
                got = torch.load(out / f"restored_rank{r}.pt")
                n = got["iteration"]
                # Loss bound: the victim completed `step`; at most b-1
                # differentials after it were not yet written (and the other
                # rank may be one step behind).
                assert n >= step - (batch - 1) - 1, (kill, got["full"], n)
                assert got["full"] <= n and n - got["full"] == got["replayed"]
                if trial == 0:
                    assert got["replayed"] > 0, (kill, got["full"], n)
                want = ref[n]
                for i, (a, b) in enumerate(zip(want["params"], got["params"])):
                    assert torch.equal(a, b), f"rank {r} parameter {i} at {n} (kill {kill})"
                for key, state in want["optimizer"].items():
                    for name, value in state.items():
                        assert torch.equal(torch.as_tensor(value),
                                           torch.as_tensor(got["optimizer"][key][name])), \
                            f"rank {r} optimizer {key}.{name} at {n} (kill {kill})"
    finally:
        for r in range(WORLD):
            path = template.replace("{rank}", str(r))
            if os.path.exists(path):
                os.remove(path)


# --- one process: a world of one ------------------------------------------------

@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_ddp(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, DistributedDataParallel(model)


def train(ld, ddp, first, last):
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 12, generator=g)
        torch.nn.functional.mse_loss(ddp(x), x[:, :4].sin()).backward()
        ld.step(extra_state={"batch": step})
        ld.zero_grad()


def test_crash_loses_at_most_batch_minus_one_differentials(world_of_one, pool_path):
    batch = 4
    model, ddp = make_ddp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ld = lowdiff.LowDiff(opt, pool_path, ddp, lowdiff.TopK(0.25), full_every=1000, batch=batch,
                         workers=1)
    steps = 15  # differentials 2..15 (step 1 is the full checkpoint): 14, 3 batches written
    train(ld, ddp, 1, steps)
    stats = ld.stats()
    assert stats["max_loss"] == batch - 1
    assert stats["log"]["appended"] - stats["log"]["durable"] <= batch - 1
    ld.close(abandon=True)  # a crash: what is buffered is lost
    model2, ddp2 = make_ddp(seed=1)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    ld2 = lowdiff.LowDiff(opt2, pool_path, ddp2, lowdiff.TopK(0.25), full_every=1000,
                          batch=batch, workers=1)
    n, extra, info = ld2.restore()
    assert info["full"] == 1
    assert steps - n <= batch - 1
    assert n == 1 + 12 and extra["batch"] == n
    ld2.close()


@pytest.mark.parametrize("merge", ["sequential", "parallel"])
def test_replay_steps_with_the_learning_rate_each_step_had(world_of_one, pool_path, merge):
    """An LR scheduler changes the learning rate between full checkpoints:
    each differential replays with its own step's hyperparameters, so the
    replayed model equals the trained one (bitwise sequentially)."""
    model, ddp = make_ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    ld = lowdiff.LowDiff(opt, pool_path, ddp, lowdiff.TopK(0.5), full_every=1000, batch=1,
                         workers=1)
    for step in range(1, 11):
        train(ld, ddp, step, step)
        schedule.step()
    trained = [p.detach().clone() for p in model.parameters()]
    ld.close()
    model2, ddp2 = make_ddp(seed=5)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.25)
    ld2 = lowdiff.LowDiff(opt2, pool_path, ddp2, lowdiff.TopK(0.5), full_every=1000, batch=1,
                          merge=merge, workers=1)
    n, _, info = ld2.restore()
    assert n == 10 and info["replayed"] == 9
    assert opt2.param_groups[0]["lr"] == 0.25 * 0.5 ** 9  # the last replayed step's
    for got, want in zip(model2.parameters(), trained):
        if merge == "sequential":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ld2.close(abandon=True)


def _restore_with(pool_path, merge):
    model, ddp = make_ddp(seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.125)
    ld = lowdiff.LowDiff(opt, pool_path, ddp, lowdiff.TopK(0.5), full_every=1000, batch=2,
                         merge=merge, workers=1)
    n, _, info = ld.restore()
    params = [p.detach().clone() for p in model.parameters()]
    ld.close(abandon=True)
    return n, info, params


def test_parallel_merge_matches_sequential_replay_for_plain_sgd(world_of_one, pool_path):
    model, ddp = make_ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.125)
    ld = lowdiff.LowDiff(opt, pool_path, ddp, lowdiff.TopK(0.5), full_every=1000, batch=2,
                         workers=1)
    train(ld, ddp, 1, 17)
    trained = [p.detach().clone() for p in model.parameters()]
    ld.close()
    n_seq, info_seq, seq = _restore_with(pool_path, "sequential")
    n_par, info_par, par = _restore_with(pool_path, "parallel")
    assert n_seq == n_par == 17 and info_seq["replayed"] == info_par["replayed"] == 16
    for a, b, t in zip(seq, par, trained):
        assert torch.equal(a, t)  # sequential replay: bit-exact with training
        # The tree sums in another order: equal up to float rounding (the C++
        # test shows bitwise equality where the sums are exact).
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_stats_report_eq10_from_the_measured_inputs(world_of_one, pool_path):
    model, ddp = make_ddp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ld = lowdiff.LowDiff(opt, pool_path, ddp, lowdiff.PowerSGD(start_powerSGD_iter=2),
                         mtbf_seconds=600, initial_full_every=4, workers=1)
    train(ld, ddp, 1, 30)
    stats = ld.stats()
    inputs = stats["inputs"]
    w, s, rd = inputs["write_bandwidth"], inputs["full_bytes"], inputs["merge_seconds"]
    it, m = inputs["iteration_seconds"], inputs["mtbf_seconds"]
    assert m == 600 and w > 0 and s > 0 and rd > 0 and it > 0
    # Eq. 10 by hand, in iterations.
    w_it, rd_it, m_it = w * it, rd / it, m / it
    assert stats["f_star"] == pytest.approx((rd_it * w_it ** 2 / (4 * s * s * m_it * m_it)) ** (1 / 3))
    assert stats["b_star"] == pytest.approx((2 * s * rd_it * m_it / w_it) ** (1 / 3))
    assert stats["full_every"] == min(max(1, round(1 / stats["f_star"])),
                                      stats["heap_max_full_every"])
    assert stats["batch"] == min(64, max(1, round(stats["b_star"])))
    assert stats["log"]["batch"] == stats["batch"]
    ld.close()


def test_a_fixed_full_interval_the_chunk_heap_cannot_hold_fails_naming_both_settings(
        world_of_one, pool_path):
    model, ddp = make_ddp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # Dense top-k: ~7 KB per differential, a 64 KiB heap holds a few.
    ld = lowdiff.LowDiff(opt, pool_path, ddp, lowdiff.TopK(1.0), full_every=1000, batch=1,
                         chunk_heap_bytes=64 << 10, workers=1)
    with pytest.raises(pmsnap.NoSpaceError) as e:
        train(ld, ddp, 1, 40)
    message = str(e.value)
    assert pool_path in message and "chunk heap full" in message
    assert "full_every=1000" in message and "lower full_every" in message
    assert "larger chunk heap than its 65536 bytes" in message
    ld.close(abandon=True)


def test_a_tuned_full_interval_and_batch_are_capped_to_what_the_chunk_heap_holds(
        world_of_one, pool_path):
    model, ddp = make_ddp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    heap = 1 << 20
    # A long MTBF makes Eq. 10 ask for a full checkpoint every ~10^8
    # iterations and batches of 64: far more differentials than 1 MiB holds.
    ld = lowdiff.LowDiff(opt, pool_path, ddp, lowdiff.TopK(1.0), mtbf_seconds=1e9,
                         initial_full_every=4, chunk_heap_bytes=heap, workers=1)
    steps = 120
    train(ld, ddp, 1, steps)
    stats = ld.stats()
    cap = stats["heap_max_full_every"]
    assert cap is not None and stats["full_every"] <= cap < round(1 / stats["f_star"])
    assert stats["engine"]["epochs_committed"] >= 3  # full checkpoints at the capped interval
    log = stats["log"]
    assert log["heap_capacity_bytes"] == heap and 0 < log["heap_used_bytes"] <= heap
    assert stats["batch"] < 64 and log["batch"] == stats["batch"]
    ld.close()
    model2, ddp2 = make_ddp(seed=1)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    # A resumed run tunes 10 steps after the restored iteration (no full
    # checkpoint step comes before with initial_full_every=1000).
    ld2 = lowdiff.LowDiff(opt2, pool_path, ddp2, lowdiff.TopK(1.0), chunk_heap_bytes=heap,
                          mtbf_seconds=1e9, initial_full_every=1000, workers=1)
    n, extra, _ = ld2.restore()
    assert n == steps and extra["batch"] == steps
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    train(ld2, ddp2, steps + 1, steps + 9)
    assert ld2.stats()["full_every"] == 1000
    train(ld2, ddp2, steps + 10, steps + 10)
    resumed = ld2.stats()
    assert resumed["full_every"] <= resumed["heap_max_full_every"] < 1000
    ld2.close()


def _tuned_ranks_run(rank, world, pool, steps):
    torch.set_num_threads(1)
    model, ddp = make_ddp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # Each rank measures its own W, R_D and iteration time; the MTBFs differ
    # by 1000x so that the ranks' Eq. 10 intervals surely differ too.
    ld = lowdiff.LowDiff(opt, pool, ddp, lowdiff.TopK(0.25), mtbf_seconds=60 * 1000 ** rank,
                         initial_full_every=5, workers=1)
    train(ld, ddp, 1, steps)
    stats = ld.stats()
    own = max(1, round(1 / stats["f_star"]))  # Eq. 10 alone, within this rank's heap
    own = min(own, stats["heap_max_full_every"] or own)
    ld.close()
    return {"full_every": stats["full_every"], "batch": stats["batch"], "own": own,
            "committed": stats["engine"]["epochs_committed"]}


def test_ranks_tune_to_the_same_full_interval_though_their_measurements_differ(pool_path):
    template = pool_path.replace(".pool", ".{rank}.pool")
    try:
        results = conftest.run_ranks(2, functools.partial(_tuned_ranks_run, pool=template,
                                                          steps=60), start_method="spawn")
    finally:
        for r in range(2):
            if os.path.exists(template.format(rank=r)):
                os.remove(template.format(rank=r))
    a, b = results
    assert a["own"] != b["own"], results  # the ranks alone would have disagreed
    assert a["full_every"] == b["full_every"] == min(a["own"], b["own"]), results
    assert a["batch"] == b["batch"] and a["committed"] == b["committed"], results


def test_eq10_binding_matches_a_hand_computation():
    c = _pmsnap.optimal_configuration(write_bandwidth=2e9, full_bytes=1.2e9, merge_seconds=0.05,
                                      mtbf_seconds=3600, iteration_seconds=0.5, world_size=8)
    assert c["b_star"] == pytest.approx(12.0)
    assert c["f_star"] == pytest.approx(1 / 1440)
    assert (c["full_interval"], c["batch"]) == (1440, 12)


def test_compression_without_ddp_is_rejected(pool_path):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(pmsnap.InvalidArgumentError, match="DistributedDataParallel"):
        lowdiff.LowDiff(torch.optim.SGD(model.parameters(), lr=0.1), pool_path, model,
                        lowdiff.TopK(0.1))


def test_a_hook_that_is_not_ours_is_rejected(world_of_one, pool_path):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    model, ddp = make_ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(pmsnap.InvalidArgumentError, match="not a pmsnap.lowdiff compressor"):
        lowdiff.LowDiff(opt, pool_path, ddp, powerSGD_hook.powerSGD_hook)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(pmsnap.InvalidArgumentError, match="already has the comm hook"):
        lowdiff.LowDiff(opt, pool_path, ddp, lowdiff.TopK(0.1))
    _, ddp2 = make_ddp()
    with pytest.raises(pmsnap.InvalidArgumentError, match="additive update"):
        lowdiff.LowDiff(torch.optim.Adam(model.parameters()), pool_path, ddp2, lowdiff.TopK(0.1),
                        merge="parallel")
    assert not os.path.exists(pool_path)
