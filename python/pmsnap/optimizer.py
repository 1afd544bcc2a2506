"""CheckpointedOptimizer and restore: pmsnap inside a PyTorch training loop.

pmsnap checkpoints weight by weight while training runs, so it must see every
parameter's update as its own event (docs/ARCHITECTURE.md, "From an optimizer
hook to a committed epoch"). A torch.optim optimizer updates all parameters
inside one step() and skips the ones whose .grad is None; CheckpointedOptimizer
uses exactly that: it hides every gradient, then for each parameter (last
first, the order backward produces gradients) shows only that parameter's
gradient and calls the wrapped optimizer's own step(), between the unit's
BeforeUpdate and AfterUpdate hooks. The arithmetic is the optimizer's own code
on the same tensors, so results are bitwise identical to one plain step()
(tests/python/test_equivalence.py).

Unit = one parameter plus every tensor in optimizer.state[param], in sorted key
order ("param", then e.g. "exp_avg", "exp_avg_sq", "step"). Non-tensor state
(RMSprop's int step), the param groups' hyperparameters and the global RNG
states travel in the checkpoint's pickled extra state (extra_state.py).

Lazily created optimizer state: torch creates state on a parameter's first
update (SGD's momentum buffer is a clone of the first gradient, so it cannot
be made eagerly with the same bits). The pool is therefore laid out after the
first step(): that step runs unobserved, then the engine opens with the state
torch made and captures it right away (a checkpoint of iteration 1).
restore() goes the other way: it reads the pool's manifest first and creates
missing state tensors with the recorded roles, dtypes and shapes, then the
engine overwrites them with the checkpoint's bytes. A parameter that gains
state after the pool was laid out (it had no gradient in the first step) is
reported as ModelMismatchError: use a fresh pool, or do one step in which
every trained parameter gets a gradient before wrapping.

Tensors are checkpointed in place through their data pointers: while the
engine is open, parameters and state tensors must keep their storage (no
`p.data = ...`, no `module.to(...)`); step() checks this and raises
ModelMismatchError naming the parameter. Should an optimizer replace a state
tensor instead of updating it in place, its value is copied back into the
registered tensor (bitwise) and the registered tensor is put back.

Embedding tables (embeddings= / embedding_policy=): the named parameters are
checkpointed through the C++ diff::EmbeddingCheckpointer (full, one-shot
differential, consecutive incremental, intermittent differential with
Check-N-Run's predictor, IncrCP 2-D chunks; optionally quantized) into the
pool's chunk heap, in the same epochs as the dense units. A table's unit
holds the weight and every optimizer-state tensor of the same row count
(Adagrad's "sum", SGD's "momentum_buffer", Adam's moments: float32 [rows] or
[rows, dim]), so each checkpoint writes the same rows of all of them; the
rest of its state (the scalar "step" tensor, which diff/ cannot encode by
row) is a small dense unit "<name>#dense" hooked around the same update, so
both are captured by every epoch together. The rows a step changed come from
an EmbeddingTracker on the table's nn.Embedding / nn.EmbeddingBag (forward
lookups; handed to the C++ RowTracker before each step) or, for a table
without such a module, from its gradient (non-zero rows, sparse indices).
Optimizers whose update moves rows without a gradient (SGD with momentum or
weight decay, Adagrad with weight decay, Adam, AdamW, RMSprop...) mark every
row each step: the checkpoints stay exact, the differential policies just
save nothing; plain SGD, Adagrad and SparseAdam are the ones that profit.
pmsnap.list_checkpoints() and pmsnap.recover_table() read any retained
checkpoint of a table back.

Thread-safety: one training thread owns a CheckpointedOptimizer (as the
engine's hooks); stats() may be called from any thread.
"""

import os

import torch

from . import _pmsnap
from . import extra_state as _extra
from .embedding import EmbeddingTracker

_STRATEGIES = ("1", "2", "3", "4", "adaptive")
_MODES = ("continuous", "every", "checkfreq")
_PARAM_ROLE = "param"
_DENSE_SUFFIX = "#dense"  # a table's dense companion unit (C++: EmbeddingDenseUnitName)
_ROW_SOURCES = ("auto", "lookups", "gradients")


def _error(cls, message):
    """An instance of pmsnap error class `cls` with .code set like the C++ ones."""
    e = cls(message)
    e.code = cls.__name__[:-len("Error")] if cls.__name__.endswith("Error") else cls.__name__
    return e


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _torch_dtype(name):
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise _error(_pmsnap.ModelMismatchError, f"pool holds an unknown dtype '{name}'")
    return dtype


def _shape_text(shape):
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _named_parameters(optimizer, model):
    """[(name, param)] in the optimizer's order; names from `model` when given."""
    names = {}
    if model is not None:
        for name, p in model.named_parameters():
            names.setdefault(id(p), name)
    out = []
    seen = set()
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) in seen:
                raise _error(_pmsnap.InvalidArgumentError,
                             f"parameter group{g}.param{i} appears twice in the optimizer")
            seen.add(id(p))
            out.append((names.get(id(p), f"group{g}.param{i}"), p))
    if not out:
        raise _error(_pmsnap.InvalidArgumentError, "the optimizer has no parameters")
    return out


