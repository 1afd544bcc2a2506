"""Option objects for CheckpointedOptimizer's less common keywords.

Three groups, each a frozen dataclass with the keywords' defaults, so a
run's settings can be built once and passed around ([architecture2]):

    tuning = pmsnap.Tuning(workers=4, dram_staging_buffers=1)
    opt = pmsnap.CheckpointedOptimizer(torch.optim.AdamW(model.parameters()), pool,
                                       model=model, tuning=tuning)

  Tuning        how checkpoints are taken: strategy, workers, worker_cpus,
                part_bytes, copy_start, dram_staging_buffers, reserve_bytes,
                step_groups
  PoolSettings  the pool and what it reports: extra_state_capacity,
                verify_on_open, check_free_space, chunk_heap_bytes,
                print_summary
  Ranks         several ranks: process_group, sharding, replicas

Every field stays a keyword of CheckpointedOptimizer too (its docstring says
what each does). A keyword given beside an object whose same field is not
at its default raises InvalidArgumentError naming both: one value, one place.
"""

import dataclasses
from typing import Any, Optional, Sequence

from . import _pmsnap
from .errors import make_error


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How checkpoints are taken (CheckpointedOptimizer's keywords of the
    same names)."""
    strategy: str = "adaptive"
    workers: Optional[int] = None
    worker_cpus: Optional[Sequence[int]] = None
    part_bytes: int = 4 << 20
    copy_start: Optional[str] = None
    dram_staging_buffers: int = 0
    reserve_bytes: int = 0
    step_groups: Optional[int] = 4


@dataclasses.dataclass(frozen=True)
class PoolSettings:
    """A newly created pool's layout and what the engine reports
    (CheckpointedOptimizer's keywords of the same names)."""
    extra_state_capacity: int = 256 << 10
    verify_on_open: bool = True
    check_free_space: bool = True
    chunk_heap_bytes: Optional[int] = None
    print_summary: bool = False


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Several ranks checkpointing together (CheckpointedOptimizer's
    keywords of the same names)."""
    process_group: Any = None
    sharding: Optional[str] = None
    replicas: int = 1


class _Unset:
    """A keyword not given (its default then comes from the option object)."""

    def __repr__(self):
        return "<default>"


UNSET = _Unset()


def resolve(group_class, group, keyword, **given):
    """The values of `group_class`'s fields, in field order: each the keyword
    in `given` when not UNSET, else `group`'s field (group None: the field's
    default). `keyword` is the option object's keyword name, for messages.
    InvalidArgumentError for a group of another type, or a field set both
    as a keyword and (away from its default) in `group`."""
    if group is not None and not isinstance(group, group_class):
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"{keyword}= must be a pmsnap.{group_class.__name__}, got "
                         f"{type(group).__name__}")
    values = []
    for field in dataclasses.fields(group_class):
        value = given[field.name]
        in_group = getattr(group, field.name) if group is not None else field.default
        if value is UNSET:
            values.append(in_group)
            continue
        if group is not None and in_group != field.default:
            raise make_error(_pmsnap.InvalidArgumentError,
                             f"{field.name} given twice: as the keyword {field.name}={value!r} "
                             f"and in {keyword}= ({field.name}={in_group!r}); give it once")
        values.append(value)
    return tuple(values)


def check_not_given(kwargs, owner, names=("model", "finish_step_later")):
    """InvalidArgumentError if `kwargs` (meant for CheckpointedOptimizer)
    sets one of `names`, which `owner` (a trainer integration) sets itself."""
    given = sorted(set(names) & set(kwargs))
    if given:
        raise make_error(_pmsnap.InvalidArgumentError, f"{owner} sets {given} itself")


def default_workers(device, cpu_count):
    """Copy/persist worker threads when workers= is not given, for `device`
    ("host", "simulated:...", "cuda[:N]") on a machine of `cpu_count` CPUs
    (None: unknown, taken as 2). At least 1; at most cpu_count - 1, since
    oneTBB lends an arena no more worker threads (and warns when asked for
    more).

    On a GPU the training thread leaves the CPU's cores idle, and each
    checkpoint's parts are sealed (flushed, checksummed) by the workers after
    the GPU copied them: up to 8, one per two CPUs (on an H200 host with 16
    CPUs, GPT-2 small checkpointed every step ran at 130 ms/step with 2
    workers, 76 with 4, 50 with 8; bench/RESULTS.md). On the host the
    training itself uses the cores: 2."""
    cpus = max(1, cpu_count or 2)
    most = max(1, cpus - 1)
    if str(device).startswith("cuda"):
        return max(1, min(8, cpus // 2, most))
    return max(1, min(2, most))


_STRATEGIES = ("1", "2", "3", "4", "adaptive")
_MODES = ("continuous", "every", "checkfreq")


def check_settings(optimizer, mode, every, strategy, sharding, replicas, step_groups):
    """CheckpointedOptimizer's checks of its keywords: InvalidArgumentError
    naming the keyword and the value that fails. Returns the mode (None:
    "every" when every= is given, else "continuous")."""
    import torch  # imported here: the option objects need no torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise make_error(_pmsnap.InvalidArgumentError,
                         "LBFGS couples all parameters in one update and cannot be stepped "
                         "parameter by parameter")
    if mode is None:
        mode = "every" if every is not None else "continuous"
    if mode not in _MODES:
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"unknown mode '{mode}' (continuous, every or checkfreq)")
    if mode == "continuous" and every is not None:
        raise make_error(_pmsnap.InvalidArgumentError,
                         "every= is for mode 'every' (or 'checkfreq'), not 'continuous'")
    if every is not None and (not isinstance(every, int) or every < 1):
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"every must be an int >= 1, got {every!r}")
    if str(strategy) not in _STRATEGIES:
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"unknown conflict strategy '{strategy}' (\"1\", \"2\", \"3\", "
                         "\"4\" or \"adaptive\")")
    if sharding not in (None, "replicated"):
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"unknown sharding {sharding!r} (None or \"replicated\")")
    if not isinstance(replicas, int) or replicas < 1:
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"replicas must be an int >= 1, got {replicas!r}")
    if replicas != 1 and sharding is None:
        raise make_error(_pmsnap.InvalidArgumentError,
                         "replicas= needs sharding=\"replicated\"")
    if step_groups is not None and (not isinstance(step_groups, int) or step_groups < 0):
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"step_groups must be None or an int >= 0, got {step_groups!r}")
    return mode
