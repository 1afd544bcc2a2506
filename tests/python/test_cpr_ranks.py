"""CPR partial recovery over 2 gloo ranks restarted together (torchrun's
restart-all: every rank's process exits and new ones start): the live pools'
global recovery brings every rank to its newest epoch (dense part and data
position alike), then only the failed rank's embedding shard goes back to its
last (CPR-MFU) save, the other rank's shard stays bitwise at its newest epoch,
and both ranks agree on the PLS. Its own file and ctest: the ranks are forked
from the pytest process, which must not hold engine threads yet."""

import os
import tempfile

import pytest
import torch

import pmsnap
from pmsnap import cpr

from test_cpr import BATCH, DIM, ROWS, batch_ids
from conftest import run_ranks


class RankModel(torch.nn.Module):
    """One rank's part of a model-parallel DLRM: its embedding shard (the same
    name and shape on every rank, its own values) and the data-parallel dense
    part (the same on every rank: gradients are averaged over the ranks)."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(100 + rank)
        self.emb = torch.nn.Embedding(ROWS, DIM)
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.dense(self.emb(ids))


def _rank_run(rank, world, d, phase):
    """Phase 1 trains 9 steps (shard saves at 4 and 8); phase 2 is every rank
    restarted: the live pools' global recovery, then shard 1 recovered."""
    import torch.distributed as dist
    model = RankModel(rank)
    opt = pmsnap.CheckpointedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       os.path.join(d, "live.{rank}.pool"), model=model,
                                       every=1, workers=1)
    saves = cpr.ShardSaves(os.path.join(d, f"save.{rank}.pool"), {"emb.weight": model.emb.weight.data},
                           policy="mfu", ratio=0.5, modules={"emb.weight": model.emb})
    recovery = cpr.PartialRecovery({rank: saves}, total_samples=100 * BATCH, distributed=True,
                                   live=opt)
    assert recovery.emb_shards == world
    out = {}
    if phase == 1:
        for step in range(1, 10):
            ids = batch_ids(step, world)[:, rank]
            opt.zero_grad()
            model(ids).square().mean().backward()
            for p in model.dense.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step(extra_state=recovery.extra_state({"samples": step * BATCH}))
            if step in (4, 8):
                saves.save(step, step * BATCH)
                out[f"save{step}"] = model.emb.weight.detach().clone()
        opt.flush()
        out["table"] = model.emb.weight.detach().clone()
    else:
        iteration, extra = opt.restore()
        recovery.load(extra)
        out["iteration"] = iteration
        out["restored_table"] = model.emb.weight.detach().clone()
        report = recovery.recover([1], samples=extra["samples"])
        out["report"] = report
        out["pls"] = recovery.pls
        out["table"] = model.emb.weight.detach().clone()
    out["dense"] = model.dense.weight.detach().clone()
    opt.close()
    saves.close()
    return out


def test_two_gloo_ranks_restarted_together_roll_back_only_the_failed_rank_shard():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        first = run_ranks(2, lambda r, w: _rank_run(r, w, d, 1))
        # Every rank's process is gone (torchrun restarts them all); shard 1
        # is the one whose node failed.
        second = run_ranks(2, lambda r, w: _rank_run(r, w, d, 2))
        for rank in range(2):
            assert second[rank]["iteration"] == 9
            # Global recovery: every rank's newest epoch, dense parts alike.
            assert torch.equal(second[rank]["restored_table"], first[rank]["table"])
            assert torch.equal(second[rank]["dense"], first[rank]["dense"])
            # Eq. 3: one shard of two lost samples 8*B..9*B of 100*B.
            assert second[rank]["pls"] == pytest.approx(BATCH / (100 * BATCH * 2))
            assert second[rank]["report"]["saves"] == {1: (8, 8 * BATCH)}
        assert torch.equal(second[0]["dense"], second[1]["dense"])
        assert torch.equal(second[0]["table"], first[0]["table"]), "rank 0 keeps its state"
        # Rank 1's shard holds what its MFU saves (r = 0.5) wrote: each row
        # its value at save 4 or save 8, and no row newer.
        restored = second[1]["table"]
        options = torch.stack([first[1]["save4"], first[1]["save8"]])
        assert bool((options == restored.unsqueeze(0)).all(dim=2).any(dim=0).all())
        assert not torch.equal(restored, first[1]["table"])
