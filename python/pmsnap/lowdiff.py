"""LowDiff: compressed gradients reused as differential checkpoints.

Paper 002 (LowDiff, section V): in data-parallel training with gradient
compression, the synchronized compressed gradient of iteration t, once
decompressed and given to the optimizer, is exactly what turns the model of
iteration t-1 into the model of iteration t. So it is a differential
checkpoint that costs no extra compression. LowDiff:

  * registers a DDP communication hook that compresses (PowerSGD, torch's
    own hook wrapped, or TopK, a sparsifier with error feedback written
    here) and keeps a *reference* to each bucket's synchronized compressed
    gradient: no copy on the training thread;
  * at step() hands those references to the pool's differential log
    (C++ diff::DifferentialLog, through _pmsnap): its worker copies them
    into a host batch buffer and writes b differentials as one chunk of the
    pool's chunk heap; step() waits at its end until they were copied (and,
    for the differential that completes a batch, written), so the buffers may
    be reused by the next backward and a crash loses at most b-1
    differentials;
  * takes a full checkpoint every 1/f steps through CheckpointedOptimizer
    (mode "every": the weight-grained path), and frees differentials older
    than the second-newest full checkpoint;
  * tunes f and b with Eq. 10 from measured W (pool write rate of full
    checkpoints), S (full checkpoint bytes) and R_D (one differential's merge:
    the optimizer step on its gradient, measured every step), the iteration
    time, and the configured MTBF M and world size N (stats()), 10 steps
    after the start (or the restored iteration) and at every full
    checkpoint's step, within what the chunk heap holds; with several ranks
    every rank takes the smallest b, then the smallest interval, any rank
    proposes (each rank's engine must ask for the same full checkpoints);
  * restore(): the newest full checkpoint (every rank the same, as
    CheckpointedOptimizer.restore), then each retained differential in order:
    decompress, then the optimizer's own step on the decompressed gradient.
    Training applied that same gradient with that same step, so the result is
    bit-exact. Ranks replay to the newest iteration all of them hold.

What recovery does not bring back: the compressor's own state (error-feedback
residuals, PowerSGD's warm-start Q). It is per rank, as large as the model,
and changes every step; persisting it would cost what compression saves. The
restored model and optimizer state are bit-exact; the resumed run's error
feedback starts from zero (docs/ARCHITECTURE.md, "LowDiff").

merge="parallel" replays plain SGD (no momentum, weight decay, nesterov or
maximize: w <- w - lr * g, an additive update) with the paper's log-n pairwise
merge (diff::MergeParallel): the updates -lr*g are summed pairwise in a tree
and added once. Float addition is not associative, so this equals the
sequential replay only where the sums are exact; any other optimizer (Adam's
moments depend on every earlier gradient; momentum too) replays sequentially.

Thread-safety: one training thread, like CheckpointedOptimizer.
"""

import contextlib
import math
import pickle
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import _pmsnap
from . import extra_state as _extra
from . import distributed as _distributed
from .errors import make_error
from .optimizer import CheckpointedOptimizer

# Piece dtype codes stored in the chunks (diff::DifferentialPiece::dtype).
_DTYPES = {torch.float32: 1, torch.int64: 2, torch.float16: 3, torch.bfloat16: 4,
           torch.float64: 5, torch.int32: 6, torch.uint8: 7}
_FROM_CODE = {v: k for k, v in _DTYPES.items()}
_EXTRA_CODE = 255  # pickled {"user": extra_state, "param_groups": hyperparameters} of the step


# Kinds of a bucket's record (its descriptor piece's first entry).
_DENSE, _POWERSGD, _TOPK = 0, 1, 2


class Compressor:
    """Base of LowDiff's compressors: a DDP comm hook that also records, per
    bucket, the synchronized compressed gradient (descriptor + tensors, by
    reference), and the decompression that rebuilds the gradient DDP gave
    the optimizer bit for bit."""

    def __init__(self):
        self._records = []
        self._param_index = None
        self.compressed_bytes = 0  # bytes of the last iteration's records
        self.dense_bytes = 0  # bytes the same gradient takes uncompressed

    def attach(self, ddp):
        self._param_index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
        ddp.register_comm_hook(self, type(self)._hook)

    def take(self):
        """The records of the iteration whose backward just finished."""
        records, self._records = self._records, []
        return records

    def _bucket_params(self, bucket):
        return [self._param_index[id(p)] for p in bucket.parameters()]

    @staticmethod
    def _hook(state, bucket):
        raise NotImplementedError

    def decompress_bucket(self, kind, desc, tensors, params):
        """{param index: gradient} of one recorded bucket."""
        raise NotImplementedError


