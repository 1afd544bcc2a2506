"""Reading a pool's checkpoints without the model: load_state_dict() and
PoolCheckpoint, what the exporters and the `pmsnap` command line read from.

A retained epoch is one whose slot is COMPLETE with a commit record that
verifies: the pool keeps two slots, so at most the last two committed epochs
(docs/ARCHITECTURE.md, "The pool file"). Its contents, keyed as
torch.distributed.checkpoint.state_dict's get_state_dict() keys them (by
parameter name, not by optimizer index):

    {"model": {name: tensor},
     "optimizer": {"state": {name: {role: value}},
                   "param_groups": [{hyperparameter: value, "params": [names]}]},
     "extra": {... the dict given to step(), "rng": {...}},
     "pmsnap": {"pool", "epoch", "iteration", "commit_time_unix_ns", "tables",
                "warnings"}}

A parameter's unit becomes model[name] (its "param" tensor) and
optimizer["state"][name] (every other tensor, plus the non-tensor state kept
in the extra state); the module's persistent buffers (the "#buffers" unit)
become model[key] too, as in the model's state_dict. An embedding table is rebuilt from its retained chunk
checkpoint (dequantized to float32 when quantized); a parameter's companion
units ("#dense", "#host": _pmsnap.companion_units) add their tensors to its
state. A multi-rank pool ("{rank}" in the path, pmsnap.distributed) is read as
the union of every rank's units at the newest epoch all ranks retain.

Tensors are read one at a time, each checksum-checked as it is read; only the
tensors asked for are read. Errors are pmsnap.Error subclasses naming the
pool and the epoch.

Thread-safety: a PoolCheckpoint belongs to one thread; the pool must not be
open in a training process at the same time (NotAPool/Busy errors say so).
"""

import glob
import mmap as _mmap
import os
import warnings as _warnings

import numpy
import torch

from . import _pmsnap
from . import extra_state as _extra
from .errors import make_error
from .units import BUFFER_ROLE, PARAM_ROLE, torch_dtype

# The prefix export files give optimizer tensors ("optimizer/<param>/<role>").
OPTIMIZER_PREFIX = "optimizer/"


class TensorEntry:
    """One tensor of a checkpoint: where it goes in the state dict and where it
    comes from (a slot tensor of one rank's pool, or a tensor of an embedding
    table rebuilt from its chunks)."""

    __slots__ = ("param", "role", "dtype", "shape", "nbytes", "reader", "unit", "tensor",
                 "table")

    def __init__(self, param, role, dtype, shape, nbytes, reader, unit=None, tensor=None,
                 table=None):
        self.param = param
        self.role = role
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)
        self.nbytes = int(nbytes)
        self.reader = reader
        self.unit = unit
        self.tensor = tensor
        self.table = table

    @property
    def is_model(self):
        """A tensor of the model's state_dict: a parameter or a buffer."""
        return self.role in (PARAM_ROLE, BUFFER_ROLE)

    @property
    def is_buffer(self):
        return self.role == BUFFER_ROLE

    @property
    def key(self):
        """The flat key export files use: the parameter name for its weight,
        "optimizer/<param>/<role>" for optimizer state."""
        if self.is_model:
            return self.param
        return f"{OPTIMIZER_PREFIX}{self.param}/{self.role}"


def rank_pool_paths(pool):
    """[path] for a single pool; every rank's path for a "{rank}" template,
    in rank order (world size from rank 0's header). NotFoundError naming the
    path when a pool is missing."""
    pool = os.fspath(pool)
    if "{rank}" not in pool:
        if not os.path.exists(pool):
            raise make_error(_pmsnap.NotFoundError, f"pool {pool} does not exist")
        return [pool]
    first = pool.replace("{rank}", "0")
    if not os.path.exists(first):
        found = sorted(glob.glob(glob.escape(pool).replace(glob.escape("{rank}"), "*")))
        raise make_error(_pmsnap.NotFoundError,
                         f"pool {pool}: rank 0's pool {first} does not exist"
                         + (f" (found {', '.join(found)})" if found else ""))
    reader = _pmsnap.CheckpointReader(first)
    try:
        world = reader.describe()["group"]["world_size"]
    finally:
        reader.close()
    paths = [pool.replace("{rank}", str(r)) for r in range(max(1, world))]
    for p in paths:
        if not os.path.exists(p):
            raise make_error(_pmsnap.NotFoundError,
                             f"pool {pool}: {p} of a {world}-rank run does not exist")
    return paths


