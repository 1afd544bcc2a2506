"""CPR partial recovery (pmsnap.cpr): only failed embedding shards go back to
their last save and every other shard stays bitwise untouched, in a
single-process emulation with N_emb logical shards (the 2-rank gloo case is
test_cpr_ranks.py: forking ranks after this file's engines ran would inherit
their threads); PLS (Eq. 3) against a hand
computation, kept in the live pool's extra state across restarts and shown by
`pmsnap info`; the interval choice (Eq. 4) and the full-recovery fallback;
CPR-MFU / CPR-SSU shard saves restore rows that each shard really held."""

import os
import tempfile

import pytest
import torch

import pmsnap
from pmsnap import _pmsnap
from pmsnap import cpr

ROWS, DIM, BATCH = 300, 8, 16


class ShardedModel(torch.nn.Module):
    """N_emb embedding tables (one per shard) and a dense part."""

    def __init__(self, shards, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.tables = torch.nn.ModuleList(torch.nn.Embedding(ROWS, DIM) for _ in range(shards))
        self.dense = torch.nn.Linear(DIM * shards, 1)

    def forward(self, ids):
        return self.dense(torch.cat([t(ids[:, i]) for i, t in enumerate(self.tables)], dim=1))


def batch_ids(step, shards):
    g = torch.Generator().manual_seed(1000 + step)
    # Zipf-like ids: a few hot rows per table.
    u = torch.rand(BATCH, shards, generator=g)
    return (ROWS * u ** 3).long().clamp_(max=ROWS - 1)


def train_step(model, optimizer, step, shards):
    ids = batch_ids(step, shards)
    optimizer.zero_grad()
    model(ids).square().mean().backward()
    optimizer.step()


def make_saves(d, model, policy, **kw):
    return {s: cpr.ShardSaves(os.path.join(d, f"shard{s}.pool"),
                              {f"tables.{s}.weight": model.tables[s].weight.data},
                              policy=policy, modules={f"tables.{s}.weight": model.tables[s]},
                              **kw)
            for s in range(len(model.tables))}


def snapshot(model):
    return [t.weight.detach().clone() for t in model.tables]


@pytest.mark.parametrize("policy", ["full", "mfu", "ssu"])
def test_emulation_restores_exactly_the_failed_shards_and_leaves_the_others_untouched(policy):
    shards, every, total_steps = 4, 5, 40
    model = ShardedModel(shards)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        saves = make_saves(d, model, policy, ratio=0.25)
        recovery = cpr.PartialRecovery(saves, total_samples=total_steps * BATCH)
        assert recovery.emb_shards == shards
        at_save = {}  # step -> tables at that save
        failures = {13: [1, 3], 27: [2]}
        expected_pls = 0.0
        for step in range(1, 31):
            train_step(model, optimizer, step, shards)
            if step % every == 0:
                for s in saves.values():
                    s.save(step, step * BATCH)
                at_save[step] = snapshot(model)
            if step in failures:
                failed = failures[step]
                before = snapshot(model)
                dense_before = model.dense.weight.detach().clone()
                report = recovery.recover(failed, samples=step * BATCH)
                last = step - step % every
                assert report["restored"] == {s: (last, last * BATCH) for s in failed}
                after = snapshot(model)
                for s in range(shards):
                    if s not in failed:
                        assert torch.equal(after[s], before[s]), f"shard {s} was touched"
                    elif policy == "full":
                        assert torch.equal(after[s], at_save[last][s]), f"shard {s}"
                    else:
                        # MFU/SSU saves write some rows each time: every row
                        # holds the value it had at one of the shard's saves.
                        options = torch.stack([at_save[k][s] for k in sorted(at_save)])
                        match = (options == after[s].unsqueeze(0)).all(dim=2).any(dim=0)
                        assert bool(match.all()), f"shard {s}: rows no save held"
                        assert not torch.equal(after[s], before[s])
                assert torch.equal(model.dense.weight, dense_before)  # dense: not partial
                # Eq. 3 by hand: one term per failed shard.
                expected_pls += len(failed) * (step - last) * BATCH / (total_steps * BATCH * shards)
                assert recovery.pls == pytest.approx(expected_pls, rel=1e-12)
        assert recovery.pls == pytest.approx(2 * 3 / 160 + 2 / 160, rel=1e-12)
        if policy != "full":
            st = saves[0].stats()
            assert 0 < st["access_record_bytes"]
            if policy == "mfu":
                assert st["access_record_bytes"] == ROWS * 4
            row = saves[0].last_checkpoint("tables.0.weight")
            assert row["rows_written"] <= 75 or row["full"]  # r * N = 0.25 * 300
        recovery.close()


def test_pls_survives_a_restart_in_the_live_pool_and_pmsnap_info_shows_it(pool_path):
    shards = 2
    model = ShardedModel(shards)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        saves = make_saves(d, model, "full")
        recovery = cpr.PartialRecovery(saves, total_samples=1000)
        opt = pmsnap.CheckpointedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           pool_path, model=model, every=1, workers=1)
        for step in range(1, 9):
            ids = batch_ids(step, shards)
            opt.zero_grad()
            model(ids).square().mean().backward()
            opt.step(extra_state=recovery.extra_state({"samples": step * BATCH}))
            if step == 4:
                for s in saves.values():
                    s.save(step, step * BATCH)
            if step == 6:
                recovery.recover([0], samples=step * BATCH)
        opt.close()
        pls = recovery.pls
        assert pls == pytest.approx((6 - 4) * BATCH / (1000 * 2))
        # A restarted process takes it back from the live pool.
        fresh = ShardedModel(shards, seed=1)
        opt2 = pmsnap.CheckpointedOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1),
                                            pool_path, model=fresh, every=1, workers=1)
        _, extra = opt2.restore()
        opt2.close()
        again = cpr.PartialRecovery({}, total_samples=1000, emb_shards=2)
        assert again.pls == 0
        again.load(extra)
        assert again.pls == pls
        assert again.ledger.failures[0]["lost_samples"] == 2 * BATCH
        assert cpr.read_pls(pool_path)["pls"] == pls
        code, out, _ = _pmsnap.run_cli(["info", pool_path])
        assert code == 0
        assert "pls" in out and f"{pls:g}"[:6] in out, out
        code, out, _ = _pmsnap.run_cli(["info", pool_path, "--json"])
        assert '"pls": {"pls": ' in out
        recovery.close()


