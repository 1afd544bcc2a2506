"""pmsnap.LowDiffPlus: gradients snapshotted as they are synchronized, the
optimizer applied again to a host replica whose every iteration commits into
the pool. On the host device the replica must equal the trained model bitwise;
the pool it writes is an ordinary pool (restore, load_state_dict, the CLI).
The SIGKILL resume of 2-rank DDP is in test_ddp_resume.py."""

import functools
import os
import subprocess
import sys

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import conftest
import pmsnap
from conftest import make_model


def run_ranks(world, body):
    """In spawned processes: this process has run engines, and a child
    forked after oneTBB started its worker threads has none."""
    return conftest.run_ranks(world, body, start_method="spawn")


def batch(step, rank=0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 12, generator=g)
    return x, x.sum(dim=1, keepdim=True).repeat(1, 4).sin()


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9,
                                                   nesterov=True, weight_decay=1e-3),
    "adam_foreach": lambda params: torch.optim.Adam(params, lr=1e-2, foreach=True),
}


def assert_replica_equals_model(plus, model, optimizer, where=""):
    """Bitwise: every parameter and every optimizer-state tensor."""
    plus.flush()
    named = dict(model.named_parameters())
    for name, rp in plus.replica:
        assert torch.equal(rp, named[name].detach()), f"{where}replica '{name}' differs"
        live = optimizer.state[named[name]]
        copy = plus.replica_optimizer.state[rp]
        assert sorted(live) == sorted(copy), name
        for key, value in live.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(copy[key])), \
                f"{where}replica state '{name}'.{key} differs"