class PoolCheckpoint:
    """One retained epoch of a pool (or of every rank's pool), read tensor by tensor.

    `epoch` None: the newest epoch retained (by every rank). A newest slot
    whose commit record is damaged is not retained; the older one is used and
    `warnings` says so (as do the epochs the data of which turns out damaged
    when read, see load_state_dict). NotFoundError naming the pool and the
    epoch for an epoch that is not retained.
    """

    def __init__(self, pool, epoch=None):
        self.pool = os.fspath(pool)
        self.warnings = []
        paths = rank_pool_paths(self.pool)
        self._readers = []
        self._mmaps = {}
        try:
            for p in paths:
                self._readers.append(_pmsnap.CheckpointReader(p))
            self._init(paths, epoch, [r.describe() for r in self._readers])
            for info in self._infos:
                self.warnings.extend(info["warnings"])
                for slot in info["slots"]:
                    if slot["state"] == "COMPLETE" and not slot["record_valid"]:
                        self.warnings.append(
                            f"pool {info['path']}: epoch {slot['epoch']} in slot "
                            f"{slot['slot']} has a damaged commit record and is not retained")
        except BaseException:
            self.close()
            raise

    def at(self, epoch):
        """The same pool's retained epoch `epoch`, sharing this one's open files
        (closing either closes both). NotFoundError as the constructor."""
        other = object.__new__(PoolCheckpoint)
        other.pool = self.pool
        other.warnings = list(self.warnings)
        other._readers = self._readers
        other._mmaps = self._mmaps
        other._init(self._paths, epoch, self._infos)
        return other

    def verify(self):
        """{epoch: [problems]} for every retained epoch, each rank's pool
        checked in full (every checksum, pmsnap verify's check); a damaged
        chunk counts against every epoch. BusyError if a process opened a
        pool while it was read."""
        out = {e: [] for e in self.retained}
        iteration_of = {e["epoch"]: e["iteration"] for e in self._readers[0].epochs()}
        for reader, info in zip(self._readers, self._infos):
            found = reader.verify()
            chunks = [f"pool {info['path']}: chunk problem: {p}" for p in found.pop(-1, [])]
            iterations = {e["epoch"]: e["iteration"] for e in reader.epochs()}
            for number, problems in found.items():
                for epoch in out:
                    if iteration_of[epoch] == iterations.get(number):
                        out[epoch] += [f"pool {info['path']}: {p}" for p in problems]
            for epoch in out:
                out[epoch] += chunks
        return out

    def close(self):
        """Releases the pool files now; views from view() stay valid."""
        for reader in self._readers:
            reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _init(self, paths, epoch, infos):
        self._paths = paths
        self._infos = infos
        per_rank = [{e["epoch"]: e for e in r.epochs()} for r in self._readers]
        # Ranks' pools hold the same iterations, but a pool that replaced a
        # lost one numbers its epochs from 1: match the ranks by iteration,
        # name epochs by rank 0's numbers.
        epoch_of_iteration = [{e["iteration"]: number for number, e in epochs.items()}
                              for epochs in per_rank]
        common_iterations = set(epoch_of_iteration[0])
        for iterations in epoch_of_iteration[1:]:
            common_iterations &= set(iterations)
        common = {epoch_of_iteration[0][i] for i in common_iterations}
        self.retained = sorted(common, reverse=True)
        if epoch is None:
            if not self.retained:
                raise make_error(_pmsnap.NotFoundError,
                                 f"pool {self.pool} holds no committed checkpoint"
                                 + (" that every rank retains" if len(paths) > 1 else ""))
            epoch = self.retained[0]
        elif int(epoch) not in common:
            listed = ", ".join(f"{e} (iteration {per_rank[0][e]['iteration']})"
                               for e in self.retained) or "none"
            raise make_error(_pmsnap.NotFoundError,
                             f"pool {self.pool}: epoch {epoch} is not retained (retained "
                             f"epochs: {listed})")
        self.epoch = int(epoch)
        first = per_rank[0][self.epoch]
        self.iteration = int(first["iteration"])
        self._reader_epochs = {id(reader): epoch_of_iteration[k][self.iteration]
                               for k, reader in enumerate(self._readers)}
        self.commit_time_unix_ns = int(first["commit_time_unix_ns"])
        self._blob = None
        self.entries = self._make_entries()

    # --- what the checkpoint holds ------------------------------------------------

    def _make_entries(self):
        """TensorEntries in optimizer order: each parameter's weight, then its state."""
        entries = []
        seen = set()
        for reader, info in zip(self._readers, self._infos):
            units = info["units"]
            by_name = {name: (u, encoded, tensors) for u, (name, encoded, tensors)
                       in enumerate(units)}
            for u, (name, encoded, tensors) in enumerate(units):
                if _pmsnap.is_buffers_unit(name):
                    if name not in seen:  # module buffers, keyed as in state_dict
                        seen.add(name)
                        for t, (key, dtype, shape, nbytes) in enumerate(tensors):
                            entries.append(TensorEntry(key, BUFFER_ROLE, dtype, shape, nbytes,
                                                       reader, unit=u, tensor=t))
                    continue
                if _pmsnap.parameter_of_companion(name) is not None or name in seen:
                    continue  # a companion goes with its parameter; replicas once
                seen.add(name)
                if encoded:
                    for role, dtype, shape, nbytes in tensors:
                        entries.append(TensorEntry(name, role, dtype, shape, nbytes, reader,
                                                   table=name))
                else:
                    for t, (role, dtype, shape, nbytes) in enumerate(tensors):
                        entries.append(TensorEntry(name, role, dtype, shape, nbytes, reader,
                                                   unit=u, tensor=t))
                for companion in _pmsnap.companion_units(name):
                    if companion not in by_name:
                        continue
                    cu, _, ctensors = by_name[companion]
                    for t, (role, dtype, shape, nbytes) in enumerate(ctensors):
                        entries.append(TensorEntry(name, role, dtype, shape, nbytes, reader,
                                                   unit=cu, tensor=t))
        return entries

    def _epoch_in(self, reader):
        """This checkpoint's epoch number in `reader`'s pool."""
        return self._reader_epochs[id(reader)]

    @property
    def param_names(self):
        """Parameter names in the optimizer's order."""
        out = []
        for e in self.entries:
            if not e.is_buffer and (not out or out[-1] != e.param):
                out.append(e.param)
        return out

    @property
    def buffer_names(self):
        """The module buffers' state_dict keys."""
        return [e.param for e in self.entries if e.is_buffer]

    def blob(self):
        """The extra state pmsnap stored with the epoch (extra_state.unpack)."""
        if self._blob is None:
            data = self._readers[0].extra_state(self.epoch)
            try:
                self._blob = _extra.unpack(data)
            except Exception as e:  # noqa: BLE001 - any unpickling failure
                raise make_error(_pmsnap.CorruptionError,
                                 f"pool {self.pool} epoch {self.epoch}: its extra state cannot "
                                 f"be read ({e})") from e
        return self._blob

    def param_groups(self):
        """[{hyperparameters..., "params": [names]}] as get_optimizer_state_dict() has them."""
        blob = self.blob()
        groups = blob.get("param_groups")
        names = self.param_names
        if groups is None:  # a pool written by the C++ front end: no hyperparameters
            return [{"params": names}]
        members = blob.get("param_names")
        if members is None:
            if len(groups) != 1:
                raise make_error(_pmsnap.FailedPreconditionError,
                                 f"pool {self.pool} epoch {self.epoch}: {len(groups)} param "
                                 "groups, but the pool was written before pmsnap recorded which "
                                 "parameters each group holds")
            members = [names]
        return [dict(g, params=list(m)) for g, m in zip(groups, members)]

    def nontensor_state(self):
        """{param: {key: value}}: optimizer state that is not a tensor."""
        return dict(self.blob().get("state") or {})

    def extra(self):
        """The dict given to step() at this epoch, with "rng" (as restore() returns)."""
        blob = self.blob()
        out = dict(blob["user"])
        out["rng"] = blob.get("rng", {})
        return out

    def info(self):
        return {"pool": self.pool, "epoch": self.epoch, "iteration": self.iteration,
                "commit_time_unix_ns": self.commit_time_unix_ns,
                "tables": sorted({e.table for e in self.entries if e.table is not None}),
                "warnings": list(self.warnings)}

    # --- reading tensors ------------------------------------------------------------

    def read(self, entry, out=None):
        """Entry's tensor, checksum-checked: into `out` (a contiguous CPU tensor
        of its dtype and shape, or uint8 buffer of at least nbytes) if given."""
        if entry.table is not None:
            return self._read_table_tensor(entry)
        if out is None:
            out = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
        if entry.nbytes:
            entry.reader.read_tensor(self._epoch_in(entry.reader), entry.unit, entry.tensor, out.data_ptr())
        return out

    def view(self, entry):
        """A zero-copy view of entry's bytes in the pool file, checksum-checked
        first: a private copy-on-write mapping (as torch.load(mmap=True)),
        so writes to it never reach the pool. Embedding tables are rebuilt
        from their chunks (a copy)."""
        if entry.table is not None:
            return self._read_table_tensor(entry)
        dtype = torch_dtype(entry.dtype)
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        entry.reader.verify_tensor(self._epoch_in(entry.reader), entry.unit, entry.tensor)
        offset = entry.reader.tensor_file_offset(self._epoch_in(entry.reader), entry.unit, entry.tensor)
        mapping = self._mapping(entry.reader)
        array = numpy.frombuffer(mapping, dtype=numpy.uint8, count=entry.nbytes, offset=offset)
        with _warnings.catch_warnings():
            _warnings.simplefilter("ignore")  # numpy views of an mmap: torch warns on purpose
            flat = torch.from_numpy(array)
        return flat.view(dtype).reshape(entry.shape)

    def release_view(self, entry):
        """Drops the pages of entry's view() from this process (they stay in the
        file; reading the view again faults them back in). Keeps the resident
        set of a long pass over views (a DCP export) at about one tensor.
        Pages written through the view (copy-on-write) are discarded too."""
        if entry.table is not None or entry.nbytes == 0:
            return
        offset = entry.reader.tensor_file_offset(self._epoch_in(entry.reader), entry.unit, entry.tensor)
        start = -(-offset // _mmap.PAGESIZE) * _mmap.PAGESIZE
        end = (offset + entry.nbytes) // _mmap.PAGESIZE * _mmap.PAGESIZE
        if end > start:
            self._mapping(entry.reader).madvise(_mmap.MADV_DONTNEED, start, end - start)

    def _mapping(self, reader):
        path = self._paths[self._readers.index(reader)]
        mapping = self._mmaps.get(path)
        if mapping is None:
            with open(path, "rb") as f:
                mapping = _mmap.mmap(f.fileno(), 0, flags=_mmap.MAP_PRIVATE,
                                     prot=_mmap.PROT_READ | _mmap.PROT_WRITE)
            self._mmaps[path] = mapping
        return mapping

    def _read_table_tensor(self, entry):
        info, arrays = entry.reader.recover_table(entry.table, self._epoch_in(entry.reader))
        roles = [e.role for e in self.entries if e.table == entry.table]
        array = arrays[roles.index(entry.role)]
        return torch.from_numpy(array).reshape(entry.shape)


_FUSED_LAYOUTS = {
    "fused8": lambda t: torch.ops.quantized.embedding_bag_byte_prepack(t),
    "fused4": lambda t: torch.ops.quantized.embedding_bag_4bit_prepack(t),
}


def load_state_dict(pool, epoch=None, mmap=False, names=None, model_only=False,
                    embedding_layout="float32"):
    """A pool's checkpoint as a state dict, without a model, optimizer or process group.

    Returns {"model": {name: tensor}, "optimizer": {"state": {name: {role:
    value}}, "param_groups": [...]}, "extra": {...}, "pmsnap": {pool, epoch,
    iteration, commit_time_unix_ns, warnings}} for `epoch` (default: the
    newest retained; a damaged newest slot falls back to the older one, and
    pmsnap.warnings says so). The optimizer part has parameter names as keys,
    as torch.distributed.checkpoint.state_dict.get_optimizer_state_dict()
    does: set_optimizer_state_dict(model, optimizer, sd["optimizer"]) loads
    it into a live optimizer.

    mmap=True: tensors are zero-copy views of the pool file, checksum-checked
    and mapped copy-on-write, so writes to them never reach the pool; they
    see the epoch's bytes as long as no training reuses the slot. Embedding
    tables are always rebuilt into new float32 tensors (dequantized when
    checkpointed quantized).

    names: parameter names to read (default: all); only their tensors are
    read. model_only: skip optimizer state (and its tensors).

    embedding_layout: "float32" (embedding tables as float32 [rows, dim],
    dequantized when checkpointed quantized), or PyTorch's fused rowwise
    layouts that torch.ops.quantized.embedding_bag_byte_rowwise_offsets /
    embedding_bag_4bit_rowwise_offsets take: "fused8" (uint8 [rows, dim + 8]:
    codes, then fp32 scale and bias per row) or "fused4" (4-bit codes, fp16
    scale and bias), quantized by torch's prepack ops from the float32 table.

    Errors name the pool and the epoch: NotFoundError (no pool, epoch not
    retained, unknown name), CorruptionError (a checksum fails for an
    explicitly requested epoch, or for both retained ones).
    """
    if embedding_layout != "float32" and embedding_layout not in _FUSED_LAYOUTS:
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"pool {os.fspath(pool)}: unknown embedding_layout "
                         f"'{embedding_layout}' (float32, fused8 or fused4)")
    result = run_with_fallback(pool, epoch, lambda c: _load(c, mmap, names, model_only))
    if embedding_layout != "float32":
        for table in result["pmsnap"]["tables"]:
            if table in result["model"]:
                result["model"][table] = _FUSED_LAYOUTS[embedding_layout](
                    result["model"][table])
    return result


