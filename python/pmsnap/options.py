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