def _done(value):
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def _dense_record(bucket_params, buffer):
    return (torch.tensor([_DENSE, len(bucket_params)] + bucket_params, dtype=torch.int64), [buffer])


def _split(flat, params, shapes):
    out, at = {}, 0
    for i in params:
        n = math.prod(shapes[i])
        out[i] = flat[at:at + n].view(shapes[i])
        at += n
    return out


class PowerSGD(Compressor):
    """torch's PowerSGD hook (ddp_comm_hooks.powerSGD_hook), wrapped: after
    its future completes, the synchronized P and Q (state.p_memory_dict /
    q_memory_dict of the bucket) and the uncompressed (rank-1) gradients are
    recorded by reference. Before start_powerSGD_iter the hook allreduces
    uncompressed: those iterations record the dense bucket."""

    def __init__(self, process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                 min_compression_rate=2, use_error_feedback=True, warm_start=True,
                 orthogonalization_epsilon=0, random_seed=0, batch_tensors_with_same_shape=False):
        super().__init__()
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        self._psgd = psgd
        self.state = psgd.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start_powerSGD_iter, min_compression_rate=min_compression_rate,
            use_error_feedback=use_error_feedback, warm_start=warm_start,
            orthogonalization_epsilon=orthogonalization_epsilon, random_seed=random_seed,
            batch_tensors_with_same_shape=batch_tensors_with_same_shape)
        self.name = f"powersgd-r{matrix_approximation_rank}"

    @staticmethod
    def _hook(self, bucket):
        state = self.state
        compressed = state.iter >= state.start_powerSGD_iter
        params = self._bucket_params(bucket)
        index = bucket.index()
        grads = bucket.gradients()
        # Which tensors the hook compresses: its own rule, on the same shapes.
        flags = []
        for g in grads:
            n, m = g.shape[0], g.numel() // g.shape[0]
            rank = min(n, m, state.matrix_approximation_rank)
            flags.append(int(self._psgd._should_compress(n, m, rank, state.min_compression_rate)[0]))
        # Waited for here: torch's hook issues its later all-reduces from
        # its future's callbacks, which gloo runs on its own threads, so with
        # several buckets the ranks could issue them in different orders
        # (a collective mismatch). One bucket at a time keeps the order.
        buffer = self._psgd.powerSGD_hook(state, bucket).wait()
        if not compressed:
            self._records.append(_dense_record(params, buffer))
        else:
            desc = torch.tensor([_POWERSGD, len(params)] + params
                                + [state.matrix_approximation_rank,
                                   int(state.batch_tensors_with_same_shape)] + flags,
                                dtype=torch.int64)
            tensors = [state.p_memory_dict[index], state.q_memory_dict[index]]
            tensors += [g for g, c in zip(grads, flags) if not c]  # views of the bucket
            self._records.append((desc, tensors))
        return _done(buffer)

    def decompress_bucket(self, kind, desc, tensors, params, shapes):
        if kind == _DENSE:
            return _split(tensors[0], params, shapes)
        n_params = len(params)
        rank, batched = desc[2 + n_params], bool(desc[3 + n_params])
        flags = desc[4 + n_params:4 + 2 * n_params]
        p_flat, q_flat, rest = tensors[0], tensors[1], list(tensors[2:])
        grads = {i: torch.empty(shapes[i], dtype=p_flat.dtype) for i in params}
        # The hook's own sequence (powerSGD_hook: group by shape, slice P and
        # Q in that order, bmm(p, q^T) into each matrix).
        shape_to_tensors = defaultdict(list)
        for i, c in zip(params, flags):
            if c:
                g = grads[i]
                shape_to_tensors[g.view(g.shape[0], -1).shape].append(g.view(g.shape[0], -1))
            else:
                grads[i].copy_(rest.pop(0).view(shapes[i]))
        p_idx = q_idx = 0
        for group in shape_to_tensors.values():
            batches = ([torch.stack(group)] if batched and len(group) > 1 else
                       [group[0].unsqueeze(0)] if batched else [t.unsqueeze(0) for t in group])
            for tensor in batches:
                b, n, m = tensor.shape
                r = min(n, m, rank)
                p = p_flat[p_idx:p_idx + b * n * r].view(b, n, r)
                q = q_flat[q_idx:q_idx + b * m * r].view(b, m, r)
                p_idx += b * n * r
                q_idx += b * m * r
                torch.bmm(p, q.transpose(1, 2), out=tensor)
                if tensor.shape[0] > 1:
                    for j, original in enumerate(group):
                        original.copy_(tensor[j])
        return grads


