"""pmsnap's coordination over real torch.distributed process groups: gloo
ranks in separate processes on this machine (torch.multiprocessing)."""

import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import pmsnap
from conftest import run_ranks
from pmsnap import distributed as pmdist


def _collectives(rank, world):
    c = pmdist.TorchDistributedCoordinator()
    c.start_min_all_reduce([10 - rank, 100 + rank])
    reduced = c.finish_min_all_reduce()
    got = c.broadcast(bytes([rank] * 5) if rank else b"hello", 0)
    return reduced, got, c.rank(), c.world_size()


def test_coordinator_gives_every_rank_the_same_minimum_and_broadcast():
    results = run_ranks(3, _collectives)
    for rank, (reduced, got, r, w) in enumerate(results):
        assert reduced == [8, 100]
        assert got == b"hello"
        assert (r, w) == (rank, 3)


def _agreement_run(rank, world):
    agreement = pmdist.EpochAgreement(pmdist.TorchDistributedCoordinator())
    restored = agreement.agree_on_restore([7, 9] if rank == 0 else [7])
    committed, in_flight, commit_at, opened = restored, None, 0, []
    for step in range(8, 20):
        if in_flight is not None and step >= commit_at:
            committed, in_flight = in_flight, None
        may_open = agreement.at_boundary(step, committed)
        opened.append(may_open)
        if may_open:
            agreement.on_epoch_opened(step)
            # Rank 1 is slow: its epochs commit three steps after they open.
            in_flight, commit_at = step, step + (3 if rank == 1 else 1)
    agreement.finish()
    return restored, opened


def test_agreement_over_torch_distributed_restores_together_and_opens_same_steps():
    results = run_ranks(2, _agreement_run)
    assert [r for r, _ in results] == [7, 7]
    assert results[0][1] == results[1][1]
    assert results[0][1] == [True, False, False, False] * 3


def _failing_rank(rank, world):
    agreement = pmdist.EpochAgreement(pmdist.TorchDistributedCoordinator())
    for step in range(10):
        try:
            if agreement.at_boundary(step, step - 1 if step else None, healthy=not (
                    rank == 2 and step >= 4)):
                agreement.on_epoch_opened(step)
        except pmsnap.AbortedError as e:
            agreement.finish()
            return step, str(e)
    return None, ""


def test_a_failed_rank_stops_every_rank_at_the_same_step_naming_it():
    for step, message in run_ranks(3, _failing_rank):
        assert step == 5
        assert "rank 2 failed its checkpoint" in message


def _restore_beside_a_rank_without_checkpoint(rank, world, never_committed):
    """Rank 1's pool holds no checkpoint: lost (never_committed False) or
    never committed one; rank 0 holds iteration 3. Returns the error."""
    agreement = pmdist.EpochAgreement(pmdist.TorchDistributedCoordinator())
    try:
        agreement.agree_on_restore([] if rank == 1 else [3],
                                   never_committed=never_committed and rank == 1)
    except (pmsnap.CorruptionError, pmsnap.NotFoundError) as e:
        return type(e).__name__, str(e)
    return None, ""


def test_restore_names_the_rank_whose_pool_was_lost_beside_checkpointed_ranks():
    for kind, message in run_ranks(2, functools.partial(_restore_beside_a_rank_without_checkpoint,
                                                        never_committed=False)):
        assert kind == "CorruptionError"
        assert "rank 1: its pool holds no intact checkpoint while other ranks' pools do" in message


def test_a_rank_that_never_committed_makes_the_others_lone_first_epochs_a_fresh_start():
    for kind, message in run_ranks(2, functools.partial(_restore_beside_a_rank_without_checkpoint,
                                                        never_committed=True)):
        assert kind == "NotFoundError"
        assert "no epoch was committed by every rank: rank 1's pool never committed one" in message


