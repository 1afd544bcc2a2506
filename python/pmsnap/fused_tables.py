"""torchrec's sharded embedding tables with a fused optimizer (DistributedModelParallel).

Under torchrec's DistributedModelParallel (DMP) an EmbeddingBagCollection's
tables are sharded over the ranks by a plan (table-wise, row-wise, ...), and
their optimizer (fbgemm's, e.g. EXACT_ROWWISE_ADAGRAD) runs fused into
backward(): the dense optimizer the user steps never sees them. pmsnap finds
them through DMP's `fused_optimizer` (a torchrec KeyedOptimizer whose params
and state are ShardedTensors) and checkpoints each local shard in place as a
unit of its own: the weight shard plus every state shard of it ("momentum1"),
named by the table's fully qualified name ("sparse_arch.ebc.embedding_bags.t0.weight").
Each rank's pool holds the shards of its plan, weight by weight as for any
parameter; beside them the checkpoint records each shard's layout (the
table's global shape and the shard's offsets, per state tensor too) so that
a restore at another plan or world size reads the rows it needs
(sharded.load_resharded).

Ordering. A fused table changes inside the backward of the next iteration,
where no optimizer step of pmsnap's runs. A forward pre-hook on every
sharded module begins the engine's step and the tables' updates (waiting for
their copy of the previous checkpoint, if still in flight) before the
lookup, under autograd only (an evaluation forward under no_grad updates
nothing); CheckpointedOptimizer.step() ends them after the dense update, so
the checkpoint of iteration t holds the tables as backward t left them, with
the dense parameters of step t.

Thread-safety: the training thread that owns the CheckpointedOptimizer.
"""

import torch

from . import _pmsnap
from .errors import make_error


class FusedTable:
    """This rank's shard of one fused table: its weight rows and optimizer
    state (plain tensors viewing fbgemm's storage, updated in place)."""

    __slots__ = ("name", "weight", "state", "layout")

    def __init__(self, name, weight, state, layout):
        self.name = name
        self.weight = weight
        self.state = state  # {role: tensor}
        self.layout = layout


def _shard_of(name, sharded):
    """(local tensor, layout) of this rank's one shard of ShardedTensor `sharded`."""
    shards = sharded.local_shards()
    if len(shards) != 1:
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"fused table '{name}' has {len(shards)} shards on this rank; pmsnap "
                         "checkpoints plans that give a rank at most one shard of a table "
                         "(table-wise, row-wise, column-wise with one column block per rank)")
    meta = shards[0].metadata
    return shards[0].tensor, {"global_shape": [int(d) for d in sharded.metadata().size],
                              "offsets": [int(o) for o in meta.shard_offsets]}


def discover(model):
    """[FusedTable] of the fused tables this rank holds shards of in `model`
    (a torchrec DistributedModelParallel; [] for any other module, or one
    without fused tables), in name order."""
    fused = getattr(model, "fused_optimizer", None)
    params = getattr(fused, "params", None)
    if not isinstance(params, dict) or not hasattr(model, "plan"):
        return []
    tables = []
    for name in sorted(params):
        sharded = params[name]
        if not hasattr(sharded, "local_shards"):
            continue  # a replicated (data-parallel) table: a plain parameter of its optimizer
        if not sharded.local_shards():
            continue  # table-wise: another rank's table
        weight, layout = _shard_of(name, sharded)
        state, roles = {}, {}
        for key, value in fused.state.get(sharded, {}).items():
            if not hasattr(value, "local_shards"):
                continue
            role = str(key).rpartition(".")[2]  # "t0.momentum1" -> "momentum1"
            state[role], roles[role] = _shard_of(f"{name}.{role}", value)
        layout["roles"] = roles
        for role, t in [("param", weight)] + list(state.items()):
            if not t.is_contiguous():
                raise make_error(_pmsnap.InvalidArgumentError,
                                 f"fused table '{name}': its {role} shard is not contiguous "
                                 "memory; pmsnap checkpoints tensors in place")
        tables.append(FusedTable(name, weight, state, layout))
    return tables