class TopK(Compressor):
    """Top-k sparsification with error feedback, as a DDP comm hook: each
    rank adds its residual to the bucket, keeps the k = ceil(ratio * numel)
    largest magnitudes, all-gathers (values, indices) from every rank and
    averages them into the bucket; what was not sent becomes the residual.
    The gathered values and indices are the synchronized compressed
    gradient."""

    def __init__(self, ratio=0.01, error_feedback=True, process_group=None):
        super().__init__()
        if not 0 < ratio <= 1:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"TopK ratio must be in (0, 1], got {ratio!r}")
        self.ratio = ratio
        self.error_feedback = error_feedback
        self.process_group = process_group
        self._errors = {}
        self.name = f"topk-{ratio:g}"

    @staticmethod
    def _hook(self, bucket):
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        buf = bucket.buffer()
        params = self._bucket_params(bucket)
        index = bucket.index()
        if self.error_feedback:
            err = self._errors.get(index)
            if err is None or err.numel() != buf.numel():
                err = torch.zeros_like(buf)
                self._errors[index] = err
            buf.add_(err)
        k = max(1, math.ceil(self.ratio * buf.numel()))
        _, indices = torch.topk(buf.abs(), k, sorted=False)
        values = buf[indices]
        if self.error_feedback:
            err.copy_(buf)
            err[indices] = 0
        gathered_v = [torch.empty_like(values) for _ in range(world)]
        gathered_i = [torch.empty_like(indices) for _ in range(world)]
        # Synchronous, bucket by bucket: the same collective order on every
        # rank (see PowerSGD._hook).
        dist.all_gather(gathered_v, values, group=group)
        dist.all_gather(gathered_i, indices, group=group)
        buf.copy_(TopK._decompress(gathered_v, gathered_i, buf.numel(), buf.dtype))
        desc = torch.tensor([_TOPK, len(params)] + params + [buf.numel(), world],
                            dtype=torch.int64)
        self._records.append((desc, gathered_v + gathered_i))
        return _done(buf)

    @staticmethod
    def _decompress(values, indices, numel, dtype):
        # Per rank the indices are distinct (topk), so each index_add_ has no
        # duplicate and the sum order is fixed: rank 0, 1, ...
        dense = torch.zeros(numel, dtype=dtype)
        for v, i in zip(values, indices):
            dense.index_add_(0, i, v)
        return dense.div_(len(values))

    def decompress_bucket(self, kind, desc, tensors, params, shapes):
        if kind == _DENSE:
            return _split(tensors[0], params, shapes)
        n_params = len(params)
        numel, world = desc[2 + n_params], desc[3 + n_params]
        dense = TopK._decompress(tensors[:world], tensors[world:], numel, tensors[0].dtype)
        return _split(dense, params, shapes)


def _pieces_of(records, extra, param_groups):
    """(pieces for the log, tensors to keep alive until copied). The last
    piece holds the user's extra state and the param groups' hyperparameters
    this step ran with: replay must step with the same learning rate (an LR
    scheduler changes it between full checkpoints)."""
    pieces, keep = [], []
    for desc, tensors in records:
        for t in [desc] + list(tensors):
            if not t.is_contiguous():
                raise make_error(_pmsnap.InternalError, "LowDiff: a compressed piece is not contiguous")
            pieces.append((t.data_ptr(), t.numel() * t.element_size(), _DTYPES[t.dtype],
                           list(t.shape)))
            keep.append(t)
    blob = pickle.dumps({"user": extra, "param_groups": param_groups})
    holder = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    pieces.append((holder.data_ptr(), len(blob), _EXTRA_CODE, [len(blob)]))
    keep.append(holder)
    return pieces, keep


def _tensor_of(dtype_code, shape, data):
    t = torch.frombuffer(bytearray(data), dtype=_FROM_CODE[dtype_code]) if data else \
        torch.empty(0, dtype=_FROM_CODE[dtype_code])
    return t.view(shape)