def _state_tensors(optimizer, param):
    """Sorted [(key, tensor)] of the tensor entries in optimizer.state[param]."""
    state = optimizer.state.get(param)
    if not state:
        return []
    return sorted(((k, v) for k, v in state.items() if isinstance(v, torch.Tensor)),
                  key=lambda kv: str(kv[0]))


def _nontensor_state(optimizer, named):
    out = {}
    for name, p in named:
        state = optimizer.state.get(p)
        if state:
            rest = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
            if rest:
                out[name] = rest
    return out


def _param_group_hyperparameters(optimizer):
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _embedding_options(policy, options, quantize_bits, expected_resumes, retain):
    """A _pmsnap.EmbeddingOptions from the constructor's keyword arguments."""
    opts = options if options is not None else _pmsnap.EmbeddingOptions()
    if not isinstance(opts, _pmsnap.EmbeddingOptions):
        raise _error(_pmsnap.InvalidArgumentError,
                     f"embedding_options must be a pmsnap.EmbeddingOptions, got "
                     f"{type(opts).__name__}")
    if policy is not None:
        opts.policy = policy if isinstance(policy, _pmsnap.Policy) else \
            _pmsnap.parse_policy(str(policy))
    elif options is None:
        opts.policy = _pmsnap.Policy.INTERMITTENT_DIFFERENTIAL
    if quantize_bits is not None:
        opts.quantize = True
        opts.quantize_bits = 0 if quantize_bits == "auto" else int(quantize_bits)
        opts.expected_resumes = float(expected_resumes)
    if retain is not None:
        if not isinstance(retain, int) or retain < 1:
            raise _error(_pmsnap.InvalidArgumentError,
                         f"retain must be an int >= 1, got {retain!r}")
        opts.retain = retain
    return opts


def _embedding_modules(model):
    """{module name: module} of every nn.Embedding / nn.EmbeddingBag of `model`."""
    if model is None:
        return {}
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))}


def _moves_rows_without_gradient(optimizer, param):
    """Whether the optimizer's update changes rows whose gradient is zero."""
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), {})
    if isinstance(optimizer, torch.optim.SGD):
        return group.get("momentum", 0) != 0 or group.get("weight_decay", 0) != 0
    if isinstance(optimizer, torch.optim.Adagrad):
        return group.get("weight_decay", 0) != 0
    if isinstance(optimizer, torch.optim.SparseAdam):
        return False
    return True


class _Table:
    """An embedding table: its parameter, module and how its rows get marked."""

    __slots__ = ("name", "param", "module_name", "source", "mark_all")

    def __init__(self, name, param, module_name, source, mark_all):
        self.name = name
        self.param = param
        self.module_name = module_name  # key in the internal EmbeddingTracker, or None
        self.source = source            # "lookups" or "gradients"
        self.mark_all = mark_all


def _resolve_tables(embeddings, model, named, optimizer, rows):
    """{parameter name: _Table} for the constructor's `embeddings` argument."""
    if rows not in _ROW_SOURCES:
        raise _error(_pmsnap.InvalidArgumentError,
                     f"unknown embedding_rows '{rows}' (auto, lookups or gradients)")
    modules = _embedding_modules(model)
    by_weight = {id(m.weight): name for name, m in modules.items()}
    params = dict(named)
    if embeddings is None:
        if model is None:
            raise _error(_pmsnap.InvalidArgumentError,
                         "embedding_policy without embeddings= needs model= to find the "
                         "nn.Embedding / nn.EmbeddingBag tables")
        names = [n for n, p in named if id(p) in by_weight]
        if not names:
            raise _error(_pmsnap.InvalidArgumentError,
                         "the model has no nn.Embedding / nn.EmbeddingBag whose weight the "
                         "optimizer trains; name the tables with embeddings=")
    elif isinstance(embeddings, str):
        names = [embeddings]
    else:
        names = list(embeddings)
    tables = {}
    for name in names:
        if name not in params and name in modules:
            name = name + ".weight"  # a module name
        p = params.get(name)
        if p is None:
            known = ", ".join(n for n, _ in named[:8]) + (", ..." if len(named) > 8 else "")
            raise _error(_pmsnap.InvalidArgumentError,
                         f"embedding table '{name}' is not a parameter of the optimizer "
                         f"({len(named)} parameters: {known})")
        if name in tables:
            raise _error(_pmsnap.InvalidArgumentError, f"embedding table '{name}' named twice")
        if p.dtype != torch.float32 or p.dim() != 2 or p.is_sparse:
            raise _error(_pmsnap.InvalidArgumentError,
                         f"embedding table '{name}' must be a dense float32 [rows, dim] "
                         f"parameter, got {_dtype_name(p.dtype)} {_shape_text(p.shape)}")
        module_name = by_weight.get(id(p))
        if module_name is not None and getattr(modules[module_name], "max_norm", None) is not None:
            raise _error(_pmsnap.InvalidArgumentError,
                         f"embedding table '{name}': its module uses max_norm, which rewrites "
                         "looked-up rows in the forward pass, outside the optimizer step that "
                         "pmsnap checkpoints around")
        source = rows
        if source == "auto":
            source = "lookups" if module_name is not None else "gradients"
        if source == "lookups" and module_name is None:
            raise _error(_pmsnap.InvalidArgumentError,
                         f"embedding table '{name}' has no nn.Embedding / nn.EmbeddingBag in "
                         "model= to track its lookups; pass model=, or embedding_rows="
                         "'gradients'")
        tables[name] = _Table(name, p, module_name if source == "lookups" else None, source,
                              _moves_rows_without_gradient(optimizer, p))
    return tables


