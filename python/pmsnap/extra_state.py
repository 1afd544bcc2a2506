"""What pmsnap stores next to each checkpoint besides the tensors.

Every epoch's commit record carries one opaque byte string (the engine's extra
state). The Python package fills it with one pickled dict:

    {"format": 1,
     "user": {...},                      # the caller's dict: data position, ...
     "rng": {"torch": ByteTensor,        # torch.get_rng_state()
             "python": tuple,            # random.getstate()
             "numpy": tuple},            # numpy.random.get_state(), if numpy imports
     "param_groups": [{...}, ...],       # hyperparameters (lr after a scheduler, ...)
     "param_names": [[name, ...], ...],  # which parameters each group holds
     "state": {unit: {key: value}}}      # non-tensor optimizer state (RMSprop's int step)

so that a restored run continues exactly where the checkpointed one was: the
same random numbers, learning rates and step counters. Tensors of the
optimizer state are not here: they are checkpointed in place by the engine.

Thread-safety: the functions read and set process-global RNG state; call them
from the training thread.
"""

import io
import pickle
import random

import torch

from . import _pmsnap
from .errors import make_error

FORMAT = 1

try:  # numpy is optional; its global RNG is saved when it is there.
    import numpy as _numpy
except ImportError:  # pragma: no cover - numpy ships with Debian's torch
    _numpy = None


def capture_rng():
    """The process's global RNG states (torch CPU, Python, numpy)."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if _numpy is not None:
        rng["numpy"] = _numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def apply_rng(rng):
    """Sets the global RNG states captured by capture_rng (missing ones are left)."""
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "python" in rng:
        random.setstate(rng["python"])
    if "numpy" in rng and _numpy is not None:
        _numpy.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def pack(user, rng, param_groups, nontensor_state, param_names=None, peers=None, shards=None):
    """Pickles one checkpoint's extra state; raises TypeError naming what fails.
    `param_names` (per group, the names of its parameters) lets readers
    without the optimizer (pmsnap.load_state_dict) rebuild the groups.
    `peers` ({rank: that rank's packed extra state}) are the other ranks'
    states this rank keeps (distributed.PeerReplicas). `shards`: this rank's
    layout of each sharded (DTensor) parameter (sharded.layouts)."""
    blob = {
        "format": FORMAT,
        "user": user,
        "rng": rng,
        "param_groups": param_groups,
        "state": nontensor_state,
    }
    if param_names is not None:
        blob["param_names"] = param_names
    if peers:
        blob["peers"] = peers
    if shards:
        blob["shards"] = shards
    out = io.BytesIO()
    try:
        _TensorsAsBytesPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(blob)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise TypeError(f"pmsnap: the extra state cannot be pickled: {e}") from e
    return out.getvalue()


class _TensorsAsBytesPickler(pickle.Pickler):
    """Pickles plain CPU tensors (the RNG states, a data loader's generator
    state) as their bytes, dtype and shape. torch's own pickling of a tensor
    serializes its storage through torch.save, about 0.1 ms per tensor on
    every step (bench/RESULTS.md, "The DLRM example's overhead"). Unpickled
    they are contiguous tensors of their own: two tensors that shared
    storage no longer do. Anything else pickles as usual."""

    def reducer_override(self, obj):
        if (type(obj) is torch.Tensor and obj.device.type == "cpu"
                and obj.layout == torch.strided and not obj.requires_grad
                and not obj.is_quantized and not obj.is_conj() and not obj.is_neg()):
            if obj.dtype == torch.uint8 and obj.is_contiguous():  # an RNG state
                data = obj.numpy().tobytes()
            else:
                data = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return _tensor_from_bytes, (data, str(obj.dtype).removeprefix("torch."),
                                        tuple(obj.shape))
        return NotImplemented


def _tensor_from_bytes(data, dtype_name, shape):
    """The tensor _TensorsAsBytesPickler pickled (a writable copy of `data`)."""
    dtype = getattr(torch, dtype_name)
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def unpack(data):
    """The dict stored by pack(); {} parts for an empty blob (a pool written by C++)."""
    if not data:
        return {"format": FORMAT, "user": {}, "rng": {}, "param_groups": None, "state": {}}
    blob = pickle.loads(data)
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise ValueError("pmsnap: the checkpoint's extra state was not written by this "
                         "version of the pmsnap Python package")
    return blob


def param_group_hyperparameters(optimizer):
    """[{hyperparameter: value}] per param group of `optimizer` (all but "params")."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def param_group_names(optimizer, named):
    """[[parameter name, ...] per param group of `optimizer`]."""
    names = {id(p): name for name, p in named}
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def nontensor_state(optimizer, named):
    """{parameter name: {key: value}} of the non-tensor entries of optimizer.state."""
    out = {}
    for name, p in named:
        state = optimizer.state.get(p)
        if state:
            rest = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
            if rest:
                out[name] = rest
    return out


def apply_to_optimizer(blob, optimizer, named, pool, restore_rng):
    """Sets what `blob` (an unpacked extra state) holds for `optimizer`: the
    param groups' hyperparameters, the non-tensor state of the parameters in
    `named` [(name, parameter)], and with `restore_rng` the RNG states.
    ModelMismatchError naming `pool` when the number of param groups differs."""
    groups = blob.get("param_groups")
    if groups is not None:
        if len(groups) != len(optimizer.param_groups):
            raise make_error(_pmsnap.ModelMismatchError,
                             f"pool {pool} was written with {len(groups)} param groups, "
                             f"the optimizer has {len(optimizer.param_groups)}")
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)
    by_name = dict(named)
    for name, values in blob.get("state", {}).items():
        p = by_name.get(name)
        if p is not None:
            optimizer.state[p].update(values)
    if restore_rng and blob.get("rng"):
        apply_rng(blob["rng"])


def user_view(blob):
    """What restore() returns beside the iteration: the caller's dict, with
    the RNG states under "rng"."""
    out = dict(blob["user"])
    out["rng"] = blob.get("rng", {})
    return out