def test_interval_follows_equation_4_and_partial_is_dropped_when_it_brings_nothing():
    assert cpr.save_interval_for_pls(0.1, 8, 28.0) == pytest.approx(2 * 0.1 * 8 * 28.0)
    assert cpr.expected_pls(44.8, 8, 28.0) == pytest.approx(0.1)
    plan = cpr.plan(save_seconds=0.25, load_seconds=0.1, reschedule_seconds=0.2,
                    mean_time_to_failure=28.0, total_seconds=56.0, target_pls=0.1, emb_shards=4)
    assert plan["partial"]
    assert plan["save_interval"] == pytest.approx(22.4)
    full_interval = (2 * 0.25 * 28.0) ** 0.5
    assert plan["full_interval"] == pytest.approx(full_interval)
    assert plan["full_overhead"] == pytest.approx(
        0.25 * 56 / full_interval + (0.1 + full_interval / 2 + 0.2) * 2)
    assert plan["partial_overhead"] == pytest.approx(0.25 * 56 / 22.4 + 0.3 * 2)
    tiny = cpr.plan(0.25, 0.1, 0.2, 28.0, 56.0, target_pls=0.001, emb_shards=1)
    assert not tiny["partial"]
    assert tiny["save_interval"] == pytest.approx(full_interval)
    assert "fallback" in tiny["reason"]
    with pytest.raises(pmsnap.InvalidArgumentError, match="target PLS"):
        cpr.plan(0.25, 0.1, 0.2, 28.0, 56.0, target_pls=2.0, emb_shards=4)
    with pytest.raises(pmsnap.InvalidArgumentError, match="save policy"):
        cpr.ShardSaves("/dev/shm/never.pool", {"t": torch.zeros(4, 2)}, policy="lru")
