"""Sharded parameters (FSDP2's fully_shard, distribute_tensor) under SIGKILL:
2 gloo ranks each checkpoint their own shards into their own pool every
iteration; ranks killed at random steps and relaunched end bit-exact equal
to an uninterrupted run, every parameter and optimizer state tensor (Adam's
step included) gathered to full tensors. FSDP2 runs on CPU with gloo in
torch 2.11, so it is tested as users run it; DTensor parameters made
directly are tested on a 1-D and a 2-D mesh (2 ranks: 2x1 and 1x2). Also: a
rank writes about its share of the model, and a pool restored by a rank
holding other shards is refused naming the rank."""

import os

import pytest
import torch

import conftest

STEPS = 24
WORLD = 2


def torchrun(out, extra, expect_kill=False):
    return conftest.torchrun("fsdp_trainer.py", out, STEPS, extra, expect_kill, world=WORLD)


@pytest.mark.parametrize("model", [["--model", "fsdp2"],
                                   ["--model", "dtensor", "--mesh", "2"],
                                   ["--model", "dtensor", "--mesh", "2x1"],
                                   ["--model", "dtensor", "--mesh", "1x2"]],
                         ids=["fsdp2", "dtensor-1d", "dtensor-2x1", "dtensor-1x2"])
def test_killed_sharded_ranks_resume_bit_exact_against_an_uninterrupted_run(tmp_path, pool_path,
                                                                           model, rng):
    kills = int(os.environ.get("PMSNAP_SHARDED_KILLS") or 3)
    plan = conftest.random_kills(rng, WORLD, STEPS, kills)
    template = pool_path.replace(".pool", ".{rank}.pool")
    reference = tmp_path / "reference"
    torchrun(reference, ["--pool", "unused", "--plain"] + model)
    resumed = tmp_path / "resumed"
    try:
        for kill in plan:
            torchrun(resumed, ["--pool", template, "--kills", kill] + model, expect_kill=True)
        log = torchrun(resumed, ["--pool", template] + model)
    finally:
        conftest.remove_rank_pools(template, WORLD)
    for r in range(WORLD):
        ref = torch.load(reference / f"rank{r}.pt")
        got = torch.load(resumed / f"rank{r}.pt")
        assert ref["params"].keys() == got["params"].keys()
        for name, value in ref["params"].items():
            assert torch.equal(value, got["params"][name]), \
                f"rank {r} parameter {name} differs (kill plan {plan})"
        assert ref["state"].keys() == got["state"].keys()
        assert any(key.endswith(".step") for key in ref["state"])
        for key, value in ref["state"].items():
            assert torch.equal(value, got["state"][key]), \
                f"rank {r} optimizer state {key} differs (kill plan {plan})"
        if model[1] == "fsdp2":
            # Each rank writes its shards: about half of parameters + Adam's
            # two moments, far from the whole model's.
            assert got["epoch_bytes"] < 0.75 * 3 * got["global_bytes"], got
            assert got["local_bytes"] * 2 <= got["global_bytes"] + 64, got
    assert got["start"] > 1, log[-2000:]


def test_a_pool_restored_by_a_rank_holding_other_shards_is_refused_naming_the_rank(tmp_path,
                                                                                   pool_path):
    template = pool_path.replace(".pool", ".{rank}.pool")
    model = ["--model", "dtensor", "--mesh", "2"]
    try:
        torchrun(tmp_path / "first", ["--pool", template, "--steps", "3"] + model)
        # The same mesh over the ranks in reverse order: rank 0 now holds
        # the shards rank 1 checkpointed (same shapes, other offsets).
        out = tmp_path / "swapped"
        torchrun(out, ["--pool", template, "--reverse-ranks", "--expect-mismatch"] + model)
    finally:
        conftest.remove_rank_pools(template, WORLD)
    for r in range(WORLD):
        message = (out / f"rank{r}.error").read_text()
        assert f"rank {r}:" in message and "parameter '" in message, message
        assert "offsets" in message, message


def _assert_equal(expected, got, what):
    assert expected.keys() == got.keys(), what
    for key, value in expected.items():
        assert torch.equal(value, got[key]), f"{what}: {key} differs"


@pytest.mark.parametrize("model", [["--model", "fsdp2"],
                                   ["--model", "dtensor", "--mesh", "{world}"]],
                         ids=["fsdp2", "dtensor"])
def test_four_ranks_save_and_two_or_three_ranks_continue_from_their_pools(tmp_path, pool_path,
                                                                          model):
    """4 ranks checkpoint 10 steps; 2 and then 3 ranks start from those pools
    (init_from, each rank reading the rows of its new shards) and hold
    every element as the 4 ranks left it, then train on; dcp.load through
    pmsnap.dcp.PoolReader gives 2 and 3 ranks the same state. The DTensor model
    trains every rank on the same batch, so its run does not depend on the
    world size: continued on 2 or 3 ranks it ends bit-exact equal to an
    uninterrupted run."""
    saved = pool_path.replace(".pool", ".four.{rank}.pool")
    pools = [saved]
    try:
        for world in (4, 2, 3):
            args = [a.replace("{world}", str(world)) for a in model]
            out = tmp_path / f"world{world}"
            if world == 4:
                conftest.torchrun("fsdp_trainer.py", out, 10, ["--pool", saved] + args,
                                  world=world)
                four = torch.load(out / "rank0.pt")
                continue
            resumed = pool_path.replace(".pool", f".{world}.{{rank}}.pool")
            pools.append(resumed)
            conftest.torchrun("fsdp_trainer.py", out, 20,
                              ["--pool", resumed, "--init-from", saved] + args, world=world)
            # The same pools through dcp.load (pmsnap.dcp.PoolReader): DCP
            # reshards them to this world size.
            loaded = tmp_path / f"dcp{world}"
            conftest.torchrun("fsdp_trainer.py", loaded, 10, ["--pool", "unused", "--dcp-load",
                                                              saved] + args, world=world)
            for r in range(world):
                restored = torch.load(out / f"restored{r}.pt")
                _assert_equal(four["params"], restored["params"], f"{world} ranks, rank {r}")
                _assert_equal(four["state"], restored["state"], f"{world} ranks, rank {r}")
                assert torch.load(out / f"rank{r}.pt")["start"] == 11
                through_dcp = torch.load(loaded / f"dcp{r}.pt")
                _assert_equal(four["params"], through_dcp["params"], f"dcp.load, {world} ranks")
                _assert_equal(four["state"], through_dcp["state"], f"dcp.load, {world} ranks")
            if model[1] == "dtensor":
                reference = tmp_path / f"reference{world}"
                conftest.torchrun("fsdp_trainer.py", reference, 20,
                                  ["--pool", "unused", "--plain"] + args, world=world)
                ref, got = torch.load(reference / "rank0.pt"), torch.load(out / "rank0.pt")
                _assert_equal(ref["params"], got["params"], f"{world} ranks against uninterrupted")
                _assert_equal(ref["state"], got["state"], f"{world} ranks against uninterrupted")
    finally:
        for template in pools:
            conftest.remove_rank_pools(template, 4)
