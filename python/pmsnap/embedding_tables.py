"""Parameters checkpointed as embedding tables, and how their rows get marked.

Embedding tables (CheckpointedOptimizer's embeddings= / embedding_policy=):
the named parameters are checkpointed through the C++
diff::EmbeddingCheckpointer (full, one-shot differential, consecutive
incremental, intermittent differential with Check-N-Run's predictor, IncrCP
2-D chunks; optionally quantized) into the pool's chunk heap, in the same
epochs as the dense units. A table's unit holds the weight and every
optimizer-state tensor of the same row count (Adagrad's "sum", SGD's
"momentum_buffer", Adam's moments: float32 [rows] or [rows, dim]), so each
checkpoint writes the same rows of all of them; the rest of its state (the
scalar "step" tensor, which diff/ cannot encode by row) is a small dense unit
"<name>#dense" hooked around the same update, so both are captured by every
epoch together. That split, the table's shape rule and the rows rule below
are the C++ ones the libtorch hooks follow too (frontend/parameter_units.h,
through _pmsnap).

The rows a step changed come from an EmbeddingTracker on the table's
nn.Embedding / nn.EmbeddingBag (forward lookups; handed to the C++
RowTracker before each step) or, for a table without such a module, from its
gradient (non-zero rows, sparse indices). Optimizers whose update moves rows
without a gradient (SGD with momentum or weight decay, Adagrad with weight
decay, Adam, AdamW, RMSprop...) mark every row each step: the checkpoints
stay exact, the differential policies just save nothing; plain SGD, Adagrad
and SparseAdam are the ones that profit. pmsnap.list_checkpoints() and
pmsnap.recover_table() read any retained checkpoint of a table back.

Thread-safety: the training thread that owns the CheckpointedOptimizer.
"""

import torch
import torch.distributed as dist

from . import _pmsnap
from .errors import make_error
from .units import dtype_name

ROW_SOURCES = ("auto", "lookups", "gradients")


def make_embedding_options(policy, options, quantize_bits, expected_resumes, retain):
    """A _pmsnap.EmbeddingOptions from the constructor's keyword arguments."""
    opts = options if options is not None else _pmsnap.EmbeddingOptions()
    if not isinstance(opts, _pmsnap.EmbeddingOptions):
        raise make_error(_pmsnap.InvalidArgumentError,
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
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"retain must be an int >= 1, got {retain!r}")
        opts.retain = retain
    return opts


def embedding_modules(model):
    """{module name: module} of every nn.Embedding / nn.EmbeddingBag of `model`."""
    if model is None:
        return {}
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))}


def _torch_optimizer_name(optimizer):
    """The class name of the torch.optim optimizer `optimizer` is (a subclass of
    torch.optim.SGD counts as "SGD"), or its own class name."""
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim"):
            return cls.__name__
    return type(optimizer).__name__


def moves_rows_without_gradient(optimizer, param):
    """Whether the optimizer's update changes rows whose gradient is zero
    (_pmsnap.moves_rows_without_gradient, the C++ hooks' rule)."""
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), {})
    return _pmsnap.moves_rows_without_gradient(_torch_optimizer_name(optimizer),
                                               _hyperparameter(group, "momentum"),
                                               _hyperparameter(group, "weight_decay"))


def _hyperparameter(group, key):
    """group[key] as a float (0 if absent); one that is not a number (another
    optimizer's meaning of the key) counts as non-zero, the safe side: rows move."""
    try:
        return float(group.get(key, 0))
    except (TypeError, ValueError):
        return 1.0


class Table:
    """An embedding table: its parameter, module and how its rows get marked."""

    __slots__ = ("name", "param", "module_name", "source", "mark_all")

    def __init__(self, name, param, module_name, source, mark_all):
        self.name = name
        self.param = param
        self.module_name = module_name  # key in the internal EmbeddingTracker, or None
        self.source = source            # "lookups" or "gradients"
        self.mark_all = mark_all


def resolve_tables(embeddings, model, named, optimizer, rows):
    """{parameter name: Table} for the constructor's `embeddings` argument."""
    if rows not in ROW_SOURCES:
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"unknown embedding_rows '{rows}' (auto, lookups or gradients)")
    modules = embedding_modules(model)
    by_weight = {id(m.weight): name for name, m in modules.items()}
    params = dict(named)
    if embeddings is None:
        if model is None:
            raise make_error(_pmsnap.InvalidArgumentError,
                             "embedding_policy without embeddings= needs model= to find the "
                             "nn.Embedding / nn.EmbeddingBag tables")
        names = [n for n, p in named if id(p) in by_weight]
        if not names:
            raise make_error(_pmsnap.InvalidArgumentError,
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
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"embedding table '{name}' is not a parameter of the optimizer "
                             f"({len(named)} parameters: {known})")
        if name in tables:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"embedding table '{name}' named twice")
        _pmsnap.check_embedding_table(name, dtype_name(p.dtype), list(p.shape),
                                      dense_layout=not p.is_sparse)
        module_name = by_weight.get(id(p))
        if module_name is not None and getattr(modules[module_name], "max_norm", None) is not None:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"embedding table '{name}': its module uses max_norm, which "
                             "rewrites looked-up rows in the forward pass, outside the "
                             "optimizer step that pmsnap checkpoints around")
        source = rows
        if source == "auto":
            # Beside other ranks (DDP) the gradient is averaged over them: the
            # step changes the rows any rank looked up, and this rank's own
            # lookups would miss the others' (its checkpoints silently kept
            # stale rows). The averaged gradient names them all.
            source = ("lookups" if module_name is not None and not _trains_beside_other_ranks()
                      else "gradients")
        if source == "lookups" and module_name is None:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"embedding table '{name}' has no nn.Embedding / nn.EmbeddingBag "
                             "in model= to track its lookups; pass model=, or embedding_rows="
                             "'gradients'")
        tables[name] = Table(name, p, module_name if source == "lookups" else None, source,
                             moves_rows_without_gradient(optimizer, p))
    return tables


def _trains_beside_other_ranks():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gradient_rows(grad):
    """Sorted-or-not int64 row ids with a non-zero (or any sparse) gradient."""
    if grad.is_sparse:
        return grad._indices()[0].to("cpu", torch.int64).contiguous()
    return torch.nonzero(grad.reshape(grad.shape[0], -1).ne(0).any(dim=1)).flatten().to(
        "cpu", torch.int64).contiguous()