def _gradient_rows(grad):
    """Sorted-or-not int64 row ids with a non-zero (or any sparse) gradient."""
    if grad.is_sparse:
        return grad._indices()[0].to("cpu", torch.int64).contiguous()
    return torch.nonzero(grad.reshape(grad.shape[0], -1).ne(0).any(dim=1)).flatten().to(
        "cpu", torch.int64).contiguous()


def _is_row_tensor(t, rows):
    return t.dtype == torch.float32 and t.dim() in (1, 2) and t.shape[0] == rows


def _check_pool_tables(info, tables, pool):
    """ModelMismatchError if the pool's embedding tables differ from `tables`."""
    encoded = set(info.get("encoded_units", []))
    for name in sorted(encoded - set(tables)):
        raise _error(_pmsnap.ModelMismatchError,
                     f"pool {pool} checkpoints '{name}' as an embedding table but this optimizer "
                     "does not (pass embeddings= / embedding_policy= as when it was made)")
    for name in sorted(set(tables) - encoded):
        raise _error(_pmsnap.ModelMismatchError,
                     f"pool {pool} checkpoints '{name}' as a dense parameter, not as an "
                     "embedding table; use a new pool to switch it to embedding checkpoints")


def _check_pool_names(info, named, pool):
    """ModelMismatchError naming the first parameter the pool was not made for."""
    units = {name: tensors for name, tensors in info["units"]}
    ours = {name for name, _ in named}
    units = {name: tensors for name, tensors in units.items()
             if not (name.endswith(_DENSE_SUFFIX) and name[:-len(_DENSE_SUFFIX)] in ours)}
    for name, p in named:
        tensors = units.get(name)
        if tensors is None:
            raise _error(_pmsnap.ModelMismatchError,
                         f"pool {pool} has no unit for parameter '{name}' (it holds "
                         f"{len(units)} units, e.g. {', '.join(list(units)[:3])}): it was made "
                         "for another model")
        role, dtype, shape = tensors[0]
        if role != _PARAM_ROLE or dtype != _dtype_name(p.dtype) or list(shape) != list(p.shape):
            raise _error(_pmsnap.ModelMismatchError,
                         f"pool {pool}: parameter '{name}' is {_dtype_name(p.dtype)} "
                         f"{_shape_text(p.shape)} but the pool holds {dtype} {_shape_text(shape)}")
    if len(units) != len(named):
        extra = [name for name in units if name not in ours]
        raise _error(_pmsnap.ModelMismatchError,
                     f"pool {pool} holds units the optimizer does not have, e.g. '{extra[0]}'")


def _create_state_from_manifest(info, optimizer, named):
    """Creates optimizer state tensors the pool records but torch has not made yet.

    Checks every parameter first, so a mismatch leaves the optimizer untouched.
    """
    units = {name: tensors for name, tensors in info["units"]}
    # A table's state is split between its unit and its dense companion.
    units = {name: list(tensors) + (list(units.get(name + _DENSE_SUFFIX, []))
                                    if not name.endswith(_DENSE_SUFFIX) else [])
             for name, tensors in units.items()}
    for name, p in named:
        roles = {role: (dtype, list(shape)) for role, dtype, shape in units[name][1:]}
        for key, value in _state_tensors(optimizer, p):
            if key not in roles:
                raise _error(_pmsnap.ModelMismatchError,
                             f"parameter '{name}': the optimizer holds state '{key}' that the "
                             f"pool does not (pool roles: {sorted(roles)}); was the pool written "
                             "by another optimizer?")
            if (_dtype_name(value.dtype), list(value.shape)) != roles[key]:
                dtype, shape = roles[key]
                raise _error(_pmsnap.ModelMismatchError,
                             f"parameter '{name}': optimizer state '{key}' is "
                             f"{_dtype_name(value.dtype)} {_shape_text(value.shape)}, the pool "
                             f"holds {dtype} {_shape_text(shape)}")
    for name, p in named:
        for role, dtype, shape in units[name][1:]:
            state = optimizer.state[p]
            current = state.get(role)
            if (isinstance(current, torch.Tensor) and _dtype_name(current.dtype) == dtype
                    and list(current.shape) == list(shape) and current.is_contiguous()):
                continue
            if current is not None and not isinstance(current, torch.Tensor):
                raise _error(_pmsnap.ModelMismatchError,
                             f"parameter '{name}': optimizer state '{role}' is a "
                             f"{type(current).__name__} here but a tensor in the pool")
            state[role] = torch.zeros(shape, dtype=_torch_dtype(dtype), device=p.device)


