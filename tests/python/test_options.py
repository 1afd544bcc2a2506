"""CheckpointedOptimizer's keywords grouped in option objects
([architecture2] item 3): pmsnap.Tuning, pmsnap.PoolSettings and
pmsnap.Ranks reach the engine and the pool as the keywords do; the keywords
keep working; a value given twice, or an object of the wrong kind, is an
InvalidArgumentError naming it."""

import pytest
import torch

import pmsnap
from conftest import make_model, train_step


def _train(pool_path, steps=2, **kwargs):
    model = make_model()
    with pmsnap.CheckpointedOptimizer(torch.optim.Adam(model.parameters()), pool=pool_path,
                                      model=model, every=1, **kwargs) as copt:
        for step in range(steps):
            train_step(model, copt, step)
    return copt.stats()


def test_option_objects_reach_the_engine_and_the_pool(pool_path):
    stats = _train(pool_path, tuning=pmsnap.Tuning(strategy="2", part_bytes=64 << 10),
                   pool_settings=pmsnap.PoolSettings(extra_state_capacity=128 << 10),
                   ranks=pmsnap.Ranks())
    assert "2" in stats["strategy"] and stats["epochs_committed"] == 2
    info = pmsnap.read_pool(pool_path)
    assert info["part_bytes"] == 64 << 10
    assert info["extra_state_capacity"] == 128 << 10


def test_the_keywords_keep_working_and_agree_with_the_objects(pool_path, tmp_path):
    _train(pool_path, strategy="2", part_bytes=64 << 10, extra_state_capacity=128 << 10)
    by_keyword = pmsnap.read_pool(pool_path)
    other = str(tmp_path / "objects.pool")
    _train(other, tuning=pmsnap.Tuning(strategy="2", part_bytes=64 << 10),
           pool_settings=pmsnap.PoolSettings(extra_state_capacity=128 << 10))
    by_object = pmsnap.read_pool(other)
    for key in ("part_bytes", "extra_state_capacity"):
        assert by_keyword[key] == by_object[key]
    # A keyword beside an object that leaves that field at its default.
    stats = _train(str(tmp_path / "mixed.pool"), workers=1,
                   tuning=pmsnap.Tuning(strategy="2"))
    assert "2" in stats["strategy"]


def test_a_value_given_twice_or_the_wrong_object_is_refused(pool_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(pmsnap.InvalidArgumentError, match=r"workers given twice.*tuning="):
        pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, workers=1,
                                     tuning=pmsnap.Tuning(workers=2))
    with pytest.raises(pmsnap.InvalidArgumentError, match=r"replicas given twice.*ranks="):
        pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model, replicas=2,
                                     ranks=pmsnap.Ranks(sharding="replicated", replicas=3))
    with pytest.raises(pmsnap.InvalidArgumentError, match=r"pool_settings= must be a "
                                                          r"pmsnap.PoolSettings, got Tuning"):
        pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model,
                                     pool_settings=pmsnap.Tuning())
    # The checks inside still apply to a value from an object.
    with pytest.raises(pmsnap.InvalidArgumentError, match="unknown conflict strategy '7'"):
        pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model,
                                     tuning=pmsnap.Tuning(strategy="7"))
    with pytest.raises(pmsnap.InvalidArgumentError, match="replicas= needs sharding"):
        pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model,
                                     ranks=pmsnap.Ranks(replicas=2))
