"""CPR: partial recovery for recommendation models (Maeng et al., MLSys 2021).

Embedding tables are sharded over N_emb shards (model-parallel: one or more
shards per rank, or N_emb logical shards in one process as in the paper's
emulation, section 5.1); dense parts are data-parallel. pmsnap checkpoints
every rank's dense parts and embedding shard into its pool every iteration
(CheckpointedOptimizer), so a restarted rank whose pool survived loses
nothing. CPR covers the failure that pool cannot: the loss of a shard's node.
Each shard's tables are also saved, every T_save, into their own pool (the
copy a replacement node restores from; in production another node or
storage), through the same engine, pipeline and chunk heap:

    saves = pmsnap.cpr.ShardSaves("/dev/shm/run.shard0.pool", {"emb.0": emb0.weight},
                                  policy="mfu", modules={"emb.0": emb0})
    saves.save(iteration, samples)          # at the plan's interval (r * T_save for MFU/SSU)

When shards fail, only their tables go back to their last save; every other
shard keeps its state (its newest epoch after a restart-all), and the dense
parts and the data position follow the global recovery (opt.restore()):

    cpr = pmsnap.cpr.PartialRecovery({0: saves0, 1: saves1}, total_samples=S)
    it, extra = opt.restore(); cpr.load(extra)     # the ledger survives restarts
    report = cpr.recover(failed=[1], samples=extra["samples"])
    opt.step(extra_state=cpr.extra_state({"samples": n}))

recover() adds (S_i - S_last_save) / (S_total * N_emb) per failed shard to the
portion of lost samples (PLS, Eq. 3), kept in the live pool's extra state
(`pmsnap info` shows it). plan() picks the save interval for a target PLS
(Eq. 4) and falls back to full recovery when partial recovery's expected
overhead (Eq. 2) does not beat full recovery's (Eq. 1) at its optimum.

Policies of the shard saves: "full" (CPR-vanilla: the whole shard each save),
"mfu" (CPR-MFU: the r*N most used rows since last saved, 4-byte counters),
"ssu" (CPR-SSU: a sub-sampled used-row list of at most r*N rows).

Thread-safety: the training thread.
"""

import struct

import torch

from . import _pmsnap
from .errors import make_error
from .units import dtype_name

LEDGER_KEY = "pmsnap_cpr"
POLICIES = {"full": "full", "vanilla": "full", "mfu": "mfu", "cpr-mfu": "mfu", "ssu": "ssu",
            "cpr-ssu": "ssu"}


def save_interval_for_pls(target_pls, emb_shards, mean_time_to_failure):
    """Eq. 4 solved for the interval: 2 * PLS * N_emb * T_fail."""
    return _pmsnap.cpr_save_interval_for_pls(target_pls, emb_shards, mean_time_to_failure)


def expected_pls(save_interval, emb_shards, mean_time_to_failure):
    """Eq. 4: 0.5 * T_save / (T_fail * N_emb)."""
    return _pmsnap.cpr_expected_pls(save_interval, emb_shards, mean_time_to_failure)


def overheads(save_seconds, load_seconds, reschedule_seconds, mean_time_to_failure,
              total_seconds, save_interval):
    """{"full": Eq. 1, "partial": Eq. 2, "full_optimal_interval"} at `save_interval`."""
    return _pmsnap.cpr_overheads(save_seconds, load_seconds, reschedule_seconds,
                                 mean_time_to_failure, total_seconds, save_interval)


def plan(save_seconds, load_seconds, reschedule_seconds, mean_time_to_failure, total_seconds,
         target_pls, emb_shards, min_relative_benefit=0.05):
    """CPR's decision (diff::cpr::PlanRecovery) as a dict: "partial" (bool),
    "save_interval" (the one to use), both intervals and expected overheads
    (in the unit of the times given), "expected_pls" and a one-line "reason".
    Times in one unit (seconds or iterations). InvalidArgumentError names a
    bad field."""
    return _pmsnap.cpr_plan(save_seconds, load_seconds, reschedule_seconds,
                            mean_time_to_failure, total_seconds, target_pls, emb_shards,
                            min_relative_benefit)


def _policy_options(policy, ratio, ssu_period, baseline_every, seed, retain):
    name = POLICIES.get(str(policy).lower())
    if name is None:
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"unknown CPR save policy '{policy}' (full, mfu or ssu)")
    opts = _pmsnap.EmbeddingOptions()
    opts.policy = _pmsnap.parse_policy(name)
    opts.retain = retain
    opts.priority_ratio = float(ratio)
    opts.ssu_period = int(ssu_period)
    opts.baseline_every = int(baseline_every)
    opts.priority_seed = int(seed)
    return name, opts


