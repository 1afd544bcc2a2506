"""Embedding tracking: which rows of each embedding table a step touched.

Differential and incremental checkpoint policies (docs/ARCHITECTURE.md,
"Embedding tables: diff/ and the chunk heap") write only the rows that changed.
A row of an nn.Embedding or nn.EmbeddingBag changes only if a lookup read it
(its gradient is zero otherwise), so a forward hook that marks every looked-up
id in a bit vector per table (a C++ RowTracker) finds them. `padding_idx` rows
are never updated by torch and are not marked.

    tracker = pmsnap.EmbeddingTracker(model)    # hooks every Embedding(Bag)
    ... forward / backward / step ...
    rows = tracker.touched("emb.0")             # sorted LongTensor of row ids
    tracker.clear()                             # e.g. after a checkpoint took them

Indices must reach the module positionally (emb(ids) or bag(ids, offsets)),
as nn.Module forward hooks see positional inputs only; a call passing them by
keyword raises ValueError rather than silently missing rows.

Thread-safety: marking happens in the forward pass on the training thread;
read and clear from that thread too.
"""

import torch
from torch import nn

from . import _pmsnap


class EmbeddingTracker:
    """Touched-row bit vectors for every nn.Embedding / nn.EmbeddingBag in a model."""

    def __init__(self, model, modules=None, *, ride_on=None):
        """Tracks `modules` ({name: module}) or every embedding module of `model`.

        ride_on: another EmbeddingTracker; the tables it hooks on the same
        modules are marked by its hooks instead of hooks of this one's (one
        hook per lookup, not two), until this one's remove()."""
        if modules is None:
            modules = {name: m for name, m in model.named_modules()
                       if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
        self._trackers = {}
        self._handles = []
        # Per hooked table: its module and the RowTrackers its hook marks
        # (this tracker's, then those of trackers riding on it).
        self._hooked = {}
        self._riding = []
        for name, module in modules.items():
            tracker = _pmsnap.RowTracker(module.num_embeddings)
            self._trackers[name] = tracker
            host = ride_on._hooked.get(name) if ride_on is not None else None
            if host is not None and host[0] is module:
                host[1].append(tracker)
                self._riding.append((host[1], tracker))
                continue
            marked = [tracker]
            self._hooked[name] = (module, marked)
            self._handles.append(module.register_forward_hook(self._hook(name, module, marked)))

    @staticmethod
    def _hook(name, module, marked):
        """The forward hook of table `name`: marks its looked-up rows in each
        RowTracker of `marked` (a list that riders join and leave)."""
        padding_idx = getattr(module, "padding_idx", None)

        def hook(mod, inputs, output):
            del mod, output
            if not inputs:
                raise ValueError(f"pmsnap: embedding '{name}' was called with its indices as a "
                                 "keyword argument; pass them positionally so they are tracked")
            ids = inputs[0]
            if not isinstance(ids, torch.Tensor):
                ids = torch.as_tensor(ids)
            if ids.is_cuda:
                ids = ids.cpu()
            if padding_idx is not None:
                ids = ids[ids != padding_idx]
            if ids.dtype not in (torch.int64, torch.int32):
                ids = ids.long()
            ids = ids.contiguous()
            pointer, count, dtype = ids.data_ptr(), ids.numel(), str(ids.dtype).replace("torch.", "")
            for tracker in marked:
                tracker.mark(pointer, count, dtype)

        return hook

    @property
    def tables(self):
        """Names of the tracked tables."""
        return list(self._trackers)

    def touched(self, name):
        """Sorted int64 tensor of the rows of table `name` touched since the last clear."""
        tracker = self._trackers[name]
        out = torch.empty(tracker.touched_count, dtype=torch.int64)
        if out.numel():
            tracker.touched_into(out.data_ptr(), out.numel())
        return out

    def row_tracker(self, name):
        """The _pmsnap.RowTracker of table `name` (CheckpointedOptimizer hands
        its rows to the embedding checkpointer with it)."""
        return self._trackers[name]

    def touched_count(self, name):
        return self._trackers[name].touched_count

    def touched_fraction(self, name):
        tracker = self._trackers[name]
        return tracker.touched_count / tracker.rows if tracker.rows else 0.0

    def clear(self, name=None):
        """Forgets the touched rows of table `name`, or of every table."""
        for table, tracker in self._trackers.items():
            if name is None or table == name:
                tracker.clear()

    def remove(self):
        """Removes the forward hooks, and stops riding on another tracker's
        (the bit vectors stay readable)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for marked, tracker in self._riding:
            marked.remove(tracker)
        self._riding = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False
