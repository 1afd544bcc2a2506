"""Checkpoints that leave the pool: export() to safetensors, torch.save (.pt)
or torch.distributed.checkpoint (DCP), and read_export() back.

What each file holds (see state_dict.py for the state dict itself):

  .safetensors  the model's weights under their parameter names (a plain
                `model.load_state_dict(safetensors.torch.load_file(f))`
                with model_only), optimizer tensors as
                "optimizer/<param>/<role>"; the rest in the header's
                string metadata: "pmsnap.param_groups" and
                "pmsnap.optimizer_state" (non-tensor state) as JSON, tuples
                tagged so they come back as tuples, "pmsnap.extra" (the
                step()'s dict, JSON, when it is JSON-serializable), and
                pool, epoch, iteration.
  .pt           {"model", "optimizer", "extra", "pmsnap"} as
                load_state_dict() returns it (model_only: {name: tensor}),
                loadable with torch.load(f, weights_only=True): the RNG
                states' numpy arrays are stored as lists.
  DCP folder    dcp.save() of {"model", "optimizer", "extra"}: load it with
                dcp.load({"model": model.state_dict(), "optimizer":
                get_optimizer_state_dict(model, opt)}, checkpoint_id=dir).

Streaming: tensors are read from the pool one at a time (checksums checked)
and written out before the next is read, through one reused buffer for
.safetensors and .pt (the pool's pages are dropped from the process after
each read, see _pmsnap.CheckpointReader), as views of the pool file whose
pages are dropped once written for DCP; so memory holds about the largest
tensor, not the model (test_interop measures 256 MiB and 1 GiB models);
embedding tables are rebuilt whole, one at a time.
The output appears at its path only once complete (written under
"<path>.partial-<pid>", then renamed); a failure leaves no partial output
and never writes the pool. A newest epoch whose data is damaged falls back
to the older retained epoch when no epoch was asked for (the result's
"warnings" say so).

Thread-safety: one thread per call; the pool must not be open for training.
"""

import collections
import io
import json
import os
import pickle
import shutil
import struct
import sys
import time
import warnings

import torch

from . import _pmsnap
from .errors import make_error
from .state_dict import OPTIMIZER_PREFIX, load_state_dict, run_with_fallback
from .units import torch_dtype

FORMATS = ("safetensors", "pt", "dcp")

_SAFETENSORS_DTYPES = {
    "float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}
_STORAGE_TYPES = {
    torch.float32: "FloatStorage", torch.float64: "DoubleStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
}


def format_of(to, format=None):
    """The export format for output `to`: `format` if given, else from the
    suffix (.safetensors, .pt / .pth, a folder: dcp). InvalidArgumentError
    naming the output otherwise."""
    if format is not None:
        if format not in FORMATS:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"unknown export format '{format}' for {to} (safetensors, pt or "
                             "dcp)")
        return format
    text = os.fspath(to)
    if text.endswith(".safetensors"):
        return "safetensors"
    if text.endswith((".pt", ".pth")):
        return "pt"
    if text.endswith(os.sep) or os.path.isdir(text):
        return "dcp"
    raise make_error(_pmsnap.InvalidArgumentError,
                     f"cannot tell the export format of {text}: name it .safetensors, .pt or a "
                     "folder with format 'dcp'")


class Progress:
    """Reports bytes written to `stream` about every `interval` seconds and at the end."""

    def __init__(self, total, label, stream=None, interval=1.0):
        self.total = max(1, total)
        self.done = 0
        self.label = label
        self.stream = stream
        self.interval = interval
        self._last = time.monotonic()
        self._start = self._last

    def add(self, nbytes):
        self.done += nbytes
        now = time.monotonic()
        if self.stream is not None and (now - self._last >= self.interval
                                        or self.done >= self.total):
            self._last = now
            rate = self.done / max(now - self._start, 1e-9) / 2**20
            self.stream.write(f"pmsnap: {self.label}: {self.done / 2**20:.1f} of "
                              f"{self.total / 2**20:.1f} MiB ({100 * self.done // self.total}%, "
                              f"{rate:.0f} MiB/s)\n")
            self.stream.flush()