def _sharded_run(rank, world, pool, steps, restore, init_from=None):
    """A DDP-like run: every rank holds the same model and optimizer (seeded
    alike) and steps it with the same gradients; returns the restored
    iteration and extra state, and the final parameters and Adam state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = pmsnap.CheckpointedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), pool,
                                       model=model, every=1, sharding="replicated", replicas=2,
                                       workers=1, part_bytes=4096, init_from=init_from)
    start, extra = opt.iteration + 1, None
    if restore:
        iteration, extra = opt.restore()
        start = iteration + 1
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=g)
        model(x).square().mean().backward()
        opt.step(extra_state={"batch": step})
        opt.zero_grad()
    opt.close()
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        for key, value in opt.optimizer.state[p].items():
            state[f"{i}.{key}"] = value.clone() if torch.is_tensor(value) else value
    return (start - 1, extra and extra.get("batch")), state


def test_sharded_ranks_with_two_replicas_restore_a_deleted_pool_bit_exact():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        pool = os.path.join(d, "run.{rank}.pool")
        reference = run_ranks(3, lambda r, w: _sharded_run(r, w, os.path.join(d, "ref.{rank}.pool"),
                                                           8, False))
        run_ranks(3, lambda r, w: _sharded_run(r, w, pool, 5, False))
        os.remove(pool.format(rank=1))  # a replaced node
        resumed = run_ranks(3, lambda r, w: _sharded_run(r, w, pool, 3, True))
        for rank in range(3):
            (iteration, batch), state = resumed[rank]
            assert (iteration, batch) == (5, 5), rank
            _, expected = reference[rank]
            assert state.keys() == expected.keys()
            for key in state:
                if torch.is_tensor(state[key]):
                    assert torch.equal(state[key], expected[key]), (rank, key)
                else:
                    assert state[key] == expected[key], (rank, key)
        # The consolidated read matches the ranks across the replaced pool,
        # whose epochs are numbered from 1 again.
        consolidated = pmsnap.load_state_dict(pool)
        assert consolidated["pmsnap"]["iteration"] == 8
        for name, tensor in consolidated["model"].items():
            assert torch.equal(tensor, reference[0][1][name]), name
        # Each pool holds its owned and replicated parameters, not all four.
        for rank in range(3):
            held = len(pmsnap._pmsnap.read_pool(pool.format(rank=rank))["units"])
            assert 0 < held < 4, rank


def _per_rank_rng_run(rank, world, pool, steps, restore):
    """DDP-like with per-rank randomness: the same model on every rank, kept
    equal by averaging gradients, but each rank with its own dropout stream
    (its own torch seed) and data; returns (restored iteration, restored
    extra state's rank), and the final parameters, Adam state and RNG state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(32, 4))
    opt = pmsnap.CheckpointedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), pool,
                                       model=model, every=1, sharding="replicated", replicas=2,
                                       workers=1, part_bytes=4096)
    start, extra = 1, {}
    torch.manual_seed(1000 + rank)
    if restore:
        iteration, extra = opt.restore()
        start = iteration + 1
    for step in range(start, start + steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step(extra_state={"batch": step, "rank": rank})
        opt.zero_grad()
    opt.close()
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        for key, value in opt.optimizer.state[p].items():
            state[f"{i}.{key}"] = value.clone() if torch.is_tensor(value) else value
    state["rng"] = torch.get_rng_state()
    return (start - 1, extra.get("rank")), state


def _assert_same_states(got, want):
    for rank, ((_, _), state) in enumerate(got):
        _, expected = want[rank]
        assert state.keys() == expected.keys()
        for key in state:
            if torch.is_tensor(state[key]):
                assert torch.equal(state[key], expected[key]), (rank, key)
            else:
                assert state[key] == expected[key], (rank, key)


@pytest.mark.parametrize("world,lost", [(2, [1]), (3, [1, 2])],
                         ids=["2-ranks-lose-1", "3-ranks-lose-1-then-2"])
def test_a_replaced_rank_restores_its_own_rng_and_extra_state(world, lost):
    """[lossless]: a rank whose pool is lost used to restore the lowest
    holding rank's RNG states and extra state: its dropout differed, and so
    did the model, silently. Its own come from the peers that keep them."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        total = 2 + 2 * len(lost) + 2
        reference = run_ranks(world, lambda r, w: _per_rank_rng_run(
            r, w, os.path.join(d, "ref.{rank}.pool"), total, False))
        pool = os.path.join(d, "run.{rank}.pool")
        run_ranks(world, lambda r, w: _per_rank_rng_run(r, w, pool, 2, False))
        done = 2
        for k, rank in enumerate(lost):
            os.remove(pool.format(rank=rank))  # a replaced node
            steps = 2 if k + 1 < len(lost) else total - done
            resumed = run_ranks(world, lambda r, w: _per_rank_rng_run(r, w, pool, steps, True))
            for r, ((iteration, extra_rank), _) in enumerate(resumed):
                assert (iteration, extra_rank) == (done, r), (rank, r)
            done += steps
        _assert_same_states(resumed, reference)
        # The ranks' random streams differ: the check above has teeth.
        assert not torch.equal(reference[0][1]["rng"], reference[1][1]["rng"])


def test_a_run_moves_to_another_world_size_from_the_old_pools(tmp_path):
    # The same training on every rank (DDP-like), so the reference does not
    # depend on the world size: 2 ranks for 4 steps, then 3 ranks seeded from
    # the 2 ranks' pools for 3 more, against 7 uninterrupted steps.
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        old, new = os.path.join(d, "two.{rank}.pool"), os.path.join(d, "three.{rank}.pool")
        reference = run_ranks(1, lambda r, w: _sharded_run(r, w, os.path.join(d, "ref.pool"), 7,
                                                           False))[0][1]
        run_ranks(2, lambda r, w: _sharded_run(r, w, old, 4, False))
        moved = run_ranks(3, lambda r, w: _sharded_run(r, w, new, 3, False, init_from=old))
        for rank, ((start, _), state) in enumerate(moved):
            assert start == 4, rank
            for key in reference:
                if torch.is_tensor(reference[key]):
                    assert torch.equal(state[key], reference[key]), (rank, key)
        # The old run's pools are untouched: they still restore.
        assert pmsnap.load_state_dict(old)["pmsnap"]["iteration"] == 4


class _BagModel(torch.nn.Module):
    ROWS = 4000

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bag = torch.nn.EmbeddingBag(self.ROWS, 8, mode="sum")
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, ids, offsets):
        return self.fc(self.bag(ids, offsets))


def _bag_table(model, optimizer):
    """The table and its row-shaped Adagrad state."""
    return {"param": model.bag.weight.detach().clone(),
            "sum": optimizer.state[model.bag.weight]["sum"].clone()}


def _embedding_ddp_run(rank, world, pool, policy, rows, first, last, restore):
    """One rank of a DDP job (plain training when alone) whose nn.EmbeddingBag
    is checkpointed under embedding `policy` every step, its changed rows
    found as `rows` says; returns the restored iteration and table, and the
    table after each step first..last."""
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(1)
    model = _BagModel()
    forward = DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    restored, tables = (None, None), {}
    with pmsnap.CheckpointedOptimizer(optimizer, pool, model=model, every=1, workers=1,
                                      embedding_policy=policy, embedding_rows=rows,
                                      retain=3) as opt:
        if restore:
            iteration, _ = opt.restore()
            restored = (iteration, _bag_table(model, optimizer))
        for step in range(first, last + 1):
            g = torch.Generator().manual_seed(100 * step + rank)
            ids = (torch.rand(64, generator=g) ** 3 * _BagModel.ROWS).long()
            offsets = torch.arange(0, 64, 4)
            forward(ids, offsets).square().mean().backward()
            opt.step()
            opt.zero_grad()
            tables[step] = _bag_table(model, optimizer)
    return restored, tables


@pytest.mark.parametrize("policy,rows", [("incrcp", "gradients"), ("intermittent", "gradients"),
                                         ("intermittent", "auto")])
def test_ddp_ranks_keep_checkpointing_a_table_whose_newest_epoch_a_restore_rolled_back(policy,
                                                                                      rows):
    """Under DDP each rank checkpoints its own copy of the table. Rank 0
    commits iteration 5 alone, the ranks restore iteration 4 (rank 0's 5 is
    rolled back) and train on: rank 0's next checkpoints used to build on
    the dropped epoch's table index (IncrCP read its freed chunks and
    the step failed; the differentials listed the dropped checkpoint
    beside the new one). embedding_rows "auto" used to take this rank's
    lookups, which miss the rows the other rank's averaged gradient
    changed: 140 of the recovered rows differed from the live table."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        pool = os.path.join(d, "run.{rank}.pool")
        first = run_ranks(2, lambda r, w: _embedding_ddp_run(r, w, pool, policy, rows, 1, 4,
                                                             False))
        run_ranks(1, lambda r, w: _embedding_ddp_run(r, w, pool.format(rank=0), policy, rows, 5,
                                                     5, True))
        resumed = run_ranks(2, lambda r, w: _embedding_ddp_run(r, w, pool, policy, rows, 5, 6,
                                                               True))
        for rank in range(2):
            (iteration, table), tables = resumed[rank]
            assert iteration == 4, rank
            tables[4] = first[rank][1][4]
            for role in table:
                assert torch.equal(table[role], tables[4][role]), (rank, role)
            path = pool.format(rank=rank)
            checkpoints = pmsnap.list_checkpoints(path, "bag.weight")
            assert [c["iteration"] for c in checkpoints] == [4, 5, 6], (rank, checkpoints)
            for c in checkpoints:
                state = pmsnap.recover_table(path, "bag.weight", c["epoch"], state=True)
                for role, tensor in tables[c["iteration"]].items():
                    assert torch.equal(state[role], tensor), (rank, c, role)


def test_sharding_options_are_checked():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(pmsnap.InvalidArgumentError, match="sharding"):
        pmsnap.CheckpointedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "/dev/shm/x",
                                     sharding="zero")
    with pytest.raises(pmsnap.InvalidArgumentError, match="replicas"):
        pmsnap.CheckpointedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "/dev/shm/x",
                                     replicas=2)


def test_coordinator_needs_torch_distributed():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with pytest.raises(pmsnap.FailedPreconditionError, match="init_process_group"):
        pmdist.TorchDistributedCoordinator()
