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

import array
import ctypes
import io
import pickle
import random
import sys

import torch

from . import _pmsnap
from .errors import make_error

FORMAT = 1

try:  # numpy is optional; its global RNG is saved when it is there.
    import numpy as _numpy
except ImportError:  # pragma: no cover - numpy ships with Debian's torch
    _numpy = None

_WORD = next(code for code in "IL" if array.array(code).itemsize == 4)  # a 32-bit word


class _GlobalRngState:
    """A global Mersenne Twister's get-state call, its last result reused
    while the generator drew nothing. The call builds the 624 key words one
    at a time: 10-80 us a step, more with the caches cold after the
    optimizer's update; comparing the generator's raw key and position (2.5
    KB) costs about 1 us. Reused only while the generator's cached Gaussian
    is the captured one: consuming it changes the state without a draw.

    The raw layout is the C struct behind the generator; it is checked
    against the get-state call once per generator object, and without that
    match every capture makes the call. Subclasses say where the struct is
    and what the call returns."""

    _RAW_BYTES = 624 * 4 + 4

    def __init__(self):
        # (generator, its raw state's address or None, raw state, state),
        # replaced whole so that a capture from another thread reads one.
        self._cache = (None, None, None, None)

    def capture(self):
        generator = self._generator()
        cached_generator, address, cached_raw, cached_state = self._cache
        if generator is not cached_generator:
            address, cached_raw = self._checked_address(generator), None
        if address is None:
            self._cache = (generator, None, None, None)
            return self._read_state()
        # Read before the state: a draw in between (another thread) makes
        # the next capture read afresh, never reuse a newer raw state.
        raw = ctypes.string_at(address, self._RAW_BYTES)
        if raw == cached_raw and self._cached_gaussian_kept(cached_state, generator):
            return cached_state
        state = self._read_state()
        self._cache = (generator, address, raw, state)
        return state

    def forget(self):
        """After a set-state (restore): the next capture reads afresh."""
        self._cache = (None, None, None, None)

    def _checked_address(self, generator):
        address = self._raw_address(generator)
        if address is None:
            return None
        expected = self._raw_of(self._read_state())
        return address if ctypes.string_at(address, self._RAW_BYTES) == expected else None


class _NumpyGlobalState(_GlobalRngState):
    """numpy.random.get_state() of the global RandomState. The raw layout
    (uint32 key[624], int pos) is numpy's MT19937 struct, read through its
    public ctypes address; another bit generator is read every time. The
    cached Gaussian is get_state()'s has_gauss: a capture holding one is
    never reused."""

    def __init__(self):
        super().__init__()
        # numpy.random.get_bit_generator: numpy >= 1.25.
        self._current = getattr(_numpy.random, "get_bit_generator", None)

    def _generator(self):
        return None if self._current is None else self._current()

    def _read_state(self):
        return _numpy.random.get_state()

    def _raw_address(self, generator):
        if type(generator).__name__ != "MT19937":
            return None
        try:
            return generator.ctypes.state_address
        except AttributeError:  # pragma: no cover - numpy without the ctypes interface
            return None

    def _raw_of(self, state):
        return state[1].tobytes() + int(state[2]).to_bytes(4, sys.byteorder, signed=True)

    def _cached_gaussian_kept(self, state, generator):
        return not state[3]


class _PythonGlobalState(_GlobalRngState):
    """random.getstate() of the random module's generator. The raw layout
    (int index, uint32 state[624]) is CPython's _random.Random struct after
    the object header; a subclass of random.Random is read every time (it
    may keep state of its own). The cached Gaussian is gauss_next; setstate
    sets it anew, so a restore needs no forget()."""

    def __init__(self):
        super().__init__()
        self._words = (None, None)  # (a key tuple, its words), replaced whole

    def _generator(self):
        return random.getstate.__self__

    def _read_state(self):
        return random.getstate()

    def _raw_address(self, generator):
        if type(generator) is not random.Random:
            return None
        return id(generator) + object.__basicsize__

    def _raw_of(self, state):
        version, words, _ = state
        if version != 3 or len(words) != 625:
            return None
        return (int(words[624]).to_bytes(4, sys.byteorder, signed=True)
                + array.array(_WORD, words[:624]).tobytes())

    def _cached_gaussian_kept(self, state, generator):
        return generator.gauss_next is state[2]

    def words_of(self, key):
        """The 32-bit words of `key` (a getstate() tuple's second item) as
        bytes; the last result again for the same, reused, tuple (saves 7
        us). OverflowError or TypeError for what is not 32-bit words."""
        last_key, last_words = self._words
        if key is last_key:
            return last_words
        words = array.array(_WORD, key).tobytes()
        self._words = (key, words)
        return words


_numpy_global = _NumpyGlobalState() if _numpy is not None else None
_python_global = _PythonGlobalState()


def capture_rng():
    """The process's global RNG states (torch CPU, Python, numpy)."""
    rng = {"torch": torch.get_rng_state(), "python": _python_global.capture()}
    if _numpy is not None:
        rng["numpy"] = _numpy_global.capture()
    if torch.cuda.is_initialized():  # implies is_available(), which costs 1 us a step
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
        _numpy_global.forget()
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
        "rng": _rng_as_words(rng),
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




class _PickledAs:
    """Pickles as the call `function(*args)`: an unpickled blob holds what
    that call returns, so readers see the usual types."""

    __slots__ = ("_reduced",)

    def __init__(self, function, args):
        self._reduced = (function, args)

    def __reduce__(self):
        return self._reduced


def _rng_as_words(rng):
    """`rng` with the Python and numpy Mersenne Twister states pickled as
    their 32-bit words in one bytes object each: pickling 625 Python ints
    costs 26 us a step, 624 numpy words in an ndarray 12 us, the bytes 3
    us (bench/RESULTS.md, seventh session). Other shapes pickle as they are."""
    python, legacy_numpy = rng.get("python"), rng.get("numpy")
    out = rng
    if type(python) is tuple and len(python) == 3 and type(python[1]) is tuple:
        try:  # array refuses what is not a 32-bit word (the tuple then pickles as it is)
            words = _python_global.words_of(python[1])
        except (OverflowError, TypeError):
            words = None
        if words is not None:
            out = dict(out, python=_PickledAs(_python_rng_state, (python[0], words, python[2])))
    if (_numpy is not None and type(legacy_numpy) is tuple and len(legacy_numpy) == 5
            and type(legacy_numpy[1]) is _numpy.ndarray and legacy_numpy[1].dtype == _numpy.uint32
            and legacy_numpy[1].ndim == 1):
        out = dict(out, numpy=_PickledAs(_numpy_rng_state,
                                         (legacy_numpy[0], legacy_numpy[1].tobytes())
                                         + legacy_numpy[2:]))
    return out


def _python_rng_state(version, words, gauss):
    """random.getstate()'s tuple from _rng_as_words' bytes."""
    return (version, tuple(array.array(_WORD, words)), gauss)


def _numpy_rng_state(name, words, pos, has_gauss, cached_gaussian):
    """numpy.random.get_state()'s tuple from _rng_as_words' bytes."""
    return (name, _numpy.frombuffer(words, dtype=_numpy.uint32).copy(), pos, has_gauss,
            cached_gaussian)


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