def export(pool, to, format=None, epoch=None, model_only=False, progress=None):
    """Writes retained epoch `epoch` (default: newest) of `pool` to `to`.

    format: "safetensors", "pt" or "dcp" (default: from `to`'s name).
    model_only: only the model's weights. progress: a stream (sys.stderr)
    for progress lines, or None. Returns {"path", "format", "pool", "epoch",
    "iteration", "tensors", "bytes", "warnings"}.

    Errors (pmsnap.Error, naming the pool, the epoch or the output):
    InvalidArgumentError for an unknown format or an output that exists as
    a non-empty folder (dcp), NotFoundError for a missing pool or an epoch
    not retained, FailedPreconditionError for an output that cannot be
    written, CorruptionError for damaged data. The pool is never written.
    """
    to = os.fspath(to)
    fmt = format_of(to, format)
    target = to.rstrip(os.sep) or to
    if fmt == "dcp":
        if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"export to {to}: the DCP folder exists and is not empty")
    elif os.path.isdir(target):
        raise make_error(_pmsnap.InvalidArgumentError, f"export to {to}: it is a folder")
    partial = f"{target}.partial-{os.getpid()}"
    _check_writable(partial, to, fmt)

    def run(checkpoint):
        entries = [e for e in checkpoint.entries if e.is_model or not model_only]
        total = sum(e.nbytes for e in entries)
        meter = Progress(total, f"export {checkpoint.pool} epoch {checkpoint.epoch} -> {to}",
                         progress)
        try:
            if fmt == "safetensors":
                _write_safetensors(checkpoint, entries, partial, model_only, meter)
            elif fmt == "pt":
                _write_pt(checkpoint, entries, partial, model_only, meter)
            else:
                _write_dcp(checkpoint, entries, partial, model_only, meter)
        except BaseException:
            _remove(partial)
            raise
        if fmt == "dcp" and os.path.isdir(target):
            os.rmdir(target)  # empty, checked above
        os.replace(partial, target)
        return {"path": to, "format": fmt, "pool": checkpoint.pool, "epoch": checkpoint.epoch,
                "iteration": checkpoint.iteration, "tensors": len(entries), "bytes": total,
                "warnings": list(checkpoint.warnings)}

    return run_with_fallback(pool, epoch, run)


def _check_writable(partial, to, fmt):
    """FailedPreconditionError naming `to` unless its folder takes a new file."""
    try:
        if fmt == "dcp":
            os.mkdir(partial)
            os.rmdir(partial)
        else:
            with open(partial, "wb"):
                pass
            os.remove(partial)
    except OSError as e:
        raise make_error(_pmsnap.FailedPreconditionError,
                         f"export to {to}: cannot write there ({e.strerror or e})") from e


def _remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


# --- JSON with tuples (param groups' betas) -----------------------------------------