class _Unit:
    """One parameter and its state tensors, as laid out: one engine unit, or for
    an embedding table its encoded unit plus a dense companion."""

    __slots__ = ("name", "param", "tensors", "ptrs", "shapes", "table")

    def __init__(self, name, param, state, table=False):
        self.name = name
        self.param = param
        self.tensors = [(_PARAM_ROLE, param)] + state  # [(role, tensor)]
        self.ptrs = [t.data_ptr() for _, t in self.tensors]
        self.shapes = [tuple(t.shape) for _, t in self.tensors]
        self.table = table

    def registrations(self, cuda):
        """[(unit name, views)]: the unit, then a table's "#dense" companion if any."""
        if not self.table:
            return [self._registration(self.name, self.tensors, cuda)]
        rows = self.param.shape[0]
        by_row = [(r, t) for r, t in self.tensors if _is_row_tensor(t, rows)]
        rest = [(r, t) for r, t in self.tensors if not _is_row_tensor(t, rows)]
        out = [self._registration(self.name, by_row, cuda)]
        if rest:
            out.append(self._registration(self.name + _DENSE_SUFFIX, rest, cuda))
        return out

    def encoded_roles(self):
        rows = self.param.shape[0]
        return [(r, tuple(t.shape)) for r, t in self.tensors if _is_row_tensor(t, rows)]

    def _registration(self, unit_name, tensors, cuda):
        views = []
        for role, t in tensors:
            if t.is_sparse or not t.is_contiguous():
                raise _error(_pmsnap.InvalidArgumentError,
                             f"parameter '{self.name}': tensor '{role}' is not contiguous dense "
                             "memory; pmsnap checkpoints tensors in place")
            if (t.device.type == "cuda") != cuda:
                raise _error(_pmsnap.InvalidArgumentError,
                             f"parameter '{self.name}': tensor '{role}' lives on {t.device} but "
                             f"the pmsnap device is {'cuda' if cuda else 'the host'}")
            views.append((str(role), t.data_ptr(), _dtype_name(t.dtype), list(t.shape)))
        return (unit_name, views)