def assert_pool_holds_model(path, model, optimizer):
    """The pool's newest checkpoint, read without LowDiffPlus, is the model."""
    sd = pmsnap.load_state_dict(path)
    for name, p in model.named_parameters():
        assert torch.equal(sd["model"][name], p.detach()), name
    by_name = dict(model.named_parameters())
    for name, state in sd["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value),
                               torch.as_tensor(optimizer.state[by_name[name]][key])), \
                f"pool state {name}.{key}"


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_replica_equals_the_trained_model_bitwise_without_ddp(pool_path, kind):
    model = make_model()
    optimizer = OPTIMIZERS[kind](model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    with pmsnap.LowDiffPlus(model, optimizer, pool_path) as plus:
        for step in range(1, 11):
            x, y = batch(step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            plus.step(extra_state={"batch": step})
            optimizer.zero_grad()
            scheduler.step()  # the replica follows the learning rate of each step
            if step in (1, 4):
                assert_replica_equals_model(plus, model, optimizer, f"step {step}: ")
        assert_replica_equals_model(plus, model, optimizer)
        s = plus.stats()["lowdiff_plus"]
        grad_bytes = sum(p.numel() * 4 for p in model.parameters())
        assert s["gradient_bytes_per_iteration"] == grad_bytes
        assert s["gradient_bytes_snapshotted"] == 10 * grad_bytes
        assert s["full_state_bytes"] > grad_bytes  # what a full checkpoint moves
    assert pmsnap.read_pool(pool_path)["latest"]["iteration"] == 10
    assert_pool_holds_model(pool_path, model, optimizer)


def _ddp_replica_run(rank, world, pool, kind, steps):
    torch.set_num_threads(1)
    model = make_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
    optimizer = OPTIMIZERS[kind](model.parameters())
    plus = pmsnap.LowDiffPlus(ddp, optimizer, pool)
    for step in range(1, steps + 1):
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        plus.step(extra_state={"batch": step})
        optimizer.zero_grad(set_to_none=step % 2 == 0)
    assert_replica_equals_model(plus, model, optimizer, f"rank {rank}: ")
    plus.close()
    assert_pool_holds_model(plus.pool, model, optimizer)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum"])
def test_replica_equals_the_trained_model_bitwise_in_two_rank_ddp(pool_path, kind):
    template = pool_path.replace(".pool", ".{rank}.pool")
    try:
        results = run_ranks(2, functools.partial(_ddp_replica_run, pool=template, kind=kind,
                                                 steps=8))
    finally:
        for r in range(2):
            if os.path.exists(template.format(rank=r)):
                os.remove(template.format(rank=r))
    for a, b in zip(*results):
        assert torch.equal(a, b)  # DDP kept the ranks equal, and so did the replicas


def _sharded_replica_run(rank, world, pool, steps, restore_after):
    """Trains `steps` iterations with a sharded replica; then, in a fresh
    LowDiffPlus over a model with other values, restores from the ranks'
    pools. Returns what each rank saw."""
    torch.set_num_threads(1)
    model = make_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    plus = pmsnap.LowDiffPlus(ddp, optimizer, pool, sharding="replicated")
    assert len(plus.replica_shard) == len(list(model.parameters()))  # before the first commit
    for step in range(1, steps + 1):
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        plus.step(extra_state={"batch": step})
        optimizer.zero_grad()
    plus.flush()
    shard = plus.replica_shard
    named = dict(model.named_parameters())
    # The shard's parameters and state are current, bitwise; the others
    # stopped at the first iterations (their gradients are not even copied).
    stale = [name for name, rp in plus.replica if not torch.equal(rp, named[name].detach())]
    assert sorted(stale) == sorted(set(named) - set(shard)), (stale, shard)
    for name, rp in plus.replica:
        # Stepped once or twice (the iterations before the shares were known), not since.
        replica_steps = int(plus.replica_optimizer.state[rp]["step"])
        assert replica_steps == steps if name in shard else replica_steps <= 2, (name, replica_steps)
    for name, rp in plus.replica:
        if name in shard:
            for key, value in optimizer.state[named[name]].items():
                assert torch.equal(torch.as_tensor(value),
                                   torch.as_tensor(plus.replica_optimizer.state[rp][key])), name
    snapshotted = plus.stats()["lowdiff_plus"]["gradient_bytes_snapshotted"]
    plus.close()
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}

    fresh = make_model(seed=7)
    fresh_ddp = DistributedDataParallel(fresh, bucket_cap_mb=0.001)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    again = pmsnap.LowDiffPlus(fresh_ddp, fresh_opt, pool, sharding="replicated")
    iteration, extra = again.restore()
    restored_whole = all(torch.equal(p.detach(), trained[name])
                         for name, p in fresh.named_parameters())
    replica_whole = all(torch.equal(rp, trained[name]) for name, rp in again.replica)
    state_whole = all(
        torch.equal(torch.as_tensor(v), torch.as_tensor(optimizer.state[named[name]][k]))
        for name, p in fresh.named_parameters() for k, v in fresh_opt.state[p].items())
    # Training goes on from the restored state, the shard as before.
    for step in range(iteration + 1, iteration + restore_after + 1):
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(fresh_ddp(x), y).backward()
        again.step(extra_state={"batch": step})
        fresh_opt.zero_grad()
    again.close()
    return {"shard": shard, "snapshotted": snapshotted, "iteration": iteration,
            "batch": extra["batch"], "restored_whole": restored_whole,
            "replica_whole": replica_whole, "state_whole": state_whole,
            "shard_after_restore": again.replica_shard,
            "final": {n: p.detach().clone() for n, p in fresh.named_parameters()}}


def test_a_sharded_replica_steps_only_its_share_and_restores_the_whole_model(pool_path):
    template = pool_path.replace(".pool", ".{rank}.pool")
    steps = 6
    try:
        results = run_ranks(2, functools.partial(_sharded_replica_run, pool=template,
                                                 steps=steps, restore_after=2))
    finally:
        for r in range(2):
            if os.path.exists(template.format(rank=r)):
                os.remove(template.format(rank=r))
    names = [name for name, _ in make_model().named_parameters()]
    shards = [set(r["shard"]) for r in results]
    # Each parameter in exactly one rank's share, and every rank has some.
    assert all(shards) and not (shards[0] & shards[1]) and shards[0] | shards[1] == set(names)
    sizes = {name: p.numel() * 4 for name, p in make_model().named_parameters()}
    for r, shard in zip(results, shards):
        # The shares are known once iteration 1 committed: iteration 1, and
        # 2 if its backward ran before that, copy every gradient; from 3 on
        # (its copy waits for the replica of 1) only the rank's own.
        whole, own = sum(sizes.values()), sum(sizes[n] for n in shard)
        assert whole + (steps - 1) * own <= r["snapshotted"] <= 2 * whole + (steps - 2) * own
        assert (r["iteration"], r["batch"]) == (steps, steps)
        assert r["restored_whole"] and r["replica_whole"] and r["state_whole"], r
        assert set(r["shard_after_restore"]) == shard
    for name in names:
        assert torch.equal(results[0]["final"][name], results[1]["final"][name]), name


def test_restore_continues_bit_exact_and_other_readers_open_the_pool(pool_path):
    def train(model, optimizer, plus, first, last):
        for step in range(first, last + 1):
            x, y = batch(step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            plus.step(extra_state={"batch": step})
            optimizer.zero_grad()

    reference = make_model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(1, 9):
        x, y = batch(step)
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pmsnap.LowDiffPlus(model, optimizer, pool_path) as plus:
        train(model, optimizer, plus, 1, 5)
    # The pool is an ordinary pool: the CLI reads it.
    info = subprocess.run([sys.executable, "-m", "pmsnap", "info", pool_path],
                          capture_output=True, text=True)
    assert info.returncode == 0, info.stderr
    assert "latest          epoch 5 (iteration 5)" in info.stdout, info.stdout

    fresh = make_model(seed=7)  # other values: restore must overwrite them
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    plus = pmsnap.LowDiffPlus(fresh, fresh_opt, pool_path)
    iteration, extra = plus.restore()
    assert (iteration, extra["batch"]) == (5, 5)
    train(fresh, fresh_opt, plus, 6, 8)
    plus.close()
    for a, b in zip(reference.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    for key, state in ref_opt.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value),
                               torch.as_tensor(fresh_opt.state_dict()["state"][key][name]))

    # A plain CheckpointedOptimizer restores the replica's pool too.
    other = make_model(seed=3)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    with pmsnap.CheckpointedOptimizer(other_opt, pool_path, model=other) as opt:
        assert opt.restore()[0] == 8
        for a, b in zip(fresh.parameters(), other.parameters()):
            assert torch.equal(a, b)


def test_a_pool_with_checkpoints_is_not_overwritten_without_restore(pool_path):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pmsnap.LowDiffPlus(model, optimizer, pool_path) as plus:
        x, y = batch(1)
        torch.nn.functional.mse_loss(model(x), y).backward()
        plus.step()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plus = pmsnap.LowDiffPlus(model, optimizer, pool_path)
    x, y = batch(1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(pmsnap.FailedPreconditionError, match="already holds iteration 1"):
        plus.step()
    plus.close(abandon=True)


def _foreign_hook(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    return allreduce_hook(state, bucket)


def _ddp_configuration_errors(rank, world, pool):
    model = make_model()
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, _foreign_hook)
    messages = []
    try:
        pmsnap.LowDiffPlus(ddp, torch.optim.SGD(model.parameters(), lr=0.1), pool)
    except pmsnap.InvalidArgumentError as e:
        messages.append(str(e))
    return messages


def test_a_ddp_module_with_another_communication_hook_is_refused(pool_path):
    template = pool_path.replace(".pool", ".{rank}.pool")
    results = run_ranks(2, functools.partial(_ddp_configuration_errors, pool=template))
    for messages in results:
        assert len(messages) == 1 and "_foreign_hook" in messages[0], messages
    for r in range(2):
        assert not os.path.exists(template.format(rank=r))


def test_bad_configurations_raise_clear_errors(pool_path):
    model = make_model()
    stranger = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(pmsnap.InvalidArgumentError, match="not a parameter of the model"):
        pmsnap.LowDiffPlus(model, torch.optim.SGD(list(model.parameters()) + [stranger], lr=0.1),
                           pool_path)
    with pytest.raises(pmsnap.InvalidArgumentError, match="LBFGS"):
        pmsnap.LowDiffPlus(model, torch.optim.LBFGS(model.parameters()), pool_path)
    with pytest.raises(pmsnap.InvalidArgumentError, match="torch.optim.Optimizer"):
        pmsnap.LowDiffPlus(model, object(), pool_path)
    with pytest.raises(pmsnap.InvalidArgumentError, match="DistributedDataParallel"):
        pmsnap.LowDiffPlus("model", torch.optim.SGD(model.parameters(), lr=0.1), pool_path)
    with pytest.raises(pmsnap.InvalidArgumentError, match="update_in_backward"):
        pmsnap.LowDiffPlus(model, torch.optim.SGD(model.parameters(), lr=0.1), pool_path,
                           update_in_backward=True)
    assert not os.path.exists(pool_path)


def test_gradients_the_hooks_did_not_see_are_refused(pool_path):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pmsnap.LowDiffPlus(model, optimizer, pool_path) as plus:
        x, y = batch(1)
        torch.nn.functional.mse_loss(model(x), y).backward()
        plus.step()
        optimizer.zero_grad()
        # A gradient set by hand never went through the snapshot.
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        with pytest.raises(pmsnap.InvalidArgumentError, match="not handed over"):
            plus.step()
        optimizer.zero_grad()
        # A second backward before step() would be applied twice.
        x, y = batch(2)
        torch.nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(pmsnap.InvalidArgumentError, match="second gradient"):
            torch.nn.functional.mse_loss(model(x), y).backward()


def test_a_changed_optimizer_is_refused(pool_path):
    model = make_model()
    optimizer = torch.optim.SGD(list(model.parameters())[:-1], lr=0.1)
    with pmsnap.LowDiffPlus(model, optimizer, pool_path) as plus:
        optimizer.add_param_group({"params": [list(model.parameters())[-1]]})
        x, y = batch(1)
        torch.nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(pmsnap.InvalidArgumentError, match="param groups changed"):
            plus.step()


def test_a_closure_step_hands_its_gradients_over(pool_path):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pmsnap.LowDiffPlus(model, optimizer, pool_path) as plus:
        for step in range(1, 4):
            def closure():
                optimizer.zero_grad()
                x, y = batch(step)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss
            assert plus.step(closure) is not None
        assert_replica_equals_model(plus, model, optimizer)