class ShardSaves:
    """CPR's saves of one embedding shard in their own pool.

    `tables`: {name: tensor or [tensor, ...]}: each table's weight, then any
    row-shaped optimizer state (Adagrad's sum...): float32, CPU, contiguous,
    [rows] or [rows, dim]; the live tensors, restored in place. `modules`:
    {name: nn.Embedding / nn.EmbeddingBag} whose lookups feed MFU's counters
    or SSU's list (forward hooks); or call mark() yourself. Raises
    InvalidArgumentError for a bad tensor or policy, the engine's errors for
    the pool (naming it).
    """

    def __init__(self, pool, tables, *, policy="full", ratio=0.125, ssu_period=2,
                 baseline_every=32, seed=0x5eed, retain=2, modules=None, workers=1,
                 chunk_heap_bytes=0):
        self.pool = str(pool)
        self.policy, self._options = _policy_options(policy, ratio, ssu_period, baseline_every,
                                                     seed, retain)
        self._units = []
        self._names = []
        for name, tensors in tables.items():
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            specs = []
            for i, t in enumerate(tensors):
                if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
                    raise make_error(_pmsnap.InvalidArgumentError,
                                     f"CPR shard pool {self.pool}: table '{name}' tensor {i} must "
                                     f"be a contiguous float32 CPU tensor, got {t.dtype} on "
                                     f"{t.device}")
                specs.append(("weight" if i == 0 else f"state{i}", t.data_ptr(),
                              dtype_name(t.dtype), list(t.shape), False))
            self._units.append((name, specs))
            self._names.append(name)
        self._tensors = tables  # keep the storages alive
        self._workers = workers
        self._chunk_heap_bytes = chunk_heap_bytes
        self._engine = None
        self._handles = []
        self.last_save = None  # (iteration, samples) of the newest committed save
        self.saves = 0
        self.save_seconds = 0.0
        self.bytes_saved = 0
        self._open()
        for name, module in (modules or {}).items():
            self._handles.append(module.register_forward_hook(self._hook(name)))

    def _open(self):
        self._engine = _pmsnap.Engine(
            self.pool, self._units, policy="every", every=1, workers=self._workers,
            encoded_units=self._names, embedding_options=self._options,
            chunk_heap_bytes=self._chunk_heap_bytes)

    def _hook(self, name):
        def hook(module, inputs, output):
            del module, output
            self.mark(name, inputs[0])
        return hook

    @property
    def tables(self):
        return list(self._names)

    def mark(self, table, ids):
        """Counts lookups of rows `ids` (an int tensor) of `table` for MFU/SSU
        (and marks them changed). Cheap for policy "full", which ignores them."""
        ids = ids.reshape(-1)
        if ids.is_cuda:
            ids = ids.cpu()
        if ids.dtype not in (torch.int64, torch.int32):
            ids = ids.long()
        ids = ids.contiguous()
        self._engine.mark_rows(table, ids.data_ptr(), ids.numel(),
                               str(ids.dtype).replace("torch.", ""))

    def save(self, iteration, samples):
        """One CPR save of every table of the shard as of now, tagged with the
        training `iteration` (increasing) and `samples` processed; returns
        once it has committed. Returns the seconds it took (O_save)."""
        import time
        start = time.perf_counter()
        engine = self._engine
        engine.begin_step(int(iteration))
        for u in range(len(self._units)):
            engine.before_update(u)
            engine.after_update(u)
        engine.end_step(struct.pack("<QQ", int(iteration), int(samples)))
        engine.flush()
        seconds = time.perf_counter() - start
        self.last_save = (int(iteration), int(samples))
        self.saves += 1
        self.save_seconds += seconds
        self.bytes_saved += sum(engine.last_checkpoint(n)["bytes_written"] for n in self._names)
        return seconds

    def restore(self):
        """Puts every table of the shard back to its newest save, in place (a
        replaced node's view: the engine is reopened, access records start
        empty). Returns (iteration, samples) of that save. NotFoundError when
        nothing was saved yet."""
        self._engine.close()
        self._open()
        _, _, extra = self._engine.restore()
        iteration, samples = struct.unpack("<QQ", bytes(extra)[:16])
        self.last_save = (iteration, samples)
        return iteration, samples

    def last_checkpoint(self, table):
        """What `table`'s last save wrote: rows_written, bytes_written, full,
        construction_seconds, select_seconds (MFU/SSU), access_record_bytes."""
        return self._engine.last_checkpoint(table)

    def stats(self):
        """Saves made, their total seconds, the access record's bytes and the
        tables' bytes (for CPR's Table 1)."""
        record = sum(self._engine.last_checkpoint(n)["access_record_bytes"]
                     for n in self._names) if self.saves else 0
        table_bytes = sum(sum(t.numel() * t.element_size() for t in
                              ([v] if isinstance(v, torch.Tensor) else v))
                          for v in self._tensors.values())
        return {"policy": self.policy, "saves": self.saves, "save_seconds": self.save_seconds,
                "bytes_saved": self.bytes_saved, "access_record_bytes": record,
                "table_bytes": table_bytes}

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._engine is not None:
            self._engine.close()