def plan_fingerprint(model):
    """Text naming every sharded table of `model`'s plan with its global
    shape, the same on every rank (each rank holds other tables' shards);
    "" for a model that is not a torchrec DMP with fused tables."""
    if not hasattr(getattr(model, "fused_optimizer", None), "params") or not hasattr(model, "plan"):
        return ""
    entries = []
    for path, module_plan in sorted(model.plan.plan.items()):
        for table, sharding in sorted(module_plan.items()):
            shards = sharding.sharding_spec.shards if sharding.sharding_spec else []
            shape = [max(int(s.shard_offsets[d]) + int(s.shard_sizes[d]) for s in shards)
                     for d in range(len(shards[0].shard_offsets))] if shards else []
            entries.append(f"{path}.{table}:{shape}")
    return ";".join(entries)


def sharded_modules(model):
    """torchrec's sharded modules of `model` (where the lookups run)."""
    from torchrec.distributed.types import ShardedModule
    return [m for m in model.modules() if isinstance(m, ShardedModule)]


def policy_tables(tables, embeddings):
    """{name: embedding_tables.Table} of the fused tables an embedding policy
    applies to: `embeddings` (names, or None: every fused table on this
    rank), their rows marked from their lookups (FusedLookups).
    InvalidArgumentError naming a table that is not a fused one."""
    from .embedding_tables import Table
    fused = {t.name: t for t in tables}
    names = list(fused) if embeddings is None else \
        [embeddings] if isinstance(embeddings, str) else list(embeddings)
    out = {}
    for name in names:
        table = fused.get(name)
        if table is None:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"embedding table '{name}' is not a fused table of this rank's "
                             f"shards of the torchrec plan ({', '.join(sorted(fused)) or 'none'})")
        _pmsnap.check_embedding_table(name, str(table.weight.dtype).replace("torch.", ""),
                                      list(table.weight.shape), dense_layout=True)
        # fbgemm's fused update is sparse: only looked-up rows change.
        out[name] = Table(name, table.weight, name, "lookups", mark_all=False)
    return out


class FusedLookups:
    """Which rows of each fused table shard the lookups touched: a
    forward pre-hook on every embedding kernel of torchrec's sharded modules
    (after the input distribution, where each feature's ids are rows of this
    rank's shard) marks them in a C++ RowTracker per table; the same
    interface as EmbeddingTracker (row_tracker, clear, remove)."""

    def __init__(self, model, tables):
        self._trackers = {}
        self._handles = []
        fqns = _table_fqns(model)
        for module in sharded_modules(model):
            for lookup in getattr(module, "_lookups", []):
                for kernel in getattr(lookup, "_emb_modules", []):
                    self._hook_kernel(kernel, fqns.get(id(module), {}), tables)
        missing = sorted(set(tables) - set(self._trackers))
        if missing:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"fused table '{missing[0]}': pmsnap found no embedding kernel of "
                             "torchrec's that looks it up, so it cannot tell which rows change "
                             "(its embedding policy needs them); checkpoint it without one")

    def _hook_kernel(self, kernel, fqns, tables):
        features = []  # (feature name, its table's tracker, the table's name)
        for config in getattr(getattr(kernel, "config", None), "embedding_tables", []):
            name = fqns.get(config.name)
            if name not in tables:
                continue
            tracker = _pmsnap.RowTracker(int(config.local_rows))
            self._trackers[name] = tracker
            features += [(feature, tracker, name) for feature in config.feature_names]
        if features:
            self._handles.append(kernel.register_forward_pre_hook(
                lambda module, inputs: _mark_lookups(inputs, features)))

    def row_tracker(self, name):
        return self._trackers[name]

    def clear(self):
        for tracker in self._trackers.values():
            tracker.clear()

    def remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _mark_lookups(inputs, features):
    ids_by_feature = inputs[0].to_dict()
    for feature, tracker, name in features:
        ids = ids_by_feature[feature].values()
        if ids.dtype not in (torch.int64, torch.int32):
            ids = ids.long()
        ids = ids.contiguous()
        try:
            tracker.mark(ids.data_ptr(), ids.numel(), str(ids.dtype).replace("torch.", ""))
        except _pmsnap.Error as e:
            raise make_error(type(e), f"fused table '{name}', feature '{feature}': {e}") from e


