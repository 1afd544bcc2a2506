"""LowDiffPlus: gradients snapshotted layer by layer, a replica kept in the pool.

LowDiff+ (paper 002, section VI) checkpoints every iteration without moving
the model's state off the device: only the synchronized gradients leave it,
and the optimizer's update is applied a second time, on the CPU, to a replica
of the parameters and optimizer state that pmsnap persists.

    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plus = pmsnap.LowDiffPlus(ddp, opt, "/mnt/pmem/run.{rank}.pool")
    start = plus.restore()[1]["batch"] + 1 if pmsnap.has_checkpoint(plus.pool) else 1
    for step in range(start, steps + 1):
        loss = loss_fn(ddp(x), y); loss.backward()   # gradients handed over by bucket
        plus.step(extra_state={"batch": step})        # opt.step(), then the replica's turn
        opt.zero_grad()
    plus.close()

How an iteration flows:

1. Backward. DDP all-reduces its gradient buckets as layers finish. Our
   communication hook runs torch's own all-reduce hook (default_hooks.
   allreduce_hook: divide by the world size, all-reduce, the same arithmetic
   DDP applies without a hook) and, once the bucket's all-reduce completed,
   puts the synchronized bucket's per-parameter views on a queue. Nothing is
   copied there: the callback runs where the collective completes, and a copy
   in it would delay DDP's end of backward. Without DDP (a plain module),
   per-parameter post-accumulate-grad hooks hand each gradient over the same
   way.
2. The snapshot thread copies each handed gradient into one of two host
   gradient buffers (iteration t uses buffer t % 2) while backward goes on.
   This is the only traffic off the device: 1x the model's bytes per
   iteration, where checkpointing the model itself moves the parameters and
   every optimizer-state tensor (3x with Adam).
3. step() runs the training optimizer, then waits until this iteration's
   copies are done (they overlap backward and the update; the wait is what
   keeps the gradient tensors valid until they are copied: zero_grad or the
   next backward may overwrite them after step() returns), and hands the
   iteration to the replica thread with the hyperparameters of this step
   (an LR scheduler's value), which parameters had a gradient, the caller's
   extra_state and the RNG states taken on the training thread.
4. The replica thread applies the *same optimizer* (the same torch.optim
   class, every param-group hyperparameter and the foreach / fused flags
   copied) to the replica with that gradient, through a CheckpointedOptimizer
   on the replica: each replica weight is checkpointed into the pool as soon
   as it is updated, and the iteration commits as an epoch. The pool is an
   ordinary pmsnap pool (the parameters' names, their optimizer state), so
   restore(), pmsnap.restore / load_state_dict / export and `pmsnap info`
   work on it unchanged.

Where the replica lives (why not in the pool's slot itself). The replica is
host memory that the engine copies into the pool's next slot after every
update, rather than tensors mapped onto a slot: the engine's slots alternate
(an epoch writes slot e % 2 while the other holds the last commit), so a
replica updated in place inside a slot would have to be copied into the other
slot before every update anyway, and an update in place would leave a slot
half old, half new at a crash. Keeping the replica in host memory lets the
unchanged engine do what it does for every checkpoint: per-unit copies with
checksums, a commit word written last, recovery that takes the newest intact
slot. The bytes off the device stay 1x (gradients); host-to-PM traffic is the
full state, as for any full checkpoint.

Equality. On the host device the replica's update is the training update's
arithmetic on the same inputs (the same optimizer code on the same float
values, stepped per parameter by ParameterStepper, which is bitwise the same
as one step()), so after every iteration the replica equals the trained model
bitwise (tests/python/test_lowdiff_plus.py). On a GPU the training update runs
CUDA kernels (fused or foreach, FMA contraction, other reduction orders) and
the replica's runs CPU kernels: the replica then matches within float
tolerance, not bitwise, and a restore from it continues training from values
that may differ in the last bits. This was not run on a GPU.

Failure. After a crash of the training process (SIGKILL, an exception, a NaN
stop) the pool's newest committed epoch is the recovery point: restore() reads
it into the model and optimizer; nothing is replayed. A crash loses the
iterations whose replica update had not committed (at most two: the snapshot
buffers bound the lag).

Sharding (sharding="replicated", several ranks). Under DDP every rank's
replica is the same, so the ranks split it: the replica's CheckpointedOptimizer
gives each parameter an owner rank (balanced by bytes, as for any sharded
pool), and once the replica's pool is open (its first iteration) each rank
copies only the gradients of the parameters it owns and steps only those in
its replica. The replica's CPU update, the gradient copies and the bytes
persisted per rank all drop to about 1/N (replicas=R: R/N). The other parameters of a rank's
replica are left behind; `replica_shard` names the ones it keeps current. A
restore reads every parameter from its owner's pool and gives the whole
model to every rank, so the training model, the training optimizer and every
rank's replica are complete again after it.

What the replica cannot see: anything done to the gradients between
backward() and step() (clipping, GradScaler's unscale_, manual edits). The
replica applies the gradients DDP synchronized; a training loop that changes
them would make the replica diverge. Use CheckpointedOptimizer for such loops.

Errors from the threads (a worker's pmsnap.Error) are raised on the training
thread by the next step(), flush() or close().

Thread-safety: one training thread owns a LowDiffPlus (calls step, restore,
flush, close); the hooks run on autograd / collective threads and only queue
references.
"""