def _load(checkpoint, mmap, names, model_only):
    wanted = None
    if names is not None:
        wanted = [names] if isinstance(names, str) else list(names)
        known = set(checkpoint.param_names) | set(checkpoint.buffer_names)
        for name in wanted:
            if name not in known:
                raise make_error(_pmsnap.NotFoundError,
                                 f"pool {checkpoint.pool} epoch {checkpoint.epoch}: no parameter "
                                 f"'{name}' (it holds {len(known)}, e.g. "
                                 f"{', '.join(sorted(known)[:3])})")
        wanted = set(wanted)
    model = {}
    state = {}
    for entry in checkpoint.entries:
        if wanted is not None and entry.param not in wanted:
            continue
        if model_only and not entry.is_model:
            continue
        tensor = checkpoint.view(entry) if mmap else checkpoint.read(entry)
        if entry.is_model:
            model[entry.param] = tensor
        else:
            state.setdefault(entry.param, {})[entry.role] = tensor
    result = {"model": model}
    if not model_only:
        for name, values in checkpoint.nontensor_state().items():
            if wanted is None or name in wanted:
                state.setdefault(name, {}).update(values)
        result["optimizer"] = {"state": state, "param_groups": checkpoint.param_groups()}
    result["extra"] = checkpoint.extra()
    result["pmsnap"] = checkpoint.info()
    return result


def run_with_fallback(pool, epoch, run):
    """run(PoolCheckpoint of `epoch`) and its result. With epoch None and the
    newest epoch's data found damaged while `run` reads it, runs it again on
    the older retained epoch, whose checkpoint's warnings say so (run must
    leave nothing behind when it raises)."""
    with PoolCheckpoint(pool, epoch) as checkpoint:
        try:
            return run(checkpoint)
        except _pmsnap.CorruptionError as damage:
            older = [e for e in checkpoint.retained if e < checkpoint.epoch]
            if epoch is not None or not older:
                raise
            fallback = checkpoint.at(older[0])
            fallback.warnings.append(
                f"pool {checkpoint.pool}: newest epoch {checkpoint.epoch} is damaged ({damage}); "
                f"using epoch {fallback.epoch} (iteration {fallback.iteration})")
            return run(fallback)
