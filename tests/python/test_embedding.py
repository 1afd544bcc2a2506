"""Embedding tracking marks exactly the rows a step can change.

For nn.Embedding and nn.EmbeddingBag (with offsets, 2-D input, padding_idx)
the touched set must equal the unique looked-up ids, which are exactly the
rows with a non-zero gradient; clear() forgets them.
"""

import pytest
import torch

import pmsnap


class Tables(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(100, 4)
        self.bag = torch.nn.EmbeddingBag(1000, 4, mode="sum", padding_idx=0)
        self.bag2d = torch.nn.EmbeddingBag(70, 4, mode="mean")

    def forward(self, ids, bag_ids, offsets, bag2d_ids):
        return (self.emb(ids).sum() + self.bag(bag_ids, offsets).sum()
                + self.bag2d(bag2d_ids).sum())


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (3, 5), generator=g)
    bag_ids = torch.randint(0, 1000, (20,), generator=g)
    bag_ids[3] = 0  # padding row: looked up, never updated
    offsets = torch.tensor([0, 7, 12])
    bag2d_ids = torch.randint(0, 70, (4, 3), generator=g, dtype=torch.int32).long()
    return ids, bag_ids, offsets, bag2d_ids


def nonzero_grad_rows(weight):
    return torch.nonzero(weight.grad.abs().sum(dim=1)).flatten()


def test_touched_rows_are_the_rows_with_gradients():
    model = Tables()
    with pmsnap.EmbeddingTracker(model) as tracker:
        assert sorted(tracker.tables) == ["bag", "bag2d", "emb"]
        for seed in range(3):
            model(*inputs(seed)).backward()
        ids = [inputs(s) for s in range(3)]
        expect_emb = torch.unique(torch.cat([i[0].flatten() for i in ids]))
        expect_bag = torch.unique(torch.cat([i[1] for i in ids]))
        expect_bag = expect_bag[expect_bag != 0]
        assert torch.equal(tracker.touched("emb"), expect_emb)
        assert torch.equal(tracker.touched("bag"), expect_bag)
        assert torch.equal(tracker.touched("emb"), nonzero_grad_rows(model.emb.weight))
        assert torch.equal(tracker.touched("bag"), nonzero_grad_rows(model.bag.weight))
        assert torch.equal(tracker.touched("bag2d"), nonzero_grad_rows(model.bag2d.weight))
        assert tracker.touched_count("emb") == expect_emb.numel()
        assert 0 < tracker.touched_fraction("bag") < 1
        tracker.clear("emb")
        assert tracker.touched_count("emb") == 0 and tracker.touched_count("bag") > 0
        tracker.clear()
        assert tracker.touched("bag").numel() == 0
    # Hooks are gone after the with-block.
    model(*inputs(5))
    assert tracker.touched_count("emb") == 0


def test_int32_ids_and_keyword_call():
    emb = torch.nn.Embedding(10, 2)
    tracker = pmsnap.EmbeddingTracker(None, modules={"e": emb})
    emb(torch.tensor([1, 3, 3], dtype=torch.int32))
    assert tracker.touched("e").tolist() == [1, 3]
    with pytest.raises(ValueError, match="positionally"):
        emb(input=torch.tensor([2]))
    tracker.remove()


def test_tracker_attached_to_checkpointed_optimizer(pool_path):
    model = Tables()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    with pmsnap.CheckpointedOptimizer(opt, pool=pool_path, model=model,
                                      track_embeddings=True) as copt:
        for seed in range(3):
            copt.zero_grad()
            model(*inputs(seed)).backward()
            copt.step()
        touched = copt.embedding_tracker.touched("emb")
        assert touched.numel() > 0
    assert copt.stats()["steps"] >= 2
