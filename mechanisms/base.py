"""What a fault-tolerance mechanism is.

Two halves, kept apart on purpose:
- driver side, pure: where the mechanism applies, what exactness to expect, and `plan()`, which
  turns a failure into a `RecoveryPlan` (tested without Ray);
- worker side, `Hooks`: no-op `after_step` / `restore` methods that a mechanism overrides.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from failbench_ray.errors import RecoveryError
from failbench_ray.records import CheckpointEvent

if TYPE_CHECKING:
    from architectures.base import Architecture, StateLayout, Trainer
    from failbench_ray.spec import ExperimentSpec

RestoreSource = Literal["scratch", "checkpoint", "survivors"]


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class FailureContext:
    """What the driver knows when it must decide how to recover (input of `plan`)."""

    world_size: int
    dead: frozenset[int]
    layout: StateLayout
    committed_step: int  # the last step every survivor completed
    failure_step: int  # the step in flight when the failure hit
    quiesce: str
    latest_checkpoint: int | None = None  # latest complete durable checkpoint, if any
    furthest_step: int = 0  # the last step the most advanced survivor completed


@dataclass(frozen=True)
class RecoveryPlan:
    """What to do after a failure: which ranks get new actors, which leave the group, and
    where state comes from."""

    replace: tuple[int, ...]
    source: RestoreSource
    restore_step: int
    note: str = ""
    drop: tuple[int, ...] = ()  # dead ranks that leave the group (training goes on without)


def continue_without_dead(failure: FailureContext) -> RecoveryPlan:
    """Survivors keep their state and go on from where the furthest of them got."""
    return RecoveryPlan(
        replace=(),
        source="survivors",
        restore_step=max(failure.committed_step, failure.furthest_step),
        note=f"continue without rank(s) {sorted(failure.dead)}, no rollback",
        drop=tuple(sorted(failure.dead)),
    )


@dataclass(frozen=True)
class RestoreInstruction:
    """What one rank is told to load after the new process group is up."""

    source: RestoreSource
    step: int


@dataclass
class HookContext:
    """Worker-side context of a mechanism's hooks."""

    rank: int
    layout: StateLayout
    run_dir: Path
    params: Any
    failpoint: Callable[[str, int], None] = field(default=lambda where, step: None)


class Hooks:
    """Worker-side hooks. Every method is a no-op by default."""

    def __init__(self, ctx: HookContext) -> None:
        self.ctx = ctx

    def after_step(self, step: int, trainer: Trainer) -> list[CheckpointEvent]:
        """Called after each optimizer step; its time counts as the step's blocked time."""
        return []

    def restore(self, instruction: RestoreInstruction, trainer: Trainer) -> list[CheckpointEvent]:
        """Load the state the plan names into a freshly built trainer."""
        if instruction.source != "scratch":
            raise RecoveryError(f"{type(self).__name__} cannot restore from {instruction.source}")
        return []


class Mechanism(ABC):
    """A fault-tolerance mechanism. Subclasses set `name`, `summary`, `Params`, `hooks_cls`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = NoParams
    hooks_cls: ClassVar[type[Hooks]] = Hooks
    needs_survivor: ClassVar[bool] = False  # recovers from a live rank's state

    def __init__(self, spec: ExperimentSpec, params: BaseModel) -> None:
        self.spec = spec
        self.params = params

    def not_applicable(self, arch: Architecture) -> str | None:
        """None if the mechanism applies to this architecture and trace, else the reason."""
        return None

    def match_expected(self, arch: Architecture) -> bool:
        """Whether a faulty trial must end bit-identical to the baseline."""
        return arch.exact_replay()

    def latest_checkpoint(self, run_dir: Path, layout: StateLayout) -> int | None:
        """Latest complete durable checkpoint under run_dir (driver side, reads the disk)."""
        return None

    @abstractmethod
    def plan(self, failure: FailureContext) -> RecoveryPlan:
        """Pure: decide how to recover from `failure`."""
