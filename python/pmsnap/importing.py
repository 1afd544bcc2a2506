"""CheckpointedOptimizer(init_from=...): an exported or foreign checkpoint
(export.read_export's dict) loaded into a live model and optimizer.

The model's parameters are overwritten in place (their storage, which the
engine checkpoints through, stays), every parameter the optimizer trains, and no tensor the model lacks.
Optimizer state goes through torch's own
torch.distributed.checkpoint.state_dict.set_optimizer_state_dict, which maps
parameter names to the optimizer's parameters as get_optimizer_state_dict
names them, and restores the param groups' hyperparameters.

Thread-safety: the training thread, before the first step().
"""

from . import _pmsnap
from .errors import make_error


def load_into(data, model, optimizer, named, path):
    """Loads data["model"] (and data["optimizer"] if any) into `model` and
    `optimizer`; ModelMismatchError naming `path` and the parameter if the
    checkpoint was made for another model."""
    names = [name for name, _ in named]
    tensors = data["model"]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise make_error(_pmsnap.ModelMismatchError,
                         f"checkpoint {path} has no tensor for parameter '{missing[0]}' (it holds "
                         f"{len(tensors)}, e.g. {', '.join(sorted(tensors)[:3])})")
    for name, p in named:
        t = tensors[name]
        if t.shape != p.shape or t.dtype != p.dtype:
            raise make_error(_pmsnap.ModelMismatchError,
                             f"checkpoint {path}: parameter '{name}' is {p.dtype} "
                             f"{list(p.shape)} here but {t.dtype} {list(t.shape)} there")
    # Not strict: a pool written before pmsnap saved the model's buffers
    # (BatchNorm statistics), or with buffers=False, and its exports lack them.
    try:
        unexpected = model.load_state_dict(tensors, strict=False).unexpected_keys
    except RuntimeError as e:
        raise make_error(_pmsnap.ModelMismatchError,
                         f"checkpoint {path} does not fit the model: {e}") from e
    if unexpected:
        raise make_error(_pmsnap.ModelMismatchError,
                         f"checkpoint {path} holds '{unexpected[0]}', which the model does not "
                         "have: it was made for another model")
    if data["optimizer"] is None:
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    try:
        set_optimizer_state_dict(model, optimizer, data["optimizer"])
    except (KeyError, RuntimeError, ValueError) as e:
        raise make_error(_pmsnap.ModelMismatchError,
                         f"checkpoint {path}: its optimizer state does not fit this optimizer "
                         f"({type(e).__name__}: {e})") from e
