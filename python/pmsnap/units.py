"""What a parameter and its optimizer state become in the pool: units.

Unit = one parameter plus every tensor in optimizer.state[param], in sorted key
order ("param", then e.g. "exp_avg", "exp_avg_sq", "step"). Non-tensor state
(RMSprop's int step), the param groups' hyperparameters and the global RNG
states travel in the checkpoint's pickled extra state (extra_state.py). An
embedding table is split into its encoded unit and a "<name>#dense"
companion by the C++ rules the libtorch hooks use too
(_pmsnap.parameter_units, frontend/parameter_units.h).

Tensors are checkpointed in place through their data pointers: while the
engine is open, parameters and state tensors must keep their storage (no
`p.data = ...`, no `module.to(...)`); Unit.check_unchanged finds a moved one
and raises ModelMismatchError naming the parameter. A Unit holds the storage
of every tensor it registered: a checkpoint of the last step may still be
copying from it in the background when the training thread replaces
`p.data`, and freeing it then would let the engine read freed memory (found
by AddressSanitizer, scripts/sanitize.sh). Should an optimizer
replace a state tensor instead of updating it in place, Unit.repin_state
copies its value back into the registered tensor (bitwise) and puts the
registered tensor back.

Thread-safety: the training thread that owns the CheckpointedOptimizer.
"""

import functools

import torch

from . import _pmsnap
from .errors import make_error

PARAM_ROLE = _pmsnap.PARAM_ROLE
# What readers call a module buffer's tensor (state_dict.TensorEntry.role):
# in the pool it is a tensor of the "#buffers" unit, named by its key.
BUFFER_ROLE = "buffer"


def dtype_name(dtype):
    """Torch's name of `dtype` without "torch." ("float32"), as the pool names dtypes."""
    return str(dtype).replace("torch.", "")


