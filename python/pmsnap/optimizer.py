"""CheckpointedOptimizer: pmsnap inside a PyTorch training loop.

Each step() updates the parameters a group at a time (stepping.py:
ParameterStepper), each between its units' engine hooks, so every weight is
checkpointed as soon as its group is updated. What a parameter becomes in the pool
is in units.py, embedding tables in embedding_tables.py, the comparison with
an existing pool in pool_manifest.py, update_in_backward=True in
update_in_backward.py, restore() and the table readers in checkpoints.py.
The unit rules themselves (the "#dense" companion of a table, which state
goes with a table's rows, which optimizers move rows without a gradient) are
the C++ ones the libtorch hooks follow too, reached through _pmsnap
(frontend/parameter_units.h).

Two behaviours differ on purpose from the C++ hooks::CheckpointedOptimizer
(docs/ARCHITECTURE.md, "Differences between the front ends"):

Lazily created optimizer state. torch creates state on a parameter's first
update, in the optimizer's own Python code (SGD's momentum buffer is a clone
of the first gradient; Adam's step is a tensor whose dtype and device depend
on capturable / fused), and this wrapper steps any torch.optim optimizer
without knowing its state. The pool is therefore laid out after the first
step(): that step runs unobserved, then the engine opens with the state torch
made and captures it right away (a checkpoint of iteration 1). restore()
goes the other way: it reads the pool's manifest first and creates missing
state tensors with the recorded roles, dtypes and shapes, then the engine
overwrites them with the checkpoint's bytes. A parameter that gains state
after the pool was laid out (it had no gradient in the first step) is
reported as ModelMismatchError: use a fresh pool, or do one step in which
every trained parameter gets a gradient before wrapping. (The C++ stepper
knows its five libtorch optimizers and creates their state eagerly.)

A failure while the parameters are updated closes the engine. Whatever
interrupts the per-parameter loop (an engine hook's pmsnap.Error, the
optimizer's own exception, Ctrl-C) reaches step() as an exception, after
which the wrapper cannot tell a checkpointing error from a half-done update:
it finishes the update unobserved where it can, abandons the epoch in flight
(the pool keeps its last commit), closes the engine and raises. The C++
stepper catches libtorch's errors and always completes the update, so it
returns a Status and keeps the engine open.

Thread-safety: one training thread owns a CheckpointedOptimizer (as the
engine's hooks); stats() may be called from any thread.
"""

import os

import torch

from . import _pmsnap
from . import extra_state as _extra
from . import fused_tables as _fused
from . import distributed as _distributed
from . import sharded as _sharded
from .embedding import EmbeddingTracker
from .embedding_tables import gradient_rows, make_embedding_options, resolve_tables
from .errors import make_error
from .options import UNSET, PoolSettings, Ranks, Tuning, check_settings, default_workers
from .options import resolve as resolve_options
from .pool_manifest import (check_every_parameter_held, check_pool_buffers, check_pool_names,
                            check_pool_tables, create_state_from_manifest, merge_rank_units)
from .stepping import EngineObserver, ParameterStepper
from .units import ModuleBuffers, Unit, named_parameters, state_tensors
from .update_in_backward import UpdateInBackward