def _is_plain_sgd(optimizer):
    if type(optimizer) is not torch.optim.SGD:
        return False
    return all(g.get("momentum", 0) == 0 and g.get("weight_decay", 0) == 0
               and not g.get("nesterov", False) and not g.get("maximize", False)
               for g in optimizer.param_groups)


class LowDiff:
    """Checkpoints a DDP job every step: full checkpoints every `full_every`
    steps (None: round(1/f*) of Eq. 10 within the chunk heap, tuned as it
    runs, the same on every rank), and every step's synchronized compressed
    gradient as a differential in batches of `batch` (None: b* of Eq. 10,
    likewise).

      optimizer, pool: as CheckpointedOptimizer ("{rank}" in the path gives
        every rank its own pool).
      ddp_model: the DistributedDataParallel model; LowDiff registers the
        compressor's hook on it (it must have none yet).
      compressor: a PowerSGD or TopK instance.
      mtbf_seconds, world_size: M and N of Eq. 8-10 (world size default: the
        process group's).
      merge: "sequential" (default; bit-exact for every optimizer) or
        "parallel" (plain SGD only, see the module doc).
      chunk_heap_bytes: the budget for differential chunks of a pool created
        here. The log keeps every differential since the second-newest full
        checkpoint, up to 3 * full_every + batch of them while a full
        checkpoint commits, so tuned values are capped to what fits
        (stats()["heap_max_full_every"]); a fixed full_every that does not
        fit fails with NoSpaceError naming the rank, full_every and the
        pool's heap size.
      Other keyword arguments go to CheckpointedOptimizer (device, workers...;
        sharding="replicated" splits each full checkpoint over the ranks, while
        every rank logs every differential).
    """

    def __init__(self, optimizer, pool, ddp_model, compressor, *, full_every=None, batch=None,
                 mtbf_seconds=3600.0, world_size=None, merge="sequential",
                 chunk_heap_bytes=256 << 20, initial_full_every=50, initial_batch=4,
                 max_batch=64, **kwargs):
        if not isinstance(ddp_model, DistributedDataParallel):
            raise make_error(_pmsnap.InvalidArgumentError,
                             "LowDiff reuses the gradients DDP synchronizes: ddp_model must be a "
                             f"torch.nn.parallel.DistributedDataParallel, got "
                             f"{type(ddp_model).__name__} (compression without DDP has no "
                             "synchronized compressed gradient to reuse)")
        if not isinstance(compressor, Compressor):
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"compressor {compressor!r} is not a pmsnap.lowdiff compressor "
                             "(PowerSGD or TopK): LowDiff must read the synchronized compressed "
                             "gradient from its own hook")
        hooks = getattr(ddp_model, "_comm_hooks", [])
        if hooks:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"the DDP model already has the comm hook {hooks[0][0]!r}, which is "
                             "not LowDiff's: LowDiff registers the compressor's hook itself "
                             "(construct DDP without a hook)")
        if not (isinstance(mtbf_seconds, (int, float)) and math.isfinite(mtbf_seconds)
                and mtbf_seconds > 0):
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"mtbf_seconds must be a positive number of seconds, got "
                             f"{mtbf_seconds!r}")
        if merge not in ("sequential", "parallel"):
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"merge must be 'sequential' or 'parallel', got {merge!r}")
        if merge == "parallel" and not _is_plain_sgd(optimizer):
            raise make_error(_pmsnap.InvalidArgumentError,
                             "merge='parallel' needs an additive update (torch.optim.SGD without "
                             f"momentum, weight decay, nesterov or maximize); got "
                             f"{type(optimizer).__name__}: replay sequentially")
        for name, value in (("full_every", full_every), ("batch", batch)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise make_error(_pmsnap.InvalidArgumentError,
                                 f"{name} must be None (Eq. 10) or an int >= 1, got {value!r}")
        self.optimizer = optimizer
        self.ddp_model = ddp_model
        self.compressor = compressor
        self.merge = merge
        self.mtbf_seconds = float(mtbf_seconds)
        self.world_size = int(world_size or (dist.get_world_size() if dist.is_initialized() else 1))
        # every=1 so that the first step (or the pool's state after restore)
        # is a full checkpoint the differentials can build on; then every
        # full_every steps (set by the controller).
        self.ckpt = CheckpointedOptimizer(optimizer, pool, model=ddp_model.module, every=1,
                                          chunk_heap_bytes=chunk_heap_bytes, **kwargs)
        self._params = list(ddp_model.module.parameters())
        self._shapes = [tuple(p.shape) for p in self._params]
        compressor.attach(ddp_model)
        # Ranks agree on tuned values over a gloo group of LowDiff's own
        # (created on every rank together, as LowDiff itself is): the
        # engine's coordinator keeps an all-reduce in flight across the step.
        self._agreement = None
        if (full_every is None or batch is None) and self.ckpt.coordinator is not None:
            self._agreement = _distributed.TorchDistributedCoordinator(kwargs.get("process_group"))
        # The full-checkpoint steps, retirement, Eq. 10 and the agreement are
        # diff::LowDiffController's, shared with the C++ front end.
        self._controller = _pmsnap.LowDiffController(
            full_every=full_every or 0, initial_full_every=initial_full_every,
            batch=batch or 0, initial_batch=initial_batch, max_batch=max_batch,
            mtbf_seconds=self.mtbf_seconds, world_size=self.world_size,
            agreement=self._agreement, set_full_interval=self.ckpt.set_full_interval)
        self._log = None
        self._resume_after = None

    @property
    def iteration(self):
        return self.ckpt.iteration

    def zero_grad(self, set_to_none=True):
        self.ckpt.zero_grad(set_to_none=set_to_none)

    def step(self, extra_state=None):
        """One optimizer step on the DDP-synchronized (decompressed)
        gradients; its compressed form becomes the differential of this
        iteration. `extra_state` (a picklable dict) is stored with it and
        with full checkpoints."""
        began = time.perf_counter()
        records = self.compressor.take()
        if not records:
            raise make_error(_pmsnap.FailedPreconditionError,
                             "LowDiff.step(): no compressed gradient for this step; run "
                             "backward through the DDP model (with LowDiff's hook) first")
        step = self.ckpt.iteration + 1
        keep = None
        if self._log is not None:
            pieces, keep = _pieces_of(records, extra_state or {},
                                      _extra.param_group_hyperparameters(self.optimizer))
            self._controller.count_handed(sum(p[1] for p in pieces))
            with self._heap_advice():
                self._log.append(step, pieces)
        self.ckpt.step(extra_state=extra_state)
        if self._log is None:
            # The first step opened the pool with a full checkpoint of it.
            self._open_log(self._resume_after)
        else:
            with self._heap_advice():
                self._log.wait_copied(step)
            del keep
        self._controller.observe(self.ckpt.iteration, time.perf_counter() - began,
                                 self.ckpt.stats())

    @property
    def full_every(self):
        """The full-checkpoint interval in force (tuned unless fixed)."""
        return self._controller.full_every

    @property
    def batch(self):
        """Differentials per chunk in force (tuned unless fixed)."""
        return self._controller.batch

    def _open_log(self, resume_after, full_iteration=None):
        self._log = self.ckpt.open_differential_log(self.batch, resume_after)
        self._controller.attach(self._log, resume_after, full_iteration)

    @contextlib.contextmanager
    def _heap_advice(self):
        """A full chunk heap, explained in LowDiff's terms."""
        try:
            yield
        except _pmsnap.NoSpaceError as e:
            heap = self._log.stats()["heap_capacity_bytes"]
            lower = ("lower full_every" if not self._controller.tunes_full_every else
                     "lower initial_full_every (tuned values are capped to the heap)")
            rank = f"rank {dist.get_rank()}: " if self.world_size > 1 else ""
            raise make_error(_pmsnap.NoSpaceError,
                             f"{rank}{e}; LowDiff keeps every differential since the "
                             f"second-newest full checkpoint (full_every={self.full_every}, "
                             f"batch={self.batch}: up to {3 * self.full_every + self.batch} "
                             f"differentials while a full checkpoint commits): {lower}, or give "
                             f"the pool a larger chunk heap than its {heap} bytes "
                             "(chunk_heap_bytes= when the pool is created)") from e

    def restore(self, restore_rng=True):
        """Restores the newest full checkpoint and replays the differentials
        after it (every rank to the same iteration). Returns (iteration,
        extra_state of that iteration, {"full": full checkpoint's iteration,
        "replayed": differentials replayed, "seconds": replay time}).
        Before the first step(); NotFoundError as CheckpointedOptimizer."""
        full, extra = self.ckpt.restore(restore_rng=restore_rng)
        began = time.perf_counter()
        diffs = self.ckpt.read_differentials(full)
        reach = _pmsnap.LowDiffController.agree_on_replay_reach(self.ckpt.coordinator, full,
                                                                len(diffs))
        diffs = diffs[:reach - full]
        if diffs:
            extra = self._replay(diffs) or extra
        self.ckpt.resume_at(reach)
        self._resume_after = reach
        self._open_log(reach, full)
        return reach, extra, {"full": full, "replayed": len(diffs),
                              "seconds": time.perf_counter() - began}

    def _gradients_of(self, pieces):
        """{param index: gradient}, the user's extra state and the param
        groups' hyperparameters of one differential."""
        tensors = [(code, data if code == _EXTRA_CODE else _tensor_of(code, shape, data))
                   for code, shape, data in pieces]
        grads, extra, groups, at = {}, None, None, 0
        while at < len(tensors):
            code, t = tensors[at]
            if code == _EXTRA_CODE:
                saved = pickle.loads(t)
                extra, groups = saved["user"], saved["param_groups"]
                at += 1
                continue
            desc = t.tolist()
            kind, n_params = desc[0], desc[1]
            params = desc[2:2 + n_params]
            if kind == _DENSE:
                count = 1
            elif kind == _POWERSGD:
                flags = desc[4 + n_params:4 + 2 * n_params]
                count = 2 + sum(1 for c in flags if not c)
            else:
                count = 2 * desc[3 + n_params]
            data = [x for _, x in tensors[at + 1:at + 1 + count]]
            grads.update(self.compressor.decompress_bucket(kind, desc, data, params, self._shapes))
            at += 1 + count
        return grads, extra, groups

    def _apply_param_groups(self, groups):
        """Gives the optimizer's param groups the hyperparameters a
        differential's step ran with."""
        for group, saved in zip(self.optimizer.param_groups, groups):
            group.update(saved)

    def _replay(self, diffs):
        extra = None
        saved = [p.grad for p in self._params]
        try:
            if self.merge == "parallel":
                return self._replay_parallel(diffs)
            for _, pieces in diffs:
                grads, extra, groups = self._gradients_of(pieces)
                self._apply_param_groups(groups)
                for i, p in enumerate(self._params):
                    p.grad = grads.get(i)
                self.ckpt.replay_step()
        finally:
            for p, g in zip(self._params, saved):
                p.grad = g
        return extra

    def _replay_parallel(self, diffs):
        """Plain SGD: w <- w + sum_j(-lr * g_j), the sum a log-n pairwise tree."""
        extra = None
        deltas = defaultdict(list)
        group_of = {}
        for gi, g in enumerate(self.optimizer.param_groups):
            for p in g["params"]:
                group_of[id(p)] = gi
        for _, pieces in diffs:
            grads, extra, groups = self._gradients_of(pieces)
            self._apply_param_groups(groups)
            lr = [g["lr"] for g in self.optimizer.param_groups]
            for i, g in grads.items():
                p = self._params[i]
                deltas[i].append(g.mul(-lr[group_of[id(p)]]).contiguous())
        with torch.no_grad():
            for i, ds in deltas.items():
                w = self._params[i].data
                _pmsnap.merge_parallel(w.data_ptr(), w.numel(), [d.data_ptr() for d in ds])
        return extra

    def flush(self):
        """Writes every differential appended so far and waits for the full
        checkpoint in flight."""
        if self._log is not None:
            self._log.flush()
        self.ckpt.flush()

    def close(self, abandon=False):
        """Writes the buffered differentials (unless abandon) and closes the pool."""
        self.ckpt.close(abandon=abandon)

    def stats(self):
        """CheckpointedOptimizer's stats under "engine", the differential
        log's, and the Eq. 10 configuration with its measured inputs."""
        out = {"engine": self.ckpt.stats(), "compressor": self.compressor.name,
               "max_loss": self.batch - 1, "mtbf_seconds": self.mtbf_seconds,
               "world_size": self.world_size}
        out.update(self._controller.stats())
        if self._log is not None:
            out["log"] = self._log.stats()
        return out

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(abandon=exc_type is not None)
        return False