def torch_dtype(name):
    """The torch.dtype a pool's dtype name stands for; ModelMismatchError if none."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise make_error(_pmsnap.ModelMismatchError, f"pool holds an unknown dtype '{name}'")
    return dtype


@functools.cache
def _dtensor_class():
    """torch's DTensor class, or None without torch.distributed (imported
    once: is_dtensor runs for every registered tensor on every step)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def is_dtensor(t):
    """Whether `t` is a torch.distributed DTensor (FSDP2's sharded parameters
    and their optimizer state, distribute_tensor's)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return False  # the common case, on every step: no class lookup
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(t, dtensor)


def local_tensor(t):
    """The tensor whose memory holds `t` on this rank: a DTensor's local
    shard, else `t` itself. pmsnap checkpoints this memory in place; the
    shard's place in the global tensor is recorded beside it
    (sharded_layout)."""
    return t.to_local().detach() if is_dtensor(t) else t


def sharded_layout(name, t):
    """{"global_shape", "placements", "mesh_shape", "offsets"} of a DTensor
    `t` on this rank (what DCP keeps of a shard), or None for a plain
    tensor. offsets: where the local shard starts in the global tensor."""
    if not is_dtensor(t):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if list(shape) != list(t.to_local().shape):
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"parameter '{name}': its local shard is {shape_text(t.to_local().shape)} "
                         f"but its placements {t.placements} give {shape_text(shape)}")
    return {"global_shape": list(t.shape), "placements": [str(p) for p in t.placements],
            "mesh_shape": list(t.device_mesh.shape), "offsets": [int(o) for o in offsets]}


def new_state_tensor(param, shape, dtype, device, like_param):
    """Zeros for a state tensor of `param` that torch has not made yet: with
    `like_param`, shaped like this rank's shard of `param` and, for a
    DTensor, sharded like it (Adam's moments under FSDP2); else a plain
    tensor of `shape` (`step`)."""
    local = local_tensor(param)
    zeros = torch.zeros(local.shape if like_param else shape, dtype=dtype, device=device)
    if like_param and is_dtensor(param):
        from torch.distributed.tensor import DTensor
        zeros = DTensor.from_local(zeros, param.device_mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride())
    return zeros


def shape_text(shape):
    """"[4, 3]", as the C++ messages write shapes."""
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def named_parameters(optimizer, model):
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
                raise make_error(_pmsnap.InvalidArgumentError,
                                 f"parameter group{g}.param{i} appears twice in the optimizer")
            seen.add(id(p))
            out.append((names.get(id(p), f"group{g}.param{i}"), p))
    if not out:
        raise make_error(_pmsnap.InvalidArgumentError, "the optimizer has no parameters")
    return out


def state_tensors(optimizer, param):
    """Sorted [(key, tensor)] of the tensor entries in optimizer.state[param]."""
    state = optimizer.state.get(param)
    if not state:
        return []
    return sorted(((k, v) for k, v in state.items() if isinstance(v, torch.Tensor)),
                  key=lambda kv: str(kv[0]))


class Unit:
    """One parameter and its state tensors, as laid out: one engine unit, or for
    an embedding table its encoded unit plus a dense companion."""

    __slots__ = ("name", "param", "tensors", "table", "_registrations", "_storage_holds",
                 "_watched")

    def __init__(self, name, param, state, table=False):
        self.name = name
        self.param = param
        self.tensors = [(PARAM_ROLE, param)] + state  # [(role, tensor)]
        # What is registered: each tensor's memory on this rank (a DTensor's
        # local shard). Also the aliases of the registered storage that
        # `p.data = ...` does not rebind: the memory the engine copies stays
        # valid (module doc).
        self._storage_holds = [local_tensor(t).detach() for _, t in self.tensors]
        # What check_unchanged compares on every step: (role, tensor, its
        # registered memory's pointer and shape).
        self._watched = [(role, t, held.data_ptr(), held.shape)
                         for (role, t), held in zip(self.tensors, self._storage_holds)]
        self.table = table
        self._registrations = None

    def registrations(self, cuda):
        """[(unit name, views)]: the unit, then its companions if any (a
        table's "#dense", and "#host" with the CPU state of a CUDA parameter:
        _pmsnap.parameter_units).

        InvalidArgumentError naming the parameter for a tensor that is not
        contiguous dense memory on the engine's device (`cuda` or the host);
        with `cuda`, optimizer state on the CPU is allowed (Adam's `step`)
        and checkpointed from there.
        """
        views = [self._view(role, local, cuda)
                 for (role, _), local in zip(self.tensors, self._storage_holds)]
        self._registrations = _pmsnap.parameter_units(self.name, views, self.table)
        return self._registrations

    def encoded_roles(self):
        """[(role, shape)] of a table's encoded unit, as registered."""
        _, views = self._registrations[0]
        return [(role, tuple(shape)) for role, _, _, shape, _ in views]

    def check_unchanged(self):
        """ModelMismatchError if a registered tensor moved or changed shape."""
        for role, t, ptr, shape in self._watched:
            t = local_tensor(t)
            if t.data_ptr() != ptr or t.shape != shape:
                raise make_error(_pmsnap.ModelMismatchError,
                                 f"parameter '{self.name}': tensor '{role}' changed from "
                                 f"{shape_text(shape)} to {shape_text(t.shape)} (or moved) "
                                 "since the pool was laid out; pmsnap checkpoints tensors in "
                                 "place, so they must keep their storage (no .data "
                                 "reassignment or module.to() after wrapping)")

    def repin_state(self, optimizer):
        """Keeps the registered state tensors in optimizer.state (module doc)."""
        state = optimizer.state.get(self.param)
        registered = self.tensors[1:]
        count = 0
        if state:
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    count += 1
        if count != len(registered):
            keys = sorted(str(k) for k, v in (state or {}).items() if isinstance(v, torch.Tensor))
            raise make_error(_pmsnap.ModelMismatchError,
                             f"parameter '{self.name}': optimizer state tensors changed from "
                             f"{[r for r, _ in registered]} to {keys} after the pool was laid "
                             "out (a parameter without a gradient in the first step gained "
                             "state later?); use a new pool")
        for (key, tensor) in registered:
            current = state.get(key)
            if current is tensor:
                continue
            if (not isinstance(current, torch.Tensor) or current.shape != tensor.shape
                    or current.dtype != tensor.dtype):
                raise make_error(_pmsnap.ModelMismatchError,
                                 f"parameter '{self.name}': optimizer state '{key}' changed "
                                 "shape or dtype after the pool was laid out")
            tensor.copy_(current)
            state[key] = tensor

    def _view(self, role, t, cuda):
        if t.is_sparse or not t.is_contiguous():
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"parameter '{self.name}': tensor '{role}' is not contiguous dense "
                             "memory; pmsnap checkpoints tensors in place")
        on_host = False
        if (t.device.type == "cuda") != cuda:
            # PyTorch keeps scalar optimizer state (Adam's `step` unless
            # capturable or fused) on the CPU beside GPU parameters: such a
            # tensor goes through the host path, in the same epoch.
            on_host = cuda and role != PARAM_ROLE and t.device.type == "cpu"
            if not on_host:
                raise make_error(_pmsnap.InvalidArgumentError,
                                 f"parameter '{self.name}': tensor '{role}' lives on {t.device} "
                                 f"but the pmsnap device is {'cuda' if cuda else 'the host'}")
        return (str(role), t.data_ptr(), dtype_name(t.dtype), list(t.shape), on_host)


class ModuleBuffers:
    """A module's persistent buffers (those in its state_dict: BatchNorm's
    running statistics and the like; not non-persistent ones), checkpointed
    with every step as the "#buffers" unit (_pmsnap.buffer_units).

    Forward changes buffers in place, before the next step's hooks could
    order that against a checkpoint copy, so the engine never reads them
    directly: each has a registered shadow tensor (same dtype, shape and
    device) that capture() fills at the step boundary, between the unit's
    hooks; restore() copies the shadows back. A buffer is looked up through
    its module at each capture, so a module that rebinds it is followed; one
    that changes its shape or dtype is a ModelMismatchError naming it."""

    __slots__ = ("names", "_owners", "_shadows", "_registrations")

    def __init__(self, model):
        keys = set(model.state_dict(keep_vars=True))
        self.names = []
        self._owners = []  # (module, attribute) holding each buffer
        self._shadows = []
        for name, buffer in model.named_buffers():
            if name not in keys:
                continue  # non-persistent: not part of the model's state
            module_name, _, attribute = name.rpartition(".")
            self.names.append(name)
            self._owners.append((model.get_submodule(module_name), attribute))
            self._shadows.append(torch.empty_like(buffer, memory_format=torch.contiguous_format))
        self._registrations = None

    def __len__(self):
        return len(self.names)

    def shadow_bytes(self):
        """Bytes the shadows take (a copy of every buffer), by device type."""
        by_device = {}
        for shadow in self._shadows:
            by_device[shadow.device.type] = (by_device.get(shadow.device.type, 0)
                                             + shadow.numel() * shadow.element_size())
        return by_device

    def specs(self):
        """{name: (dtype name, shape list)} of every buffer, as pools record them."""
        return {name: (dtype_name(shadow.dtype), list(shadow.shape))
                for name, shadow in zip(self.names, self._shadows)}

    def registrations(self, cuda):
        """[(unit name, views)] of the buffers' units (none without buffers)."""
        views = []
        for name, shadow in zip(self.names, self._shadows):
            on_host = False
            if (shadow.device.type == "cuda") != cuda:
                on_host = cuda and shadow.device.type == "cpu"
                if not on_host:
                    raise make_error(_pmsnap.InvalidArgumentError,
                                     f"module buffer '{name}' lives on {shadow.device} but the "
                                     f"pmsnap device is {'cuda' if cuda else 'the host'}")
            views.append((name, shadow.data_ptr(), dtype_name(shadow.dtype), list(shadow.shape),
                          on_host))
        self._registrations = _pmsnap.buffer_units(views)
        return self._registrations

    def _live(self):
        live = []
        for name, (module, attribute), shadow in zip(self.names, self._owners, self._shadows):
            buffer = module._buffers.get(attribute)
            if (buffer is None or buffer.shape != shadow.shape or buffer.dtype != shadow.dtype
                    or buffer.device != shadow.device):
                raise make_error(_pmsnap.ModelMismatchError,
                                 f"module buffer '{name}' changed from {dtype_name(shadow.dtype)} "
                                 f"{shape_text(shadow.shape)} on {shadow.device} to "
                                 f"{'nothing' if buffer is None else dtype_name(buffer.dtype)} "
                                 f"{'' if buffer is None else shape_text(buffer.shape)} since the "
                                 "pool was laid out")
            live.append(buffer)
        return live

    def capture(self):
        """Copies every buffer into its shadow (on the buffers' devices, in
        stream order on a GPU)."""
        if self._shadows:
            torch._foreach_copy_(self._shadows, self._live())

    def restore(self):
        """Copies the shadows (just restored by the engine) into the buffers."""
        if self._shadows:
            with torch.no_grad():
                torch._foreach_copy_(self._live(), self._shadows)