class CheckpointedOptimizer(UpdateInBackward, _fused.FusedTableUpdates):
    """Wraps a torch.optim optimizer; every step() is checkpointed into `pool`.

    Args:
      optimizer: any torch.optim optimizer that updates parameters independently
        (SGD, Adam, AdamW, Adagrad, RMSprop, ...; not LBFGS).
      pool: path of the pool file (created if missing; reopened and checked
        against the model if present). Put it on a DAX file system for real PM.
      model: the module, to name units after its parameters ("fc1.weight");
        otherwise units are "group<g>.param<i>". Pass the same to restore().
        Its persistent buffers (BatchNorm's running statistics, every buffer
        in its state_dict; not non-persistent ones) are checkpointed with
        every step as well, captured at the step boundary (see buffers=).
        A torchrec DistributedModelParallel: its fused tables' shards (and
        their fused optimizer state) are checkpointed too, beside the
        parameters of `optimizer`, which must hold the dense ones only
        (fused_tables.py).
      buffers: checkpoint `model`'s persistent buffers (default True).
        Without model=, or with False, buffers are not saved: restore() then
        leaves them as they are, and a model that has running statistics
        resumes with the wrong ones. False also opens pools written before
        pmsnap saved buffers.
      mode: "continuous" (a checkpoint at the first step boundary after the
        previous one committed), "every" (steps k % every == 0) or "checkfreq".
      every: checkpoint interval for mode "every" (giving it implies that mode).
      device: "host", "simulated:GBPS:MEM_MIB" or "cuda[:N]" (falls back to the
        host with a note when no GPU is usable).
      strategy: conflict strategy "1".."4" or "adaptive".
      start_iteration: iterations already done (restore() sets it).
      capture_rng: store the global RNG states with every checkpoint.
      track_embeddings: attach an EmbeddingTracker to `model`
        (.embedding_tracker).
      embeddings: parameters to checkpoint as embedding tables (see the module
        doc): a name or list of parameter names ("emb.weight") or module
        names ("emb"); None with embedding_policy: every nn.Embedding /
        nn.EmbeddingBag weight of `model`, or under torchrec every fused
        table this rank holds shards of (their FQNs).
      embedding_policy: "full", "one-shot", "incremental", "intermittent"
        (default when embeddings are given) or "incrcp", or a pmsnap.Policy.
      quantize_bits: quantize table checkpoints rowwise with 2, 3, 4 or 8
        bits, or "auto" (from expected_resumes); None: exact.
      retain: newest table checkpoints kept recoverable (default 2).
      embedding_options: a pmsnap.EmbeddingOptions for everything else (IncrCP
        thresholds...); the arguments above override its fields.
      embedding_rows: "auto" (lookups of the table's module if `model` has
        one and this process trains alone, else gradients), "lookups" or
        "gradients". Beside other ranks (DDP) a step changes the rows every
        rank looked up, which only the averaged gradient names: "lookups"
        is right there only for a table no other rank's gradient reaches.
      workers: copy/persist worker threads (default: default_workers(device,
        os.cpu_count()): 2 on the host, 1 on a 2-core machine, up to 8 on a GPU).
      worker_cpus: CPUs the workers run on (e.g. [1] with the training thread
        pinned to CPU 0 by os.sched_setaffinity): on a machine with few cores
        the copies then never take the training thread's core. None: where
        the OS puts them. A CPU the machine lacks raises InvalidArgumentError.
      update_in_backward: update each parameter inside backward, the moment
        its gradient is accumulated (Tensor.register_post_accumulate_grad_hook),
        so its checkpoint copy starts while backward still runs on earlier
        layers; step() then only finishes the iteration. Bitwise the same
        result as backward() then step(); several backward passes before one
        step() (gradient accumulation) raise InvalidArgumentError instead of
        silently changing the result. Copies start right after each update
        (copy_start "after-update") unless copy_start says otherwise.
      dram_staging_buffers: continuous mode only (single process, no
        embedding tables): 1 or 2 host-memory buffers of the checkpoint's
        size. A step that finds the previous checkpoint still being written
        is captured into one and written the moment that checkpoint commits,
        so on PM slower than the training loop checkpoints follow each other
        without the PM idling until the next step (with many small tensors,
        workers=2 keeps the PM busier). Default 0 (off).
      copy_start: when a captured weight's copy starts: "auto" (host: the
        step's last captures wait for its end), "after-update" or
        "after-step"; see runtime::CopyStart.
      process_group: with torch.distributed initialized and more than one
        rank (torchrun), the ranks of this group (default: the world)
        checkpoint together (pmsnap.distributed): `pool` must contain
        "{rank}" (each rank has its own pool), every rank captures the same
        iterations, and restore() brings every rank to the newest iteration
        all of them hold. Construct, restore, step and close on every rank
        alike; an error on one rank is raised on all of them.
      sharding: with several ranks, "replicated" (DDP, where every rank holds
        the same parameters and optimizer state) gives each parameter an
        owner rank, balanced by bytes, and only its holders write it: each
        rank writes about replicas/N of the model, and restore() broadcasts
        every parameter from a rank that holds it. None (default): every
        rank writes everything. Embedding tables stay each rank's own.
      replicas: with sharding="replicated", each parameter is also written
        by the replicas-1 ranks after its owner, so restore() still recovers
        bit-exact when the pools of any replicas-1 ranks are lost (a replaced
        node). Default 1.
      init_from: an existing checkpoint to start from (moving a run onto
        pmsnap mid-training): a .safetensors or .pt file or a DCP folder, as
        pmsnap.export writes them, or a state dict of the model's tensors
        (.pt / .safetensors) or a DCP / .pt checkpoint with "model" and
        "optimizer" entries keyed by parameter name; or a pool, or a
        "{rank}" template of another run's pools, consolidated whatever its
        world size (how a DDP run moves to another number of ranks). The model (model= is
        required) and optimizer are loaded from it (strictly: every
        parameter), iteration numbering continues from its iteration, and
        when it holds the optimizer state the new pool is created and
        captures it right away (a checkpoint of that iteration); a model-only
        checkpoint is captured with the first step(). The pool must not hold
        a checkpoint yet (FailedPreconditionError); InvalidArgumentError
        naming the file for one that cannot be imported, ModelMismatchError
        naming the parameter for one made for another model; the pool is
        left untouched either way.
      step_groups: while an earlier checkpoint is still copying, step()
        calls the wrapped optimizer's step() at most this many times
        (default 4), each time on a group of parameters of about equal
        bytes in backward order, hooking each parameter of the group around
        it, so that an update waits for its own parameters' copies alone.
        A step begun with no copy in flight is one call. Each call costs
        0.1-0.5 ms of Python whatever its size: one call per parameter
        (None or 0, the finest capture) made a 72-tensor transformer's
        AdamW step 60% slower, 4 groups 18% (bench/RESULTS.md). Results are
        bitwise the same.
      Other keyword arguments tune the engine and a newly created pool:
      part_bytes, extra_state_capacity, verify_on_open,
      check_free_space, reserve_bytes, checkfreq_overhead, print_summary,
      chunk_heap_bytes (the chunk heap's budget for a new pool; LowDiff's
      differentials live there: pmsnap.lowdiff).
      finish_step_later: step() updates the parameters but leaves the
        step open; finish_step() ends it, and its checkpoint takes the extra
        state, RNG states and learning rates as they are then. For trainers
        that step the LR scheduler and their own counters after
        optimizer.step() (Lightning, Hugging Face Trainer:
        pmsnap.lightning, pmsnap.hf): the checkpoint then holds the state a
        resumed run continues from. The next step(), flush() or close()
        finishes a step left open. Default False (step() ends the step).
      tuning, pool_settings, ranks: option objects grouping keywords above
        (pmsnap.Tuning: strategy, workers, worker_cpus, part_bytes,
        copy_start, dram_staging_buffers, reserve_bytes, step_groups;
        pmsnap.PoolSettings: extra_state_capacity, verify_on_open,
        check_free_space, chunk_heap_bytes, print_summary; pmsnap.Ranks:
        process_group, sharding, replicas). A keyword given beside an object
        that sets the same field raises InvalidArgumentError.

    Errors raise pmsnap.Error subclasses carrying the runtime's message.
    """

    def __init__(self, optimizer, pool, *, model=None, mode=None, every=None, device="host",
                 strategy=UNSET, workers=UNSET, part_bytes=UNSET,
                 extra_state_capacity=UNSET, verify_on_open=UNSET, check_free_space=UNSET,
                 reserve_bytes=UNSET, checkfreq_overhead=0.035, start_iteration=0,
                 capture_rng=True, track_embeddings=False, print_summary=UNSET, embeddings=None,
                 embedding_policy=None, quantize_bits=None, expected_resumes=1.0, retain=None,
                 embedding_options=None, embedding_rows="auto", update_in_backward=False,
                 copy_start=UNSET, process_group=UNSET, sharding=UNSET, replicas=UNSET,
                 init_from=None, worker_cpus=UNSET, step_groups=UNSET, chunk_heap_bytes=UNSET,
                 dram_staging_buffers=UNSET, buffers=True, tuning=None, pool_settings=None,
                 ranks=None, finish_step_later=False):
        (strategy, workers, worker_cpus, part_bytes, copy_start, dram_staging_buffers,
         reserve_bytes, step_groups) = resolve_options(
            Tuning, tuning, "tuning", strategy=strategy, workers=workers,
            worker_cpus=worker_cpus, part_bytes=part_bytes, copy_start=copy_start,
            dram_staging_buffers=dram_staging_buffers, reserve_bytes=reserve_bytes,
            step_groups=step_groups)
        (extra_state_capacity, verify_on_open, check_free_space, chunk_heap_bytes,
         print_summary) = resolve_options(
            PoolSettings, pool_settings, "pool_settings",
            extra_state_capacity=extra_state_capacity, verify_on_open=verify_on_open,
            check_free_space=check_free_space, chunk_heap_bytes=chunk_heap_bytes,
            print_summary=print_summary)
        process_group, sharding, replicas = resolve_options(
            Ranks, ranks, "ranks", process_group=process_group, sharding=sharding,
            replicas=replicas)
        mode = check_settings(optimizer, mode, every, strategy, sharding, replicas, step_groups)
        strategy = str(strategy)
        if not pool:
            raise make_error(_pmsnap.InvalidArgumentError, "pool path is empty")
        # Fails early with InvalidArgumentError for a bad spec.
        self._device_name, self._device_note = _pmsnap.describe_device(device)
        self.optimizer = optimizer
        self._coordinator = _distributed.coordinator_for(process_group)
        self._peers = None
        if sharding == "replicated" and replicas > 1 and self._coordinator is not None:
            self._peers = _distributed.PeerReplicas(self._coordinator, replicas, process_group)
        self.pool = _distributed.rank_pool_path(os.fspath(pool), self._coordinator)
        self.model = model
        self.iteration = int(start_iteration)
        self.extra_state = {}
        self.capture_rng = capture_rng
        if workers is None:
            workers = default_workers(device, os.cpu_count())
        if copy_start is None:
            copy_start = "after-update" if update_in_backward else "auto"
        self._engine_kwargs = dict(
            copy_start=copy_start, device=device, policy=mode, every=every or 1,
            checkfreq_overhead=checkfreq_overhead,
            strategy=strategy, workers=workers, part_bytes=part_bytes,
            extra_state_capacity=extra_state_capacity, verify_on_open=verify_on_open,
            check_free_space=check_free_space, reserve_bytes=reserve_bytes,
            print_summary=print_summary, coordinator=self._coordinator,
            shard_replicated_state=sharding == "replicated", replicas=replicas,
            worker_cpus=list(worker_cpus or []), dram_staging_buffers=int(dram_staging_buffers))
        if chunk_heap_bytes is not None:
            self._engine_kwargs["chunk_heap_bytes"] = int(chunk_heap_bytes)
        self._cuda = self._device_name.startswith("cuda")
        if self._cuda and torch.cuda.is_available():
            # Copies wait for the updates' events recorded on the stream the
            # optimizer runs on (docs/ARCHITECTURE.md, "GPU ordering").
            self._engine_kwargs["cuda_stream"] = torch.cuda.current_stream().cuda_stream
        self._named = named_parameters(optimizer, model)
        self._init_update_in_backward(update_in_backward)
        # torchrec's fused tables: units of their own (fused_tables.py).
        self._init_fused_tables(model, optimizer)
        self._shards = _sharded.layouts(self._named, sharding, self._fused)
        plan = _fused.plan_fingerprint(model)
        if self._shards is not None or plan:  # the ranks' local shapes differ: name the model
            self._engine_kwargs["model_fingerprint"] = _sharded.fingerprint(self._named, plan)
        self._buffers = (ModuleBuffers(model) if isinstance(model, torch.nn.Module) and buffers
                         else None)
        if self._buffers is not None and not len(self._buffers):
            self._buffers = None
        self._buffer_unit_ids = []
        self._stepper = ParameterStepper(optimizer, [p for _, p in self._named], step_groups)
        self._engine = None
        self._units = None
        self._unit_ids = None
        self._closed = False
        self._final_stats = None
        # The last step's state when no epoch captured it (see close()).
        self._skipped_step_state = None
        self._finish_later = bool(finish_step_later)
        # Under finish_step_later: whether the open step is captured (None: none open).
        self._open_step_captured = None
        self._pool_latest = None
        self.embedding_tracker = None
        self._tables = {}
        self._embedding_options = None
        self._table_tracker = None
        if (embeddings is not None or embedding_policy is not None
                or embedding_options is not None):
            self._embedding_options = make_embedding_options(
                embedding_policy, embedding_options, quantize_bits, expected_resumes, retain)
            # Under a torchrec plan the policy is for the fused tables' shards.
            self._tables = (_fused.policy_tables(self._fused, embeddings) if self._fused else
                            resolve_tables(embeddings, model, self._named, optimizer,
                                           embedding_rows))
        elif quantize_bits is not None or retain is not None:
            raise make_error(_pmsnap.InvalidArgumentError,
                             "quantize_bits= and retain= are for embedding tables: pass "
                             "embeddings= or embedding_policy= too")
        self._checkpoints_last_step = (mode == "continuous" and self._coordinator is None
                                       and not self._tables)
        with _distributed.together(self._coordinator):
            if os.path.exists(self.pool):
                info = _pmsnap.read_pool(self.pool)
                check_pool_names(info, self._all_named, self.pool, sharded=self._sharded)
                check_pool_buffers(info, self._buffers, self.pool, sharded=self._sharded)
                check_pool_tables(info, self._tables, self.pool)
                if info["latest"] is not None:
                    self._pool_latest = info["latest"]["iteration"]
        tracked = {t.module_name: dict(model.named_modules())[t.module_name]
                   for t in self._tables.values() if t.module_name is not None
                   and not self._fused}
        if self._fused and self._tables:
            self._table_tracker = _fused.FusedLookups(model, self._tables)
        elif tracked:
            # Our own tracker: its marks are handed to the checkpointer each step.
            self._table_tracker = EmbeddingTracker(None, modules=tracked)
        if track_embeddings:
            if model is None:
                raise make_error(_pmsnap.InvalidArgumentError, "track_embeddings needs model=")
            # The tables' own tracker (above) marks the tables both track.
            self.embedding_tracker = EmbeddingTracker(
                model, ride_on=self._table_tracker if tracked else None)
        if init_from is not None:
            self._init_from(init_from)

    # --- the torch.optim surface -------------------------------------------------

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=True):
        """The wrapped optimizer's zero_grad, with torch.optim's default:
        gradients set to None, not zeroed in place (a memset of every
        gradient per step, bench/RESULTS.md "The DLRM example's overhead")."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def step(self, closure=None, *, extra_state=None):
        """One optimizer step, each parameter's update between its unit's hooks.

        `extra_state` (a picklable dict, e.g. {"batch": 123}) replaces
        self.extra_state and is stored with this step's checkpoint. Returns
        the closure's loss, like torch.optim. If a hook fails while the
        parameters are updated, the step is still completed for every
        parameter (the model stays consistent), the epoch in flight is
        abandoned, the engine closed and the error raised; so too for an
        error from the engine's begin_step (e.g. a worker error of an earlier
        checkpoint) under update_in_backward. Without it, that error is
        raised before any parameter is updated, the engine left open. An
        error from end_step is raised after every parameter was updated, the
        engine left open.
        """
        if self._closed:
            raise make_error(_pmsnap.FailedPreconditionError,
                             f"CheckpointedOptimizer for {self.pool} is closed")
        self._finish_open_step()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._take_extra_state(extra_state)
        step = self.iteration + 1
        if self._backward_hooks or self._backward_step_begun or self._backward_error is not None:
            # update_in_backward, or a fused table's lookup began the step
            return self._finish_backward_step(step, loss)
        if self._engine is None:
            self.check_resumes_pool(step)
            self._first_step(step)
            return loss
        self._check_unchanged()
        # Before any table's update: its capture takes the rows marked so far.
        self._mark_tables()
        # Read before begin_step, which opens this step's own epoch.
        earlier_in_flight = self._engine.epoch_in_flight
        self._engine.begin_step(step)
        self._update_and_end_step(step, self._engine, earlier_in_flight=earlier_in_flight)
        return loss

    # --- checkpoint control -------------------------------------------------------

    def restore(self, restore_rng=True):
        """Restores model parameters and optimizer state from the pool.

        Returns (iteration, extra_state) and continues numbering at
        iteration + 1. extra_state is the dict given to step() with an "rng"
        entry holding the RNG states (applied here unless restore_rng=False).
        Must come before the first step(). NotFoundError if the pool does not
        exist or holds no committed checkpoint; ModelMismatchError if it was
        made for another model (naming the parameter).
        """
        if self._engine is not None or self._closed:
            raise make_error(_pmsnap.FailedPreconditionError,
                             "restore() must come before the first step() and before close()")
        sharded = self._sharded
        info = None
        with _distributed.together(self._coordinator):
            if os.path.exists(self.pool):
                info = _pmsnap.read_pool(self.pool)
                check_pool_names(info, self._all_named, self.pool, sharded=sharded)
                check_pool_buffers(info, self._buffers, self.pool, sharded=sharded)
                check_pool_tables(info, self._tables, self.pool)
            elif not sharded:  # sharded: a lost pool is restored from its replicas
                raise make_error(_pmsnap.NotFoundError, f"pool {self.pool} does not exist")
        if sharded:
            # This rank's pool holds only its share; the state of the other
            # ranks' parameters is made from their pools' manifests.
            info = {"units": merge_rank_units(_distributed.gather_objects(
                self._coordinator, info["units"] if info is not None else []))}
        with _distributed.together(self._coordinator):
            if sharded:
                check_every_parameter_held(info, self._named, self.pool)
            create_state_from_manifest(info, self._state_view, self._all_named)
        self._open_engine()
        try:
            iteration, _, data = self._engine.restore()
        except _pmsnap.Error:
            self._fail()
            raise
        if self._table_tracker is not None:
            self._table_tracker.clear()  # rows of the overwritten state
        if self._buffers is not None:
            self._buffers.restore()
        blob = self._own_blob(_extra.unpack(data))
        _sharded.check_restored(blob.get("shards"), self._shards, self.pool,
                                self._coordinator.rank() if self._coordinator else None)
        _extra.apply_to_optimizer(blob, self.optimizer, self._named, self.pool, restore_rng)
        self.iteration = int(iteration)
        self._pool_latest = self.iteration
        self.extra_state = dict(blob["user"])
        return self.iteration, _extra.user_view(blob)

    @property
    def _sharded(self):
        """sharding="replicated" over several ranks: each rank writes its share."""
        return self._engine_kwargs["shard_replicated_state"] and self._coordinator is not None

    def written_units(self):
        """Names of the units (parameters) this rank's pool holds when
        sharding="replicated" splits them over several ranks; None when the
        pool holds every unit (no sharding, one rank) or is not open yet
        (before the first step() or restore()). Training thread."""
        if not self._sharded or self._engine is None:
            return None
        return {u["name"] for u in self._stats_of(self._engine).get("units", [])}

    def finish_step(self, extra_state=None):
        """Ends the step that step() left open under finish_step_later=True:
        its checkpoint (if this step is captured) takes `extra_state` (a
        picklable dict, replacing self.extra_state), the RNG states and the
        learning rates as they are now. No-op when no step is open. Errors
        as those step() raises from ending a step: after the parameters
        were updated, the engine left open. Training thread."""
        self._take_extra_state(extra_state)
        self._finish_open_step()

    @property
    def step_open(self):
        """Whether a step() left its step open (finish_step_later=True)."""
        return self._open_step_captured is not None

    def flush(self):
        """Finishes an open step, then waits until the checkpoint in flight
        has committed (or failed)."""
        if self._engine is not None:
            self._finish_open_step()
            self._engine.flush()

    def close(self, abandon=False):
        """Commits the checkpoint in flight (unless abandon) and closes the pool.

        In continuous mode, which skips a step whose boundary finds the
        previous checkpoint in flight, close() checkpoints the last step if
        it was skipped (one rank, no embedding tables; its extra state and
        RNG as they were at the end of that step), so the pool ends at the
        last step trained. Mode "every" keeps its multiples of k: the pool
        holds the newest multiple. With several ranks or embedding tables,
        continuous mode's last checkpoint may be older than the last step
        (restore() returns the iteration it holds); call flush() before the
        last step to have it checkpointed."""
        if self._closed:
            return
        self._closed = True
        self._remove_backward_hooks()
        self._remove_fused_hooks()
        if self.embedding_tracker is not None:
            self.embedding_tracker.remove()
        if self._table_tracker is not None:
            self._table_tracker.remove()
        engine = self._engine
        if engine is not None:
            try:
                if not abandon:
                    self._finish_open_step()
                    if self._skipped_step_state is not None:
                        rng, hyperparameters = self._skipped_step_state
                        engine.checkpoint_last_step(self._pack_extra(rng, hyperparameters))
            finally:
                self._engine = None
                self._open_step_captured = None
                try:
                    engine.close(abandon=abandon)
                finally:
                    self._final_stats = self._stats_of(engine)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.flush()
        finally:
            if exc_type is None:
                self.close()
            else:
                try:
                    self.close()
                except _pmsnap.Error:
                    pass  # the original exception says more
        return False

    def stats(self, per_step=False):
        """Runtime statistics as a dict (runtime::Stats plus iteration and pool).

        stats()["memory"] is what pmsnap holds, in bytes: the pool file's
        mapping (pool_mapped_bytes; pool_resident_bytes of it in memory, on
        /dev/shm DRAM), host staging buffers (staging_bytes,
        staging_resident_bytes), host memory pinned for the GPU
        (registered_bytes) and the Python front end's own copies
        (python_copies_bytes on the host, python_copies_device_bytes on the
        GPU: the module buffers' shadows). After close(): as at close()."""
        if self._engine is not None:
            return self._stats_of(self._engine, per_step)
        if self._final_stats is not None:
            return dict(self._final_stats)
        return {"iteration": self.iteration, "pool": self.pool, "open": False, "steps": 0,
                "epochs_committed": 0, "summary": "pmsnap: pool not opened yet"}

    @property
    def embedding_tables(self):
        """Names of the parameters checkpointed as embedding tables."""
        return list(self._tables)

    @property
    def embedding_options(self):
        """The pmsnap.EmbeddingOptions in use, or None without tables."""
        return self._embedding_options

    def last_checkpoint(self, table):
        """What table `table`'s last committed checkpoint wrote: a dict with
        epoch, rows_written, bytes_written, full, construction_seconds,
        extractions, live_chunks. NotFoundError for a name that is not a table."""
        return self._open_or_raise().last_checkpoint(table)

    def marked_rows(self, table):
        """Sorted int64 tensor of the rows of `table` marked for its next checkpoint."""
        return torch.tensor(self._open_or_raise().marked_rows(table), dtype=torch.int64)

    def marks_all_rows(self, table):
        """Whether every row of `table` is marked each step (its optimizer moves
        rows without a gradient)."""
        if table not in self._tables:
            raise make_error(_pmsnap.NotFoundError, f"'{table}' is not an embedding table here")
        return self._tables[table].mark_all

    @property
    def device_note(self):
        """Why the requested device was replaced (e.g. no GPU), or ""."""
        return self._device_note

    # --- the seam for features built on a CheckpointedOptimizer --------------------
    # LowDiff, LowDiff+, CPR and the table readers (pmsnap.checkpoints) reach
    # the engine only through these, never through private members. Each is
    # called on the training thread; those that need the engine raise
    # FailedPreconditionError naming the pool when it is not open (before the
    # first step() or restore(), or after close()).

    @property
    def is_open(self):
        """Whether the engine is open (after the first step() or restore(),
        before close())."""
        return self._engine is not None

    @property
    def coordinator(self):
        """The ranks' coordinator (pmsnap.distributed) when several ranks
        checkpoint together, else None."""
        return self._coordinator

    def open_differential_log(self, batch, resume_after=None):
        """A differential log on this pool's chunk heap (LowDiff): `batch`
        differentials per batch; `resume_after` the iteration a restore
        reached (its later records are discarded). Closed with the engine."""
        return self._open_or_raise().open_differential_log(batch, resume_after)

    def read_differentials(self, after):
        """[(iteration, [(dtype, shape, bytes)])] of the differentials after
        iteration `after`, up to the first gap."""
        return self._open_or_raise().read_differentials(after)

    def set_full_interval(self, every, anchor=0):
        """Full checkpoints at steps anchor + every, anchor + 2 every, ... from
        the next step on (mode "every"; LowDiff retunes its interval)."""
        self._open_or_raise().set_every(every, anchor)

    def resume_at(self, iteration):
        """Training continues after `iteration`, which a feature reached
        beyond the restored checkpoint (LowDiff replayed differentials up to
        it): step() then checkpoints iteration + 1, and this pool is known
        to hold `iteration`."""
        self.iteration = int(iteration)
        self._pool_latest = self.iteration

    def replay_step(self):
        """One optimizer update on the gradients in p.grad, checkpointing
        nothing and counting no iteration (a differential's replay)."""
        self._stepper.step(None)

    def check_resumes_pool(self, step):
        """FailedPreconditionError naming the pool when checkpointing `step`
        would overwrite checkpoints this run did not restore."""
        if self._pool_latest is not None and step <= self._pool_latest:
            raise make_error(_pmsnap.FailedPreconditionError,
                             f"pool {self.pool} already holds iteration {self._pool_latest} and "
                             f"this run would checkpoint iteration {step}: call restore() first "
                             "(or pmsnap.restore() and pass start_iteration=), or use a new pool")

    def mark_all_rows(self, table):
        """Marks every row of embedding table `table` for its next checkpoint
        (CPR: a shard restored from an older checkpoint)."""
        self._open_or_raise().mark_all_rows(table)

    def list_table_checkpoints(self, table):
        """pmsnap.list_checkpoints(self, table), from the open engine."""
        return self._open_or_raise().list_checkpoints(table)

    def recover_table_arrays(self, table, epoch=None):
        """(info, [(role, shape)], arrays) of table `table` at retained
        checkpoint `epoch` (None: the newest), from the open engine: what
        pmsnap.recover_table makes tensors of."""
        info, arrays = self._open_or_raise().recover_table(table, epoch)
        return info, self._encoded_roles(table), arrays

    # --- internals ----------------------------------------------------------------

    def _init_from(self, path):
        """init_from=: loads `path` into the model and optimizer, then seeds the pool."""
        if self._pool_latest is not None:
            raise make_error(_pmsnap.FailedPreconditionError,
                             f"pool {self.pool} already holds iteration {self._pool_latest}: "
                             f"init_from={os.fspath(path)!r} seeds a new pool (restore() "
                             "continues this one)")
        if self.model is None:
            raise make_error(_pmsnap.InvalidArgumentError,
                             "init_from= needs model= to match the checkpoint's parameter names")
        # Imported here: export.py imports this module's package.
        from .export import read_export
        from .importing import load_into
        # Sharded parameters from the pools of a run on any number of ranks:
        # each rank reads the rows of its shards (sharded.py), all ranks at
        # once (CheckpointReader maps a pool read-only, without its lock).
        # Anything else one rank at a time: a pool file opens in one process
        # at once for read_export (libpmemobj locks it), and init_from may
        # name another run's pools.
        resharded = self._shards is not None and _sharded.is_pool_template(path)
        if resharded:
            with _distributed.together(self._coordinator):
                data = _sharded.load_resharded(path, self.model, self._state_view,
                                               self._all_named, self._fused)
        else:
            data = _distributed.one_rank_at_a_time(self._coordinator,
                                                   lambda: read_export(path))
        if not resharded:
            load_into(data, self.model, self.optimizer, self._named, os.fspath(path))
        if data["iteration"] is not None:
            self.iteration = int(data["iteration"])
        self.extra_state = dict(data["extra"])
        if data["optimizer"] is None or self.iteration < 1:
            return  # the first step() makes the optimizer state, then lays out the pool
        self._open_engine()
        if self._table_tracker is not None:
            self._table_tracker.clear()
        self._capture_buffers(None)
        self._engine.begin_step(self.iteration)
        self._engine.end_step(self._pack_extra())
        self._engine.flush()

    def _stats_of(self, engine, per_step=False):
        try:
            s = engine.stats(per_step)
        except _pmsnap.Error:  # closed: the last stats taken stand
            return dict(self._final_stats or {})
        s["iteration"] = self.iteration
        s["pool"] = self.pool
        s["open"] = not engine.closed
        # Copies the Python front end keeps beside the engine's: the module
        # buffers' shadows (host memory, or device memory for CUDA buffers).
        copies = self._buffers.shadow_bytes() if self._buffers is not None else {}
        s["memory"]["python_copies_bytes"] = copies.get("cpu", 0)
        s["memory"]["python_copies_device_bytes"] = sum(v for k, v in copies.items() if k != "cpu")
        return s

    def _open_or_raise(self):
        if self._engine is None:
            raise make_error(_pmsnap.FailedPreconditionError,
                             f"CheckpointedOptimizer for {self.pool} is not open (before the first "
                             "step() or restore(), or after close())")
        return self._engine

    def _open_engine(self):
        units = []
        for name, p in self._all_named:
            units.append(Unit(name, p, state_tensors(self._state_view, p), name in self._tables))
        registrations = []
        unit_ids = []
        for u in units:
            regs = u.registrations(self._cuda)
            unit_ids.append(list(range(len(registrations), len(registrations) + len(regs))))
            registrations.extend(regs)
        if self._buffers is not None:
            regs = self._buffers.registrations(self._cuda)
            self._buffer_unit_ids = list(range(len(registrations), len(registrations) + len(regs)))
            registrations.extend(regs)
        kwargs = dict(self._engine_kwargs)
        if self._tables:
            kwargs["encoded_units"] = list(self._tables)
            kwargs["embedding_options"] = self._embedding_options
        engine = _pmsnap.Engine(self.pool, registrations, **kwargs)
        # Stats taken before close() need the engine; close() keeps the last.
        self._engine = engine
        self._units = units
        self._unit_ids = unit_ids
        self._fused_unit_ids = [u for ids in unit_ids[len(self._named):] for u in ids]

    def _mark_tables(self):
        """Hands each table's changed rows to its C++ RowTracker."""
        for name in self._tables:
            self._mark_table(name)

    def _mark_table(self, name):
        table = self._tables[name]
        grad = table.param.grad
        if table.source == "lookups":
            # Also without a gradient: the marks wait for the next update.
            self._engine.take_marks(name, self._table_tracker.row_tracker(table.module_name))
        if grad is None:
            return
        if table.mark_all:
            self._engine.mark_all_rows(name)
        elif table.source == "gradients":
            rows = gradient_rows(grad)
            self._engine.mark_rows(name, rows.data_ptr(), rows.numel(), "int64")

    def _fail(self):
        engine, self._engine = self._engine, None
        self._closed = True
        if engine is not None:
            try:
                engine.close(abandon=True)
            except _pmsnap.Error:
                pass
            self._final_stats = self._stats_of(engine)

    def _update_and_end_step(self, step, engine, indices=None, error=None, earlier_in_flight=True):
        """Updates the parameters (all, or `indices`) between their hooks on
        `engine` (None: unobserved), then ends step `step`. If a hook failed
        (or `error`, an earlier one), or the optimizer itself or Ctrl-C
        interrupted the update, the epoch in flight cannot be trusted: it is
        abandoned, the pool keeps its last commit, the engine is closed and
        the error raised. `earlier_in_flight`: whether an epoch was in
        flight before the engine's step began (default: assume so)."""
        # Groups pay only while an earlier epoch still copies: each update
        # then waits for its own parameters' copies alone. Otherwise no
        # update can wait, and one optimizer call saves 0.1-0.5 ms per
        # group; on the host a captured step's copies mostly start after it
        # anyway (copy_start "auto"). A step no epoch captures also drops
        # its extra state (about 1 ms of packing).
        captured = engine is None or engine.captures_this_step
        one_call = engine is None or not (engine.epoch_in_flight
                                          and (earlier_in_flight or not captured))
        try:
            self._stepper.step(self._observer_of(engine), indices, one_call=one_call)
            self._end_fused_updates(engine if error is None else None)
            if error is None:
                self._capture_buffers(engine)
            if error is not None:
                raise error
        except BaseException:
            self.iteration = step
            self._fail()
            raise
        self.iteration = step
        self._end_step(captured)

    def _take_extra_state(self, extra_state):
        """`extra_state` (a dict, or None: keep the current one) becomes
        self.extra_state; InvalidArgumentError for anything else."""
        if extra_state is not None:
            if not isinstance(extra_state, dict):
                raise make_error(_pmsnap.InvalidArgumentError, "extra_state must be a dict")
            self.extra_state = extra_state

    def _end_step(self, captured):
        """Ends the engine's step now, or leaves it open for finish_step()
        under finish_step_later. `captured`: whether an epoch captures it."""
        self._open_step_captured = captured
        if not self._finish_later:
            self._finish_open_step()

    def _finish_open_step(self):
        """Ends the engine's step that step() left open, with the extra
        state, RNG and hyperparameters of now. No-op when none is open."""
        captured, self._open_step_captured = self._open_step_captured, None
        if captured is None:
            return
        self._engine.end_step(self._pack_extra() if captured else b"")
        # What a skipped step's checkpoint at close() needs that may change
        # after it (RNG draws, a scheduler's lr): taken now, about 40 us.
        self._skipped_step_state = (None if captured or not self._checkpoints_last_step else
                                    (self._rng_states(),
                                     _extra.param_group_hyperparameters(self.optimizer)))

    def _first_step(self, step, indices=None):
        """The first step: the update runs unobserved so that torch makes its
        state, then the pool is laid out and captures iteration `step` whole."""
        self._stepper.step(None, indices)
        self.iteration = step
        self._open_engine()
        self._capture_buffers(None)
        # This epoch writes every table whole: earlier marks are moot.
        if self._table_tracker is not None:
            self._table_tracker.clear()
        self._engine.begin_step(step)
        self._end_step(True)

    def _capture_buffers(self, engine):
        """The module's buffers into their shadows, between the buffer units'
        hooks on `engine` (None: unobserved): the step boundary's values."""
        if self._buffers is None:
            return
        if engine is not None:
            for unit in self._buffer_unit_ids:
                engine.before_update(unit)
        self._buffers.capture()
        if engine is not None:
            for unit in self._buffer_unit_ids:
                engine.after_update(unit)

    def _check_unchanged(self):
        for unit in self._units:
            unit.check_unchanged()

    def _observer_of(self, engine):
        """The stepper's observer that hooks `engine` (None: unobserved)."""
        if engine is None:
            return None
        return EngineObserver(engine, self._unit_ids, self._units, self.optimizer)

    def _encoded_roles(self, table):
        """[(role, shape)] of table `table`'s encoded unit, or None."""
        for unit in self._units or []:
            if unit.name == table:
                return unit.encoded_roles()
        return None

    def _pack_extra(self, rng=None, hyperparameters=None):
        """This step's extra state, with the peers' states this rank keeps
        (sharding="replicated", replicas > 1: a collective, called at the
        same, captured, steps on every rank). `rng` and `hyperparameters`:
        as taken at the end of an earlier step (default: now)."""
        if "rng" in self.extra_state:
            raise make_error(_pmsnap.InvalidArgumentError,
                             "extra_state key 'rng' is reserved for the RNG states pmsnap saves")
        parts = (self.extra_state, self._rng_states() if rng is None else rng,
                 (_extra.param_group_hyperparameters(self.optimizer)
                  if hyperparameters is None else hyperparameters),
                 _extra.nontensor_state(self.optimizer, self._named),
                 _extra.param_group_names(self.optimizer, self._named))
        own = _extra.pack(*parts, shards=self._shards)
        if self._peers is None:
            return own
        return _extra.pack(*parts, shards=self._shards, peers=self._peers.send_and_receive(own))

    def _rng_states(self):
        """The RNG states stored with the step being checkpointed ({} without
        capture_rng). LowDiffPlus's replica overrides it: its steps run on
        another thread, after the training thread moved on."""
        return _extra.capture_rng() if self.capture_rng else {}

    def _own_blob(self, blob):
        """This rank's own extra state after a restore (PeerReplicas.own_extra_state)."""
        if self._peers is None:
            return blob
        return self._peers.own_extra_state(blob, self._engine.restored_extra_state_is_own,
                                           self.pool)