import inspect
import threading

import torch
from torch.nn.parallel import DistributedDataParallel

from . import _pmsnap
from . import extra_state as _extra
from .errors import make_error
from .optimizer import CheckpointedOptimizer

_HOOK_QUALNAME = "LowDiffPlus._communication_hook"


class _ReplicaCheckpointer(CheckpointedOptimizer):
    """CheckpointedOptimizer on the replica, stepped by the replica thread: the
    RNG states it stores are the training thread's at the end of the
    iteration (taken in LowDiffPlus.step), not the replica thread's now."""

    rng_of_step = None

    def _rng_states(self):
        return self.rng_of_step if self.rng_of_step is not None else {}


class _NamedReplica:
    """What CheckpointedOptimizer needs of a model: the parameters' names."""

    def __init__(self, named):
        self._named = named

    def named_parameters(self):
        return iter(self._named)


class LowDiffPlus:
    """Per-iteration checkpoints from the gradients alone (module doc).

    Args:
      model: the DistributedDataParallel module being trained (its
        communication hook hands the synchronized buckets over), or a plain
        module in a single process (per-parameter post-accumulate-grad hooks).
      optimizer: the torch.optim optimizer training `model` (any that updates
        parameters independently; not LBFGS). LowDiffPlus.step() calls its
        step().
      pool: the pool file; with several ranks a template with "{rank}".
      every: persist the replica every `every` iterations (default 1: every
        iteration); the replica itself is updated every iteration.
      process_group, sharding, replicas, workers, worker_cpus, capture_rng,
      part_bytes, print_summary and the other CheckpointedOptimizer keywords
        are passed to the replica's CheckpointedOptimizer.

    Raises InvalidArgumentError for a model that is neither DDP nor a module,
    a DDP module with another communication hook already registered, an
    optimizer holding a parameter the model does not have, or LBFGS; and
    FailedPreconditionError when the pool already holds iterations and
    step() comes before restore().
    """

    def __init__(self, model, optimizer, pool, *, every=1, capture_rng=True, **checkpoint_kwargs):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"LowDiffPlus: expected a torch.optim.Optimizer, got "
                             f"{type(optimizer).__name__}")
        if isinstance(model, DistributedDataParallel):
            module, self._ddp = model.module, model
        elif isinstance(model, torch.nn.Module):
            module, self._ddp = model, None
        else:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"LowDiffPlus: model must be a DistributedDataParallel module or a "
                             f"torch.nn.Module, got {type(model).__name__}")
        for key in ("update_in_backward", "init_from", "embeddings", "embedding_policy",
                    "track_embeddings", "model", "mode"):
            if key in checkpoint_kwargs:
                raise make_error(_pmsnap.InvalidArgumentError,
                                 f"LowDiffPlus does not take {key}= (the replica is updated "
                                 "from dense gradients, one checkpoint every `every` iterations)")
        self.optimizer = optimizer
        self._named = self._named_trained_parameters(module, optimizer)
        self._group_sizes = [len(g["params"]) for g in optimizer.param_groups]
        self._index_of_ptr = {p.data_ptr(): i for i, (_, p) in enumerate(self._named)}
        self._replica_named = [
            (name, torch.nn.Parameter(p.detach().to("cpu", copy=True).contiguous(),
                                      requires_grad=p.requires_grad))
            for name, p in self._named]
        self.replica_optimizer = self._make_replica_optimizer(optimizer)
        self._copy_state(optimizer, self._named, self.replica_optimizer, self._replica_named,
                         "cpu")
        self._checkpointer_args = (pool, dict(checkpoint_kwargs, every=every,
                                              capture_rng=capture_rng))
        self._checkpointer = self._make_checkpointer()
        self.pool = self._checkpointer.pool
        self.capture_rng = capture_rng
        # Two host gradient buffers: iteration t is copied into buffer t % 2
        # while the replica thread may still read t - 1's.
        self._buffers = [[torch.empty_like(rp) for _, rp in self._replica_named]
                         for _ in range(2)]
        # The schedule (hand-over, the two buffers, the replica's lag, the
        # first error) is frontend::ReplicaPipeline's, shared with the C++
        # front end. Python keeps the tensors: each parameter's handed
        # gradient (and the CUDA event after its all-reduce), and what the
        # replica needs of each released iteration.
        self._pipeline = _pmsnap.ReplicaPipeline([name for name, _ in self._named],
                                                 str(self.pool), self._checkpointer.iteration)
        self._handed = [None] * len(self._named)
        self._released = {}
        # Parameter indices this rank's replica steps (sharding); None: all.
        # Set by the replica thread once its engine is open, read by the
        # snapshot thread (a stale None only copies more).
        self._shard = None
        self._error = None              # first exception of a thread, raised on the training thread
        self._error_lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._snapshot_loop, daemon=True,
                                          name="pmsnap-lowdiffplus-snapshot"),
                         threading.Thread(target=self._replica_loop, daemon=True,
                                          name="pmsnap-lowdiffplus-replica")]
        self._hook_handles = []
        self._install_hooks(module)
        for t in self._threads:
            t.start()

    # --- training-thread API -------------------------------------------------

    def step(self, closure=None, *, extra_state=None):
        """Runs the training optimizer's step(), then hands this iteration to the
        replica (module doc, 3). Returns the closure's loss.

        InvalidArgumentError if a parameter has a gradient the hooks did not
        hand over this iteration (gradients set by hand, a step() after a
        no_sync() backward), or if the optimizer's param groups changed;
        a thread's earlier error is raised here. The training update itself
        has happened when an error about the replica is raised.
        """
        self._check_open()
        self._raise_thread_error()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # its backward hands the gradients over
        if extra_state is not None and not isinstance(extra_state, dict):
            raise make_error(_pmsnap.InvalidArgumentError, "extra_state must be a dict")
        if [len(g["params"]) for g in self.optimizer.param_groups] != self._group_sizes:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"LowDiffPlus ({self.pool}): the optimizer's param groups changed "
                             f"from sizes {self._group_sizes} to "
                             f"{[len(g['params']) for g in self.optimizer.param_groups]}; the "
                             "replica applies the optimizer it copied at construction")
        if self._pipeline.stats()["iterations"] == 0:
            # A pool with checkpoints is continued by restore(), never overwritten.
            self._checkpointer.check_resumes_pool(self.iteration + 1)
        with_gradient = [p.grad is not None for _, p in self._named]
        self._pipeline.check_handed_over(with_gradient)
        self.optimizer.step()
        hyperparameters = _extra.param_group_hyperparameters(self.optimizer)
        rng = _extra.capture_rng() if self.capture_rng else None
        iteration = self._raising_thread_error(self._pipeline.finish_step)
        self._released[iteration] = (with_gradient, hyperparameters, dict(extra_state or {}), rng)
        self._pipeline.release(iteration)
        return loss

    @property
    def iteration(self):
        """The last iteration stepped (or restored)."""
        return self._pipeline.iteration

    def restore(self, restore_rng=True):
        """Restores the model and the training optimizer from the pool's newest
        committed replica (no replay). Returns (iteration, extra_state) as
        CheckpointedOptimizer.restore does. Before the first step();
        NotFoundError if the pool holds no checkpoint."""
        self._check_open()
        if self.iteration != self._checkpointer.iteration or self._pipeline.stats()["iterations"]:
            raise make_error(_pmsnap.FailedPreconditionError,
                             "LowDiffPlus.restore() must come before the first step()")
        try:
            iteration, extra = self._checkpointer.restore(restore_rng)
        except _pmsnap.NotFoundError:
            # No checkpoint to resume (on every rank alike): a failed restore
            # closes a CheckpointedOptimizer, so start over with a fresh one
            # and let the caller train from the start.
            self._checkpointer.close(abandon=True)
            self._checkpointer = self._make_checkpointer()
            raise
        with torch.no_grad():
            for (_, p), (_, rp) in zip(self._named, self._replica_named):
                p.copy_(rp)
        for group, replica_group in zip(self.optimizer.param_groups,
                                        self.replica_optimizer.param_groups):
            group.update({k: v for k, v in replica_group.items() if k != "params"})
        self._copy_state(self.replica_optimizer, self._replica_named, self.optimizer,
                         self._named, None)
        self._pipeline.restored(iteration)
        self._shard = self._written_shard()
        return iteration, extra

    def flush(self):
        """Waits until the replica applied every iteration handed over and its
        checkpoint committed; raises a thread's error."""
        self._check_open()
        self._raising_thread_error(self._pipeline.wait_for_replica, self.iteration)
        self._checkpointer.flush()
        self._raise_thread_error()

    def close(self, abandon=False):
        """Finishes the replica's pending iterations (unless abandon), commits,
        removes the hooks, stops the threads and closes the pool. Call on
        every rank. Raises a thread's error after cleaning up."""
        if self._closed:
            return
        self._closed = True
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        # Waits for the replica unless abandoning or a thread failed.
        self._pipeline.close(finish=not abandon)
        for t in self._threads:
            t.join()
        self._checkpointer.close(abandon=abandon or self._error is not None)
        self._raise_thread_error()

    def stats(self):
        """The replica checkpointer's stats (its "training thread" is the
        replica thread, so its blocked time is the replica's, not training's)
        plus "lowdiff_plus": iterations handed over, gradient bytes
        snapshotted off the device, the bytes one iteration moves off the
        device (the gradients) against what a full checkpoint of the device's
        state moves (parameters + optimizer state), the training thread's
        total wait in step() for the snapshot copies (which includes waiting
        for a replica two iterations behind), and the last iteration the
        replica applied."""
        s = self._checkpointer.stats()
        gradient_bytes = sum(p.numel() * p.element_size() for _, p in self._named)
        state_bytes = gradient_bytes + sum(
            t.numel() * t.element_size() for _, p in self._named
            for t in self.optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor))
        s["lowdiff_plus"] = dict(self._pipeline.stats(),
                                 gradient_bytes_per_iteration=gradient_bytes,
                                 full_state_bytes=state_bytes)
        return s

    @property
    def replica(self):
        """[(name, replica parameter)] (host tensors; read them after flush()).
        Sharded, only the parameters in replica_shard are current."""
        return list(self._replica_named)

    @property
    def replica_shard(self):
        """Names of the parameters this rank's replica keeps current and its
        pool holds: all of them unless sharding="replicated" splits the
        replica over several ranks (known once the replica's pool is open:
        after its first iteration, or restore(); all before)."""
        shard = self._shard
        return [name for i, (name, _) in enumerate(self._replica_named)
                if shard is None or i in shard]

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            try:
                self.close(abandon=True)
            except _pmsnap.Error:
                pass  # the original exception says more
        return False

    # --- hooks (autograd / collective threads) ---------------------------------

    def _install_hooks(self, module):
        if self._ddp is not None:
            registered = self._ddp._get_ddp_logging_data().get("comm_hook")
            if registered or self._ddp._comm_hooks:
                raise make_error(_pmsnap.InvalidArgumentError,
                                 f"LowDiffPlus ({self.pool}): the DDP module already has the "
                                 f"communication hook '{registered}'; DDP takes one hook and "
                                 "LowDiff+ needs its own to snapshot the synchronized buckets")
            self._ddp.register_comm_hook(self, LowDiffPlus._communication_hook)
            return
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            raise make_error(_pmsnap.InvalidArgumentError,
                             "LowDiffPlus without DDP needs torch >= 2.1 "
                             "(Tensor.register_post_accumulate_grad_hook)")
        for index, (_, p) in enumerate(self._named):
            self._hook_handles.append(p.register_post_accumulate_grad_hook(
                lambda param, index=index: self._hand_over([(index, param.grad)])))

    @staticmethod
    def _communication_hook(state, bucket):
        """DDP communication hook (state = the LowDiffPlus): torch's all-reduce,
        then the synchronized bucket's views are queued for the snapshot."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        future = allreduce_hook(None, bucket)
        pairs = []
        for param, gradient in zip(bucket.parameters(), bucket.gradients()):
            index = state._index_of_ptr.get(param.data_ptr())
            if index is not None:  # a parameter the optimizer does not train
                pairs.append((index, gradient))

        def synchronized(fut):
            state._hand_over(pairs)
            return fut.value()

        return future.then(synchronized)

    def _hand_over(self, pairs):
        """Hands gradients of the current iteration to the snapshot thread."""
        if self._closed or not pairs:
            return
        event = None
        if pairs[0][1].is_cuda:
            # The copy runs on the snapshot thread's stream after the work
            # queued so far on this one (the all-reduce's result).
            event = torch.cuda.Event()
            event.record()
        indices = [index for index, _ in pairs]
        iteration = self._pipeline.claim(indices)  # a second gradient raises here
        for index, gradient in pairs:
            self._handed[index] = (gradient, event)
        self._pipeline.queue(indices, iteration)

    # --- threads ----------------------------------------------------------------

    def _snapshot_loop(self):
        stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        while (copies := self._pipeline.next_copies()) is not None:
            copied = 0
            try:
                buffer = self._buffers[copies[0][0] % 2]
                shard = self._shard
                taken = []
                for _, index in copies:
                    gradient, event = self._handed[index]
                    self._handed[index] = None
                    if shard is None or index in shard:
                        taken.append((buffer[index], gradient, event))
                if any(event is not None for _, _, event in taken):
                    with torch.cuda.stream(stream):
                        for event in {id(e): e for _, _, e in taken if e is not None}.values():
                            stream.wait_event(event)
                        for target, gradient, _ in taken:
                            target.copy_(gradient.view_as(target), non_blocking=True)
                    stream.synchronize()
                else:
                    for target, gradient, _ in taken:
                        target.copy_(gradient.view_as(target))
                copied = sum(target.numel() * target.element_size() for target, _, _ in taken)
            except BaseException as e:  # noqa: BLE001 - reported on the training thread
                self._record_error(e)
            self._pipeline.copies_done(len(copies), copied)

    def _replica_loop(self):
        while (released := self._pipeline.next_iteration()) is not None:
            iteration, apply = released
            with_gradient, hyperparameters, extra_state, rng = self._released.pop(iteration)
            if apply:
                try:
                    self._apply(iteration, with_gradient, hyperparameters, extra_state, rng)
                except BaseException as e:  # noqa: BLE001 - reported on the training thread
                    self._record_error(e)
            self._pipeline.applied(iteration)

    def _apply(self, iteration, with_gradient, hyperparameters, extra_state, rng):
        """The replica's update of `iteration` and its checkpoint."""
        for group, values in zip(self.replica_optimizer.param_groups, hyperparameters):
            group.update(values)
        buffer = self._buffers[iteration % 2]
        shard = self._shard
        for i, ((_, rp), gradient, has) in enumerate(zip(self._replica_named, buffer,
                                                         with_gradient)):
            rp.grad = gradient if has and (shard is None or i in shard) else None
        self._checkpointer.rng_of_step = rng
        try:
            self._checkpointer.step(extra_state=extra_state)
        finally:
            for _, rp in self._replica_named:
                rp.grad = None
        if shard is None:
            self._shard = self._written_shard()

    def _written_shard(self):
        """Indices of the parameters this rank's pool holds when the replica
        is sharded over several ranks; None when it holds all of them."""
        written = self._checkpointer.written_units()
        if written is None:
            return None
        return frozenset(i for i, (name, _) in enumerate(self._replica_named) if name in written)

    def _record_error(self, error):
        with self._error_lock:
            if self._error is None:
                self._error = error
        # Ends every wait of the pipeline; the exception itself is raised here.
        self._pipeline.record_error(f"{type(error).__name__}: {error}")

    def _raise_thread_error(self):
        if self._error is not None:
            raise self._error

    def _raising_thread_error(self, call, *args):
        """call(*args); a pipeline error is a thread's: its exception is raised."""
        try:
            return call(*args)
        except _pmsnap.Error:
            self._raise_thread_error()
            raise

    def _check_open(self):
        if self._closed:
            raise make_error(_pmsnap.FailedPreconditionError,
                             f"LowDiffPlus for {self.pool} is closed")

    # --- construction helpers ------------------------------------------------------

    def _make_checkpointer(self):
        pool, kwargs = self._checkpointer_args
        return _ReplicaCheckpointer(self.replica_optimizer, pool,
                                    model=_NamedReplica(self._replica_named), **kwargs)

    @staticmethod
    def _named_trained_parameters(module, optimizer):
        names = {id(p): name for name, p in module.named_parameters()}
        named = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in names:
                    raise make_error(_pmsnap.InvalidArgumentError,
                                     f"LowDiffPlus: the optimizer's parameter group{g}.param{i} "
                                     f"(shape {list(p.shape)}) is not a parameter of the model; "
                                     "the replica follows the model's gradients")
                named.append((names[id(p)], p))
        if not named:
            raise make_error(_pmsnap.InvalidArgumentError, "LowDiffPlus: the optimizer has no "
                             "parameters")
        return named

    def _make_replica_optimizer(self, optimizer):
        """The same optimizer class on the replica, with every group's
        hyperparameters (foreach / fused flags included) copied."""
        cls = type(optimizer)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise make_error(_pmsnap.InvalidArgumentError,
                             "LowDiffPlus: LBFGS couples all parameters in one update and cannot "
                             "be applied to a replica parameter by parameter")
        replica_params = iter([rp for _, rp in self._replica_named])
        groups = [dict({k: v for k, v in g.items() if k != "params"},
                       params=[next(replica_params) for _ in g["params"]])
                  for g in optimizer.param_groups]
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        try:
            replica = cls(groups, **defaults)
        except (TypeError, ValueError, RuntimeError) as e:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"LowDiffPlus: cannot make a host copy of {cls.__name__} with the "
                             f"training optimizer's settings: {e}") from e
        for g, (mine, theirs) in enumerate(zip(replica.param_groups, optimizer.param_groups)):
            for key, value in theirs.items():
                if key != "params" and mine.get(key) is not value and mine.get(key) != value:
                    raise make_error(_pmsnap.InvalidArgumentError,
                                     f"LowDiffPlus: the host copy of {cls.__name__} has "
                                     f"{key}={mine.get(key)!r} in group {g}, the training "
                                     f"optimizer {value!r}")
        return replica

    @staticmethod
    def _copy_state(source, source_named, target, target_named, device):
        """Copies source's optimizer state of each parameter onto target's
        (tensors cloned; onto `device`, or each target parameter's device,
        except 0-dim "step" counters, which stay on the host unless the
        group is capturable or fused, as torch keeps them)."""
        groups = {id(p): g for g in target.param_groups for p in g["params"]}
        for (_, sp), (_, tp) in zip(source_named, target_named):
            state = source.state.get(sp)
            if not state:
                continue
            group = groups[id(tp)]
            out = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    where = device or tp.device
                    if (device is None and value.dim() == 0 and key == "step"
                            and not (group.get("capturable") or group.get("fused"))):
                        where = "cpu"
                    out[key] = value.detach().to(where, copy=True)
                else:
                    out[key] = value
            target.state[tp] = out