def _table_fqns(model):
    """{id(sharded module): {table name: its weight's FQN}} from the plan."""
    modules = {name: m for name, m in model.named_modules()}
    out = {}
    for path, module_plan in model.plan.plan.items():
        module = next((m for name, m in modules.items()
                       if name == path or name.endswith("." + path)), None)
        if module is None:
            continue
        attribute = "embedding_bags" if hasattr(module, "embedding_bags") else "embeddings"
        out[id(module)] = {table: f"{path}.{attribute}.{table}.weight" for table in module_plan}
    return out


class StateView:
    """optimizer.state and param_groups as pmsnap's state code reads them:
    the dense optimizer's, plus each fused table's state keyed by its weight
    shard. Writes go to the dense optimizer (fused state exists already)."""

    def __init__(self, optimizer, tables):
        self._optimizer = optimizer
        self._fused = {id(t.weight): t.state for t in tables}
        self.state = self

    @property
    def param_groups(self):
        return self._optimizer.param_groups

    def get(self, param, default=None):
        fused = self._fused.get(id(param))
        return fused if fused is not None else self._optimizer.state.get(param, default)

    def __getitem__(self, param):
        fused = self._fused.get(id(param))
        return fused if fused is not None else self._optimizer.state[param]


class FusedTableUpdates:
    """The fused-table part of CheckpointedOptimizer (a base class it mixes
    in, like UpdateInBackward): finds the tables, hooks their lookups, and
    brackets their in-backward updates with the engine's hooks (module doc).
    It shares UpdateInBackward's begun-step flag and first error: either a
    lookup or a gradient hook may begin the step."""

    def _init_fused_tables(self, model, optimizer):
        self._fused = discover(model) if model is not None else []
        dense = {id(p) for _, p in self._named}
        for table in self._fused:
            if id(table.weight) in dense:
                raise make_error(_pmsnap.InvalidArgumentError,
                                 f"fused table '{table.name}' is also a parameter of the wrapped "
                                 "optimizer; torchrec updates it in backward: give the optimizer "
                                 "the dense parameters only (torchrec's in_backward_optimizer_filter)")
        self._state_view = StateView(optimizer, self._fused) if self._fused else optimizer
        self._all_named = self._named + [(t.name, t.weight) for t in self._fused]
        self._fused_unit_ids = []
        self._fused_updating = False
        self._fused_hooks = ([m.register_forward_pre_hook(self._before_fused_lookup)
                              for m in sharded_modules(model)] if self._fused else [])

    def _remove_fused_hooks(self):
        for handle in self._fused_hooks:
            handle.remove()
        self._fused_hooks = []

    def _before_fused_lookup(self, module, inputs):
        """Forward pre-hook of a sharded module: the tables' updates begin
        (once per iteration, and not under no_grad, which updates nothing)."""
        del module, inputs
        engine = self._engine
        if (self._closed or engine is None or self._fused_updating
                or not torch.is_grad_enabled()):
            return
        if not self._backward_step_begun and self._backward_error is None:
            try:
                self._finish_open_step()
                self._check_unchanged()
                engine.begin_step(self.iteration + 1)
            except _pmsnap.Error as e:
                self._backward_error = e
        self._backward_step_begun = True
        if self._backward_error is not None:
            return  # step() updates unobserved, then raises it
        self._fused_updating = True
        try:
            for unit in self._fused_unit_ids:
                engine.before_update(unit)
        except _pmsnap.Error as e:
            self._backward_error = e

    def _end_fused_updates(self, engine):
        """After backward updated the tables (at step()): the rows their
        lookups touched are marked (tables under an embedding policy), then
        their updates end on `engine` (None: the step is unobserved)."""
        updating, self._fused_updating = self._fused_updating, False
        if updating and engine is not None:
            for table in self._fused:
                if table.name in self._tables:
                    self._mark_table(table.name)
            for unit in self._fused_unit_ids:
                engine.after_update(unit)