def _to_json(value):
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def _from_json(value):
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_from_json(v) for v in value["__tuple__"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


# --- safetensors -----------------------------------------------------------------------

def _write_safetensors(checkpoint, entries, path, model_only, meter):
    header = {}
    offset = 0
    for e in entries:
        header[e.key] = {"dtype": _SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    metadata = {"format": "pt", "pmsnap.pool": checkpoint.pool,
                "pmsnap.epoch": str(checkpoint.epoch),
                "pmsnap.iteration": str(checkpoint.iteration)}
    if not model_only:
        metadata["pmsnap.param_groups"] = json.dumps(_to_json(checkpoint.param_groups()))
        metadata["pmsnap.optimizer_state"] = json.dumps(_to_json(checkpoint.nontensor_state()))
        try:
            metadata["pmsnap.extra"] = json.dumps(_to_json(checkpoint.blob()["user"]))
        except TypeError as e:
            checkpoint.warnings.append(f"the step()'s extra state is not stored in "
                                       f"safetensors metadata: {e}")
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    buffer = torch.empty(max([e.nbytes for e in entries] + [1]), dtype=torch.uint8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in entries:
            _write_entry(f, checkpoint, e, buffer)
            meter.add(e.nbytes)


def _write_entry(f, checkpoint, entry, buffer):
    if entry.nbytes == 0:
        return
    if entry.table is not None:
        data = checkpoint.read(entry).contiguous().view(torch.uint8).reshape(-1)
    else:
        data = checkpoint.read(entry, out=buffer[:entry.nbytes])
    f.write(memoryview(data.numpy()).cast("B")[:entry.nbytes])


# --- torch.save format, streamed -------------------------------------------------------

class _LazyStorage:
    """A tensor's storage in the .pt file; its bytes are read when written."""

    __slots__ = ("key", "dtype", "numel", "entry", "tensor")

    def __init__(self, key, dtype, numel, entry=None, tensor=None):
        self.key = key
        self.dtype = dtype
        self.numel = numel
        self.entry = entry
        self.tensor = tensor


class _LazyTensor:
    __slots__ = ("storage", "shape")

    def __init__(self, storage, shape):
        self.storage = storage
        self.shape = tuple(shape)


def _contiguous_stride(shape):
    stride = []
    step = 1
    for d in reversed(shape):
        stride.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(stride))


class _Pickler(pickle.Pickler):
    """Pickles as torch.save does (tensors as _rebuild_tensor_v2 of persistent
    storages) without holding the tensors' bytes."""

    def __init__(self, file, storages):
        super().__init__(file, protocol=2)
        self._storages = storages

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            storage = _LazyStorage(str(len(self._storages)), t.dtype, t.numel(), tensor=t)
            self._storages.append(storage)
            obj = _LazyTensor(storage, t.shape)
        if isinstance(obj, _LazyTensor):
            return (torch._utils._rebuild_tensor_v2,
                    (obj.storage, 0, obj.shape, _contiguous_stride(obj.shape), False,
                     collections.OrderedDict()))
        return NotImplemented

    def persistent_id(self, obj):
        if isinstance(obj, _LazyStorage):
            return ("storage", getattr(torch, _STORAGE_TYPES[obj.dtype]), obj.key, "cpu",
                    obj.numel)
        return None


def _weights_only_safe(value):
    """`value` with numpy arrays and scalars as lists and Python numbers, which
    torch.load(weights_only=True) accepts."""
    if isinstance(value, dict):
        return {k: _weights_only_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [_weights_only_safe(v) for v in value]
        return tuple(out) if isinstance(value, tuple) else out
    if type(value).__module__ == "numpy":
        return value.tolist()
    return value


def _write_pt(checkpoint, entries, path, model_only, meter):
    storages = []
    lazy = {}
    for e in entries:
        storage = _LazyStorage(str(len(storages)), torch_dtype(e.dtype),
                               int(torch.Size(e.shape).numel()), entry=e)
        storages.append(storage)
        lazy[id(e)] = _LazyTensor(storage, e.shape)
    model = {e.param: lazy[id(e)] for e in entries if e.is_model}
    if model_only:
        obj = model
    else:
        state = {}
        for e in entries:
            if not e.is_model:
                state.setdefault(e.param, {})[e.role] = lazy[id(e)]
        for name, values in checkpoint.nontensor_state().items():
            state.setdefault(name, {}).update(values)
        obj = {"model": model,
               "optimizer": {"state": state, "param_groups": checkpoint.param_groups()},
               "extra": _weights_only_safe(checkpoint.extra()),
               "pmsnap": checkpoint.info()}
    data = io.BytesIO()
    _Pickler(data, storages).dump(obj)
    buffer = torch.empty(max([e.nbytes for e in entries] + [1]), dtype=torch.uint8)
    with torch.serialization._open_zipfile_writer(path) as zf:
        pkl = data.getvalue()
        zf.write_record("data.pkl", pkl, len(pkl))
        zf.write_record(".format_version", "1", len("1"))
        alignment = str(torch.serialization._get_storage_alignment())
        zf.write_record(".storage_alignment", alignment, len(alignment))
        zf.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for s in storages:
            name = f"data/{s.key}"
            if s.entry is None:
                nbytes = s.tensor.numel() * s.tensor.element_size()
                zf.write_record(name, s.tensor.untyped_storage(), nbytes)
                continue
            e = s.entry
            if e.table is not None:
                t = checkpoint.read(e).contiguous()
                zf.write_record(name, t.untyped_storage(), e.nbytes)
            else:
                if e.nbytes:
                    checkpoint.read(e, out=buffer[:e.nbytes])
                # The buffer's storage starts with the tensor's bytes.
                zf.write_record(name, buffer.untyped_storage(), e.nbytes)
            meter.add(e.nbytes)


# --- DCP ---------------------------------------------------------------------------------

def _write_dcp(checkpoint, entries, path, model_only, meter):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    by_fqn = {}
    model = {}
    state = {}
    for e in entries:
        placeholder = torch.empty(e.shape, dtype=torch_dtype(e.dtype), device="meta")
        if e.is_model:
            model[e.param] = placeholder
            by_fqn[f"model.{e.param}"] = e
        else:
            state.setdefault(e.param, {})[e.role] = placeholder
            by_fqn[f"optimizer.state.{e.param}.{e.role}"] = e
    sd = {"model": model}
    if not model_only:
        for name, values in checkpoint.nontensor_state().items():
            state.setdefault(name, {}).update(values)
        sd["optimizer"] = {"state": state, "param_groups": checkpoint.param_groups()}
        sd["extra"] = {"pmsnap_extra_state": checkpoint.blob()}
        sd["pmsnap"] = {"pool": checkpoint.pool, "epoch": checkpoint.epoch,
                        "iteration": checkpoint.iteration}

    written = []

    class PoolSavePlanner(DefaultSavePlanner):
        """Hands DCP each tensor when it writes it: a checksum-checked view of
        the pool file. DCP's FileSystemWriter keeps every tensor of a file
        until the file is done, so the pages of the ones it has written are
        dropped (release_view) as it asks for the next: memory stays at
        about one tensor instead of the model."""

        def resolve_data(self, write_item):
            entry = by_fqn.get(write_item.index.fqn)
            if entry is None:
                return super().resolve_data(write_item)
            while written:
                checkpoint.release_view(written.pop())
            tensor = checkpoint.view(entry)
            written.append(entry)
            meter.add(entry.nbytes)
            return tensor

    os.mkdir(path)
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True, thread_count=1,
                                  sync_files=True)
    with warnings.catch_warnings():
        # "assuming the intent is to save in a single process": it is.
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(sd, storage_writer=writer, planner=PoolSavePlanner())


# --- reading an export back --------------------------------------------------------------

def read_export(path):
    """An exported checkpoint (.safetensors, .pt or DCP folder), a pool, or a
    "{rank}" template of a multi-rank run's pools (consolidated), as {"model",
    "optimizer" (None if model-only), "extra" (the step()'s dict, without
    RNG states), "iteration" (None if unknown)}: what
    CheckpointedOptimizer(init_from=...) seeds a pool with. Also takes
    checkpoints pmsnap did not write: a .pt / .safetensors state dict of
    tensors (model only), a .pt or DCP folder with "model" and "optimizer"
    (or "optim") entries keyed by parameter name. NotFoundError for a missing
    path, InvalidArgumentError naming the file for anything else."""
    path = os.fspath(path)
    if "{rank}" in path or _is_pool_file(path):
        # A pool, or every rank's pool of a multi-rank run, whatever its world
        # size: how a run moves to another world size.
        return _split(load_state_dict(path))
    if not os.path.exists(path):
        raise make_error(_pmsnap.NotFoundError, f"checkpoint {path} does not exist")
    try:
        if os.path.isdir(path):
            result = _read_dcp(path)
        elif path.endswith(".safetensors"):
            result = _read_safetensors(path)
        else:
            result = _read_pt(path)
        if not result["model"] or not all(isinstance(v, torch.Tensor)
                                          for v in result["model"].values()):
            raise TypeError("holds no model tensors")
        return result
    except _pmsnap.Error:
        raise
    except Exception as e:  # noqa: BLE001 - the readers' many error types
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"{path} is not a checkpoint pmsnap can import ({type(e).__name__}: "
                         f"{e})") from e


def _is_pool_file(path):
    try:
        with open(path, "rb") as f:
            return f.read(8) == b"PMEMOBJ\0"
    except OSError:
        return False


def _read_safetensors(path):
    from safetensors import safe_open

    model, state = {}, {}
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        for key in f.keys():
            if key.startswith(OPTIMIZER_PREFIX):
                param, role = key[len(OPTIMIZER_PREFIX):].rsplit("/", 1)
                state.setdefault(param, {})[role] = f.get_tensor(key)
            else:
                model[key] = f.get_tensor(key)
    optimizer = None
    if "pmsnap.param_groups" in metadata:
        for name, values in _from_json(json.loads(metadata["pmsnap.optimizer_state"])).items():
            state.setdefault(name, {}).update(values)
        optimizer = {"state": state,
                     "param_groups": _from_json(json.loads(metadata["pmsnap.param_groups"]))}
    extra = _from_json(json.loads(metadata["pmsnap.extra"])) if "pmsnap.extra" in metadata \
        else {}
    iteration = int(metadata["pmsnap.iteration"]) if "pmsnap.iteration" in metadata else None
    return {"model": model, "optimizer": optimizer, "extra": extra, "iteration": iteration}


def _split(obj):
    """{"model", "optimizer", "extra", "iteration"} of a loaded nested state dict."""
    if not isinstance(obj, dict):
        raise TypeError(f"holds a {type(obj).__name__}, not a dict")
    if isinstance(obj.get("model"), dict):
        optimizer = obj.get("optimizer", obj.get("optim"))
        extra = obj.get("extra") or {}
        if "pmsnap_extra_state" in extra:  # a DCP export: the whole pmsnap blob
            extra = extra["pmsnap_extra_state"].get("user", {})
        extra = {k: v for k, v in extra.items() if k != "rng"}
        iteration = (obj.get("pmsnap") or {}).get("iteration")
        return {"model": obj["model"], "optimizer": optimizer, "extra": extra,
                "iteration": iteration}
    if not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise TypeError("is neither a pmsnap export nor a state dict of tensors")
    return {"model": obj, "optimizer": None, "extra": {}, "iteration": None}


def _read_pt(path):
    return _split(torch.load(path, map_location="cpu", weights_only=True))


def _read_dcp(path):
    # What torch.distributed.checkpoint.format_utils.dcp_to_torch_save does:
    # every entry of the checkpoint, nested again, without a target state dict.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        _load_state_dict(sd, storage_reader=FileSystemReader(path),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return _split(sd)