class PartialRecovery:
    """Partial recovery over N_emb shards and the PLS ledger.

    `shards`: {shard id: ShardSaves or [ShardSaves, ...]} of the shards this
    process holds (all of
    them in a single-process emulation, its own on each rank). `emb_shards`:
    N_emb (default: len(shards) times the world size when distributed).
    `total_samples`: S_total of the job. `live`: an optional
    CheckpointedOptimizer checkpointing the same tables as embedding tables:
    recover() marks every row of a restored table changed there, so its next
    differential checkpoint holds the restored values. `distributed`: gather
    the failed shards' save points over torch.distributed (every rank calls
    recover() together).
    """

    def __init__(self, shards, *, total_samples, emb_shards=None, live=None,
                 distributed=False):
        self.shards = dict(shards)
        self._distributed = distributed
        world = 1
        if distributed:
            import torch.distributed as dist
            world = dist.get_world_size()
        self.emb_shards = int(emb_shards if emb_shards is not None else len(self.shards) * world)
        self.ledger = _pmsnap.PlsLedger(int(total_samples), self.emb_shards)
        self._live = live
        self.reports = []

    @property
    def pls(self):
        return self.ledger.pls

    def extra_state(self, user=None):
        """`user` (a dict) with the ledger under "pmsnap_cpr": pass it to the
        live optimizer's step(extra_state=...) so the PLS survives restarts."""
        out = dict(user or {})
        out[LEDGER_KEY] = self.ledger.serialize()
        return out

    def load(self, extra_state):
        """Takes the ledger back from a restored extra-state dict (no-op when it
        holds none: a run before its first failure). CorruptionError for a
        damaged ledger."""
        image = (extra_state or {}).get(LEDGER_KEY)
        if image is not None:
            self.ledger = _pmsnap.PlsLedger.parse(image)
        return self.ledger

    def recover(self, failed, samples):
        """Shards `failed` (global ids) lost their state at `samples` samples
        processed: each of them held here goes back to its last save, the
        others are not touched; the ledger adds Eq. 3's term per failed shard.
        Returns {"failed", "restored": {shard: (iteration, samples)},
        "pls_before", "pls"}."""
        failed = sorted(set(int(s) for s in failed))
        restored = {}
        for shard in failed:
            if shard in self.shards:
                # A shard saved as several ShardSaves (e.g. MFU for its large
                # tables, full for the small ones) lost the samples since its
                # oldest newest-save.
                points = [s.restore() for s in self._saves_of(shard)]
                restored[shard] = min(points, key=lambda p: p[1])
                if self._live is not None:
                    for s in self._saves_of(shard):
                        for table in s.tables:
                            if table in self._live.embedding_tables:
                                self._live.mark_all_rows(table)
        saves = dict(restored)
        if self._distributed:
            import torch.distributed as dist
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, restored)
            for part in gathered:
                saves.update(part)
        missing = [s for s in failed if s not in saves]
        if missing:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"CPR: failed shards {missing} are held by no rank "
                             f"(shards here: {sorted(self.shards)})")
        before = self.ledger.pls
        self.ledger.record_failure(int(samples), [saves[s][1] for s in failed])
        report = {"failed": failed, "restored": restored, "saves": saves,
                  "pls_before": before, "pls": self.ledger.pls}
        self.reports.append(report)
        return report

    def _saves_of(self, shard):
        saves = self.shards[shard]
        return list(saves) if isinstance(saves, (list, tuple)) else [saves]

    def close(self):
        for shard in self.shards:
            for s in self._saves_of(shard):
                s.close()


def read_pls(pool):
    """The PLS ledger in pool `pool`'s newest extra state as a dict, or None."""
    info = _pmsnap.read_pool(str(pool))
    latest = info.get("latest")
    if not latest:
        return None
    reader = _pmsnap.CheckpointReader(str(pool))
    try:
        extra = bytes(reader.extra_state(latest["epoch"]))
    finally:
        reader.close()
    ledger = _pmsnap.find_pls_ledger(extra)
    if ledger is None:
        return None
    return {"pls": ledger.pls, "failed_shards": ledger.failed_shards,
            "emb_shards": ledger.emb_shards, "lost_samples": ledger.lost_samples,
            "total_samples": ledger.total_samples, "failures": ledger.failures}