class CheckpointedOptimizer:
    """Wraps a torch.optim optimizer; every step() is checkpointed into `pool`.

    Args:
      optimizer: any torch.optim optimizer that updates parameters independently
        (SGD, Adam, AdamW, Adagrad, RMSprop, ...; not LBFGS).
      pool: path of the pool file (created if missing; reopened and checked
        against the model if present). Put it on a DAX file system for real PM.
      model: the module, to name units after its parameters ("fc1.weight");
        otherwise units are "group<g>.param<i>". Pass the same to restore().
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
        nn.EmbeddingBag weight of `model`.
      embedding_policy: "full", "one-shot", "incremental", "intermittent"
        (default when embeddings are given) or "incrcp", or a pmsnap.Policy.
      quantize_bits: quantize table checkpoints rowwise with 2, 3, 4 or 8
        bits, or "auto" (from expected_resumes); None: exact.
      retain: newest table checkpoints kept recoverable (default 2).
      embedding_options: a pmsnap.EmbeddingOptions for everything else (IncrCP
        thresholds...); the arguments above override its fields.
      embedding_rows: "auto" (lookups of the table's module if `model` has
        one, else gradients), "lookups" or "gradients".
      workers: copy/persist worker threads (default 2, 1 on a 2-core machine).
      update_in_backward: update each parameter inside backward, the moment
        its gradient is accumulated (Tensor.register_post_accumulate_grad_hook),
        so its checkpoint copy starts while backward still runs on earlier
        layers; step() then only finishes the iteration. Bitwise the same
        result as backward() then step(); several backward passes before one
        step() (gradient accumulation) raise InvalidArgumentError instead of
        silently changing the result. Copies start right after each update
        (copy_start "after-update") unless copy_start says otherwise.
      copy_start: when a captured weight's copy starts: "auto" (host: the
        step's last captures wait for its end), "after-update" or
        "after-step"; see runtime::CopyStart.
      Other keyword arguments tune the engine and a newly created pool:
      part_bytes, extra_state_capacity, verify_on_open,
      check_free_space, reserve_bytes, checkfreq_overhead, print_summary.

    Errors raise pmsnap.Error subclasses carrying the runtime's message.
    """

    def __init__(self, optimizer, pool, *, model=None, mode=None, every=None, device="host",
                 strategy="adaptive", workers=None, part_bytes=4 << 20,
                 extra_state_capacity=256 << 10, verify_on_open=True, check_free_space=True,
                 reserve_bytes=0, checkfreq_overhead=0.035, start_iteration=0, capture_rng=True,
                 track_embeddings=False, print_summary=False, embeddings=None,
                 embedding_policy=None, quantize_bits=None, expected_resumes=1.0, retain=None,
                 embedding_options=None, embedding_rows="auto", update_in_backward=False,
                 copy_start=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise _error(_pmsnap.InvalidArgumentError,
                         f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise _error(_pmsnap.InvalidArgumentError,
                         "LBFGS couples all parameters in one update and cannot be stepped "
                         "parameter by parameter")
        if mode is None:
            mode = "every" if every is not None else "continuous"
        if mode not in _MODES:
            raise _error(_pmsnap.InvalidArgumentError,
                         f"unknown mode '{mode}' (continuous, every or checkfreq)")
        if mode == "continuous" and every is not None:
            raise _error(_pmsnap.InvalidArgumentError,
                         "every= is for mode 'every' (or 'checkfreq'), not 'continuous'")
        if every is not None and (not isinstance(every, int) or every < 1):
            raise _error(_pmsnap.InvalidArgumentError, f"every must be an int >= 1, got {every!r}")
        strategy = str(strategy)
        if strategy not in _STRATEGIES:
            raise _error(_pmsnap.InvalidArgumentError,
                         f"unknown conflict strategy '{strategy}' (\"1\", \"2\", \"3\", \"4\" or "
                         "\"adaptive\")")
        if not pool:
            raise _error(_pmsnap.InvalidArgumentError, "pool path is empty")
        # Fails early with InvalidArgumentError for a bad spec.
        self._device_name, self._device_note = _pmsnap.describe_device(device)
        self.optimizer = optimizer
        self.pool = os.fspath(pool)
        self.model = model
        self.iteration = int(start_iteration)
        self.extra_state = {}
        self.capture_rng = capture_rng
        if workers is None:
            # oneTBB lends an arena at most cpu_count - 1 worker threads (and
            # warns when asked for more), so 2 workers need 3 cores.
            workers = max(1, min(2, (os.cpu_count() or 2) - 1))
        if copy_start is None:
            copy_start = "after-update" if update_in_backward else "auto"
        self._engine_kwargs = dict(
            copy_start=copy_start, device=device, policy=mode, every=every or 1, checkfreq_overhead=checkfreq_overhead,
            strategy=strategy, workers=workers, part_bytes=part_bytes,
            extra_state_capacity=extra_state_capacity, verify_on_open=verify_on_open,
            check_free_space=check_free_space, reserve_bytes=reserve_bytes,
            print_summary=print_summary)
        self._cuda = self._device_name.startswith("cuda")
        self._named = _named_parameters(optimizer, model)
        self._engine = None
        self._units = None
        self._unit_ids = None
        self._closed = False
        self._final_stats = None
        self._pool_latest = None
        self.embedding_tracker = None
        self._tables = {}
        self._embedding_options = None
        self._table_tracker = None
        if (embeddings is not None or embedding_policy is not None
                or embedding_options is not None):
            self._embedding_options = _embedding_options(
                embedding_policy, embedding_options, quantize_bits, expected_resumes, retain)
            self._tables = _resolve_tables(embeddings, model, self._named, optimizer,
                                           embedding_rows)
        elif quantize_bits is not None or retain is not None:
            raise _error(_pmsnap.InvalidArgumentError,
                         "quantize_bits= and retain= are for embedding tables: pass "
                         "embeddings= or embedding_policy= too")
        if os.path.exists(self.pool):
            info = _pmsnap.read_pool(self.pool)
            _check_pool_names(info, self._named, self.pool)
            _check_pool_tables(info, self._tables, self.pool)
            if info["latest"] is not None:
                self._pool_latest = info["latest"]["iteration"]
        tracked = {t.module_name: dict(model.named_modules())[t.module_name]
                   for t in self._tables.values() if t.module_name is not None}
        if tracked:
            # Our own tracker: its marks are handed to the checkpointer each step.
            self._table_tracker = EmbeddingTracker(None, modules=tracked)
        if track_embeddings:
            if model is None:
                raise _error(_pmsnap.InvalidArgumentError, "track_embeddings needs model=")
            self.embedding_tracker = EmbeddingTracker(model)
        # update_in_backward: indices updated since the last step(), whether
        # this iteration's epoch step has begun, the first hook error.
        self._backward_hooks = []
        self._updated_in_backward = set()
        self._backward_step_begun = False
        self._backward_error = None
        if update_in_backward:
            self._register_backward_hooks()

    # --- the torch.optim surface -------------------------------------------------

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=False):
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
            raise _error(_pmsnap.FailedPreconditionError,
                         f"CheckpointedOptimizer for {self.pool} is closed")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if extra_state is not None:
            if not isinstance(extra_state, dict):
                raise _error(_pmsnap.InvalidArgumentError, "extra_state must be a dict")
            self.extra_state = extra_state
        step = self.iteration + 1
        if self._backward_hooks:
            return self._finish_backward_step(step, loss)
        if self._engine is None:
            self._check_resumes_pool(step)
            self._first_step(step)
            return loss
        self._check_unchanged()
        # Before any table's update: its capture takes the rows marked so far.
        self._mark_tables()
        self._engine.begin_step(step)
        self._update_and_end_step(step, self._engine)
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
            raise _error(_pmsnap.FailedPreconditionError,
                         "restore() must come before the first step() and before close()")
        if not os.path.exists(self.pool):
            raise _error(_pmsnap.NotFoundError, f"pool {self.pool} does not exist")
        info = _pmsnap.read_pool(self.pool)
        _check_pool_names(info, self._named, self.pool)
        _check_pool_tables(info, self._tables, self.pool)
        _create_state_from_manifest(info, self.optimizer, self._named)
        self._open_engine()
        try:
            iteration, _, data = self._engine.restore()
        except _pmsnap.Error:
            self._fail()
            raise
        if self._table_tracker is not None:
            self._table_tracker.clear()  # rows of the overwritten state
        blob = _extra.unpack(data)
        self._apply_blob(blob, restore_rng)
        self.iteration = int(iteration)
        self._pool_latest = self.iteration
        self.extra_state = dict(blob["user"])
        return self.iteration, self._user_view(blob)

    def flush(self):
        """Waits until the checkpoint in flight has committed (or failed)."""
        if self._engine is not None:
            self._engine.flush()

    def close(self, abandon=False):
        """Commits the checkpoint in flight (unless abandon) and closes the pool."""
        if self._closed:
            return
        self._closed = True
        for handle in self._backward_hooks:
            handle.remove()
        self._backward_hooks = []
        if self.embedding_tracker is not None:
            self.embedding_tracker.remove()
        if self._table_tracker is not None:
            self._table_tracker.remove()
        engine, self._engine = self._engine, None
        if engine is not None:
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
        """Runtime statistics as a dict (runtime::Stats plus iteration and pool)."""
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
            raise _error(_pmsnap.NotFoundError, f"'{table}' is not an embedding table here")
        return self._tables[table].mark_all

    @property
    def device_note(self):
        """Why the requested device was replaced (e.g. no GPU), or ""."""
        return self._device_note

    # --- internals ----------------------------------------------------------------

    def _stats_of(self, engine, per_step=False):
        try:
            s = engine.stats(per_step)
        except _pmsnap.Error:  # closed: the last stats taken stand
            return dict(self._final_stats or {})
        s["iteration"] = self.iteration
        s["pool"] = self.pool
        s["open"] = not engine.closed
        return s

    def _check_resumes_pool(self, step):
        """Refuses to overwrite a pool's checkpoints with a run that did not restore them."""
        if self._pool_latest is not None and step <= self._pool_latest:
            raise _error(_pmsnap.FailedPreconditionError,
                         f"pool {self.pool} already holds iteration {self._pool_latest} and this "
                         f"run would checkpoint iteration {step}: call restore() first (or "
                         "pmsnap.restore() and pass start_iteration=), or use a new pool")

    def _open_or_raise(self):
        if self._engine is None:
            raise _error(_pmsnap.FailedPreconditionError,
                         f"CheckpointedOptimizer for {self.pool} is not open (before the first "
                         "step() or restore(), or after close())")
        return self._engine

    def _open_engine(self):
        units = []
        for name, p in self._named:
            units.append(_Unit(name, p, _state_tensors(self.optimizer, p), name in self._tables))
        registrations = []
        unit_ids = []
        for u in units:
            regs = u.registrations(self._cuda)
            unit_ids.append(list(range(len(registrations), len(registrations) + len(regs))))
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
            rows = _gradient_rows(grad)
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

    def _update_and_end_step(self, step, engine, indices=None, error=None):
        """Updates the parameters (all, or `indices`) between their hooks on
        `engine` (None: unobserved), then ends step `step`. If a hook failed
        (or `error`, an earlier one), or the optimizer itself or Ctrl-C
        interrupted the update, the epoch in flight cannot be trusted: it is
        abandoned, the pool keeps its last commit, the engine is closed and
        the error raised."""
        try:
            self._step_parameters(engine, indices)
            if error is not None:
                raise error
        except BaseException:
            self.iteration = step
            self._fail()
            raise
        self.iteration = step
        self._engine.end_step(self._pack_extra())

    def _first_step(self, step, indices=None):
        """The first step: the update runs unobserved so that torch makes its
        state, then the pool is laid out and captures iteration `step` whole."""
        self._step_parameters(None, indices)
        self.iteration = step
        self._open_engine()
        # This epoch writes every table whole: earlier marks are moot.
        if self._table_tracker is not None:
            self._table_tracker.clear()
        self._engine.begin_step(step)
        self._engine.end_step(self._pack_extra())

    def _step_parameters(self, engine, indices=None):
        """Steps the optimizer one parameter at a time, last parameter first
        (all of them, or `indices`); raises the first hook error after every
        parameter was updated."""
        if indices is None:
            indices = range(len(self._named) - 1, -1, -1)
        error = None
        with self._only_gradient_shown() as show:
            for index in indices:
                error = self._step_one(engine, index, show, error)
        if error is not None:
            raise error

    def _only_gradient_shown(self):
        """Context: every gradient hidden from the optimizer; show(index)
        shows one while the optimizer steps (torch.optim skips parameters
        whose .grad is None). Everything is put back at exit."""
        params = [p for _, p in self._named]
        grads = [p.grad for p in params]

        class _Shown:
            def __enter__(inner):
                for p in params:
                    p.grad = None
                return inner

            def __call__(inner, index):
                return grads[index]

            def __exit__(inner, *exc):
                for p, grad in zip(params, grads):
                    p.grad = grad
                return False

        return _Shown()

    def _step_one(self, engine, index, shown, error):
        """Updates parameter `index` between its units' hooks (none once a
        hook failed: `error`, returned with any new one)."""
        grad = shown(index)
        if grad is None:
            return error  # the engine counts it as updated at the step's end
        p = self._named[index][1]
        hooked = engine is not None and error is None
        if hooked:
            try:
                for unit in self._unit_ids[index]:
                    engine.before_update(unit)
            except _pmsnap.Error as e:
                error, hooked = e, False
        p.grad = grad
        try:
            self.optimizer.step()
        finally:
            p.grad = None
        if engine is not None:
            self._repin_state(index)
        if hooked:
            try:
                for unit in self._unit_ids[index]:
                    engine.after_update(unit)
            except _pmsnap.Error as e:
                error = e
        return error

    # --- update_in_backward ---------------------------------------------------------

    def _register_backward_hooks(self):
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            raise _error(_pmsnap.InvalidArgumentError,
                         "update_in_backward needs torch >= 2.1 "
                         "(Tensor.register_post_accumulate_grad_hook); this is torch "
                         f"{torch.__version__}")
        for index, (_, p) in enumerate(self._named):
            self._backward_hooks.append(p.register_post_accumulate_grad_hook(
                lambda param, index=index: self._update_in_backward(index)))

    def _update_in_backward(self, index):
        """Post-accumulate-grad hook of parameter `index`: its update, now."""
        if self._closed:
            return
        name = self._named[index][0]
        if index in self._updated_in_backward:
            raise _error(_pmsnap.InvalidArgumentError,
                         f"parameter '{name}' got a second gradient before step(): with "
                         "update_in_backward=True each parameter is updated as soon as its "
                         "gradient is accumulated, so accumulating gradients over several "
                         "backward passes would change the result; call step() after every "
                         "backward pass, or use update_in_backward=False")
        engine = self._engine
        if engine is not None and not self._backward_step_begun and self._backward_error is None:
            try:
                self._check_unchanged()
                engine.begin_step(self.iteration + 1)
            except _pmsnap.Error as e:
                self._backward_error = e
        elif engine is None and not self._backward_step_begun:
            self._check_resumes_pool(self.iteration + 1)
        self._backward_step_begun = True
        if self._backward_error is not None:
            engine = None  # finish the update unobserved; step() raises
        elif engine is not None and name in self._tables:
            try:
                self._mark_table(name)
            except _pmsnap.Error as e:
                self._backward_error, engine = e, None
        with self._only_gradient_shown() as show:
            error = self._step_one(engine, index, show, None)
        if error is not None and self._backward_error is None:
            self._backward_error = error
        self._updated_in_backward.add(index)

    def _finish_backward_step(self, step, loss):
        """step() under update_in_backward: updates what backward did not
        (parameters whose gradient was set by hand), then ends the step."""
        remaining = [i for i in range(len(self._named) - 1, -1, -1)
                     if i not in self._updated_in_backward]
        begun, error = self._backward_step_begun, self._backward_error
        self._updated_in_backward = set()
        self._backward_step_begun = False
        self._backward_error = None
        if self._engine is None:
            if not begun:
                self._check_resumes_pool(step)
            self._first_step(step, remaining)
            return loss
        # After a hook error the rest is updated unobserved (the model stays
        # consistent), then the epoch in flight is abandoned, as in step().
        engine = self._engine if error is None else None
        try:
            if engine is not None and not begun:
                self._check_unchanged()
                engine.begin_step(step)
            if engine is not None:
                for index in remaining:
                    name = self._named[index][0]
                    if name in self._tables and self._named[index][1].grad is not None:
                        self._mark_table(name)
        except _pmsnap.Error as e:
            error, engine = e, None
        self._update_and_end_step(step, engine, remaining, error)
        return loss

    def _repin_state(self, index):
        """Keeps the registered state tensors in optimizer.state (see the module doc)."""
        unit = self._units[index]
        state = self.optimizer.state.get(unit.param)
        registered = unit.tensors[1:]
        count = 0
        if state:
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    count += 1
        if count != len(registered):
            keys = sorted(str(k) for k, v in (state or {}).items() if isinstance(v, torch.Tensor))
            raise _error(_pmsnap.ModelMismatchError,
                         f"parameter '{unit.name}': optimizer state tensors changed from "
                         f"{[r for r, _ in registered]} to {keys} after the pool was laid out "
                         "(a parameter without a gradient in the first step gained state "
                         "later?); use a new pool")
        for (key, tensor) in registered:
            current = state.get(key)
            if current is tensor:
                continue
            if (not isinstance(current, torch.Tensor) or current.shape != tensor.shape
                    or current.dtype != tensor.dtype):
                raise _error(_pmsnap.ModelMismatchError,
                             f"parameter '{unit.name}': optimizer state '{key}' changed shape or "
                             "dtype after the pool was laid out")
            tensor.copy_(current)
            state[key] = tensor

    def _check_unchanged(self):
        for unit in self._units:
            for (role, t), ptr, shape in zip(unit.tensors, unit.ptrs, unit.shapes):
                if t.data_ptr() != ptr or tuple(t.shape) != shape:
                    raise _error(_pmsnap.ModelMismatchError,
                                 f"parameter '{unit.name}': tensor '{role}' changed from "
                                 f"{_shape_text(shape)} to {_shape_text(t.shape)} (or moved) "
                                 "since the pool was laid out; pmsnap checkpoints tensors in "
                                 "place, so they must keep their storage (no .data "
                                 "reassignment or module.to() after wrapping)")

    def _pack_extra(self):
        if "rng" in self.extra_state:
            raise _error(_pmsnap.InvalidArgumentError,
                         "extra_state key 'rng' is reserved for the RNG states pmsnap saves")
        rng = _extra.capture_rng() if self.capture_rng else {}
        return _extra.pack(self.extra_state, rng, _param_group_hyperparameters(self.optimizer),
                           _nontensor_state(self.optimizer, self._named))

    def _apply_blob(self, blob, restore_rng):
        groups = blob.get("param_groups")
        if groups is not None:
            if len(groups) != len(self.optimizer.param_groups):
                raise _error(_pmsnap.ModelMismatchError,
                             f"pool {self.pool} was written with {len(groups)} param groups, the "
                             f"optimizer has {len(self.optimizer.param_groups)}")
            for group, saved in zip(self.optimizer.param_groups, groups):
                group.update(saved)
        by_name = dict(self._named)
        for name, values in blob.get("state", {}).items():
            p = by_name.get(name)
            if p is not None:
                self.optimizer.state[p].update(values)
        if restore_rng and blob.get("rng"):
            _extra.apply_rng(blob["rng"])

    @staticmethod
    def _user_view(blob):
        out = dict(blob["user"])
        out["rng"] = blob.get("rng", {})
        return out


def restore(pool, model, optimizer, *, restore_rng=True, device="host", verify_on_open=True,
            **embedding_kwargs):
    """Restores `model`'s parameters and `optimizer`'s state from `pool`.

    Returns (iteration, extra_state): the last committed iteration and the
    dict given to CheckpointedOptimizer.step() at that iteration, with an "rng"
    entry holding the RNG states (applied unless restore_rng=False). Continue
    with CheckpointedOptimizer(optimizer, pool, model=model,
    start_iteration=iteration). Raises NotFoundError (no pool or no
    checkpoint), ModelMismatchError (naming the parameter), CorruptionError.
    A pool with embedding tables needs the same embeddings= /
    embedding_policy= keyword arguments as the CheckpointedOptimizer that
    wrote it (embedding_kwargs are passed on).
    """
    wrapper = CheckpointedOptimizer(optimizer, pool, model=model, device=device,
                                    verify_on_open=verify_on_open, **embedding_kwargs)
    try:
        return wrapper.restore(restore_rng=restore_rng)
    finally:
        wrapper.close()


def has_checkpoint(pool):
    """True if `pool` exists and holds a committed checkpoint.

    Raises (e.g. NotAPoolError, CorruptionError) for a file that exists but
    cannot be read, so a damaged pool is never silently replaced.
    """
    if not os.path.exists(pool):
        return False
    return _pmsnap.read_pool(os.fspath(pool))["latest"] is not None


def _table_source(pool, table):
    """(engine or None, path) to read table checkpoints from."""
    if isinstance(pool, CheckpointedOptimizer):
        if pool._engine is not None:
            return pool._engine, pool.pool
        pool = pool.pool
    path = os.fspath(pool)
    if not os.path.exists(path):
        raise _error(_pmsnap.NotFoundError, f"pool {path} does not exist")
    return None, path


def list_checkpoints(pool, table):
    """Retained checkpoints of embedding table `table`, oldest first.

    `pool` is a pool path (not open elsewhere) or an open CheckpointedOptimizer.
    Returns [{"epoch", "iteration", "chunks", "chunk_bytes"}]. NotFoundError
    naming the table if the pool has no such table or no checkpoint of it.
    """
    engine, path = _table_source(pool, table)
    if engine is not None:
        return engine.list_checkpoints(table)
    return _pmsnap.list_checkpoints(path, table)


def recover_table(pool, table, epoch=None, *, state=False, with_info=False):
    """Embedding table `table` as of retained checkpoint `epoch` (default: newest).

    Returns a float32 torch tensor shaped like the parameter (dequantized if
    the checkpoints are quantized), or with state=True a dict {role: tensor}
    holding the parameter ("param") and its row-shaped optimizer state
    ("sum", "momentum_buffer", ...). with_info=True returns (result, info)
    with info = {"epoch", "iteration", "rows"}. `pool` is a pool path or an
    open CheckpointedOptimizer. NotFoundError naming the table for an unknown
    table or an epoch that is not retained; CorruptionError naming table and
    checkpoint for a damaged chunk.
    """
    engine, path = _table_source(pool, table)
    if engine is not None:
        info, arrays = engine.recover_table(table, epoch)
        roles = None
        for unit in pool._units:
            if unit.name == table:
                roles = unit.encoded_roles()
    else:
        info, arrays = _pmsnap.recover_table(path, table, epoch)
        units = dict(_pmsnap.read_pool(path)["units"])
        roles = [(role, tuple(shape)) for role, _, shape in units[table]]
    if roles is None or len(roles) != len(arrays):
        raise _error(_pmsnap.InternalError,
                     f"table '{table}': {len(arrays)} recovered tensors, expected "
                     f"{len(roles or [])}")
    tensors = {role: torch.from_numpy(array).reshape(shape)
               for (role, shape), array in zip(roles, arrays)}
    result = tensors if state else tensors[_PARAM_ROLE]
    return (result, dict(info)) if with_info else result
