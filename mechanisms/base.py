"""What a fault-tolerance mechanism is: one interface, two sides.

- driver side (`Mechanism`): where it applies and what exactness to expect; the standby actors
  it needs (`holder_actors` of its `holder_actor` class, `spare_actors` hot spares), which the
  controller starts and ends; its pure `plan()` (and `grow_plan()`), which turns a failure into
  a `RecoveryPlan` (tested without Ray); and `after_recovery()`, what it does once recovered;
- worker side (`Hooks`): `after_step`, `restore` and `close`, with `publish` (a snapshot the
  replica targets pull) in their context.
The engine imports this interface only: a new mechanism is one module plus its registration.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from failbench_ray.errors import RecoveryError
from failbench_ray.identity import ActorId, RankId, SpareId
from failbench_ray.records import CheckpointEvent
from mechanisms import sources

if TYPE_CHECKING:
    from architectures.base import Architecture, StateLayout, Trainer
    from failbench_ray.replication import Packed
    from failbench_ray.spec import ExperimentSpec

RestoreSource = Literal["scratch", "checkpoint", "survivors", "replica", "peer", "jit"]
# How one shard reaches a rank that does not keep its own state:
#   "replica": a holder's copy in the object store; "peer": a live rank's current state;
#   "jit": a file the donor (a live rank holding the shard) writes just in time.
DonorKind = Literal["replica", "peer", "jit"]


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
    # Survivors still alive with their state (empty when the quiesce killed them) -> the last
    # step each completed, and the steps of the snapshots each keeps of its own state.
    survivor_steps: dict[int, int] = field(default_factory=dict)
    own_snapshots: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # Copies in the object store held by live holders: shard -> step -> who holds one.
    replicas: dict[int, dict[int, tuple[ActorId, ...]]] = field(default_factory=dict)
    spares: tuple[SpareId, ...] = ()  # ready hot spares
    # Ranks in the group (live or dead); default every rank. A rank replaced by an earlier,
    # interrupted recovery is a member that is neither dead nor a survivor: it needs state too.
    members: tuple[int, ...] | None = None
    # After a silent corruption: no state newer than this step is clean (the rollback bound).
    restore_at_most: int | None = None

    @property
    def survivors(self) -> list[int]:
        return sorted(self.survivor_steps)

    def to_restore(self, keep: tuple[int, ...], drop: tuple[int, ...] = ()) -> list[int]:
        """Every member that does not keep its own state (and does not leave the group)."""
        members = self.members if self.members is not None else range(self.world_size)
        return [r for r in members if r not in keep and r not in drop]


@dataclass(frozen=True)
class RecoveryPlan:
    """What to do after a failure: which ranks get new actors, which leave the group, and
    where state comes from."""

    replace: tuple[int, ...]
    source: RestoreSource
    restore_step: int
    note: str = ""
    drop: tuple[int, ...] = ()  # dead ranks that leave the group (training goes on without)
    keep: tuple[int, ...] = ()  # survivors whose own state is already at restore_step
    donors: dict[int, tuple[ActorId, DonorKind]] = field(default_factory=dict)  # shard -> donor
    spares: dict[int, SpareId] = field(default_factory=dict)  # replaced rank -> spare taking it
    grow: tuple[int, ...] = ()  # dropped ranks brought back once their replacements are up


def donors_at(
    failure: FailureContext, step: int, restored: list[int], *, peers: bool, copies: bool
) -> dict[int, tuple[ActorId, DonorKind]] | None:
    """A donor at `step` for the shard of every rank in `restored`, or None if one is missing.

    A survivor that keeps a snapshot of its own state at `step` needs no donor. Otherwise a
    live rank exactly at `step` holding the shard gives its current state (`peers`), else a
    holder's copy of that step (`copies`).
    """
    layout = failure.layout
    donors: dict[int, tuple[ActorId, DonorKind]] = {}
    for rank in restored:
        if step in failure.own_snapshots.get(rank, ()):
            continue
        shard = layout.shard_of_rank[rank]
        if shard in donors:
            continue
        live = [
            q
            for q, at in failure.survivor_steps.items()
            if at == step and layout.shard_of_rank[q] == shard
        ]
        holders = failure.replicas.get(shard, {}).get(step, ())
        if peers and live:
            donors[shard] = (RankId(live[0]), "peer")
        elif copies and holders:
            donors[shard] = (holders[0], "replica")
        else:
            return None
    return donors


def newest_restorable(
    failure: FailureContext, steps: set[int], *, peers: bool
) -> tuple[int, tuple[int, ...], dict[int, tuple[ActorId, DonorKind]]] | None:
    """The newest of `steps` every member can be brought to: (step, ranks that keep, donors).

    Survivors already at the step keep; every other member takes its own snapshot or a donor's
    copy (`peers`: also a live rank's current state)."""
    for step in sorted(steps, reverse=True):
        keep = tuple(r for r, at in sorted(failure.survivor_steps.items()) if at == step)
        donors = donors_at(failure, step, failure.to_restore(keep), peers=peers, copies=True)
        if donors is not None:
            return step, keep, donors
    return None


def copy_steps(failure: FailureContext) -> set[int]:
    """Steps of which some holder has a copy of some shard."""
    return {s for v in failure.replicas.values() for s in v}


def rollback_plan(failure: FailureContext, replace: tuple[int, ...], why: str) -> RecoveryPlan:
    """Every rank rolls back to the latest complete durable checkpoint, or to step 0."""
    if failure.latest_checkpoint is None:
        return RecoveryPlan(replace, "scratch", 0, f"{why}no complete checkpoint: step 0")
    return RecoveryPlan(
        replace,
        "checkpoint",
        failure.latest_checkpoint,
        f"{why}every rank rolls back to the checkpoint of step {failure.latest_checkpoint}",
    )


def shards_with_one_holder(layout: StateLayout) -> list[int]:
    return [g[0] for g in layout.replica_groups() if len(g) == 1]


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
    """What the ranks are told to load after the new process group is up.

    Ranks in `keep` go on with their own state; the others take their shard from `source`
    (for replica/peer/jit: from the donor of their shard, a handle in `donors`).
    """

    source: RestoreSource
    step: int
    keep: frozenset[int] = frozenset()
    donors: dict[int, tuple[ActorId, DonorKind, Any]] = field(default_factory=dict)  # shard ->
    # (donor, kind, actor handle)


@dataclass
class HookContext:
    """Worker-side context of a mechanism's hooks."""

    rank: int
    layout: StateLayout
    run_dir: Path
    params: Any
    failpoint: Callable[[str, int], None] = field(default=lambda where, step: None)
    # Report an event from a background thread (an async checkpoint that became durable).
    emit: Callable[[CheckpointEvent], None] = field(default=lambda event: None)
    # Snapshot this rank's state at a step boundary and have the replica targets pull it;
    # returns (bytes per copy, seconds the step was blocked, number of targets). With
    # wait=True the step waits until every target owns its copy.
    publish: Callable[..., tuple[int, float, int]] = field(
        default=lambda step, trainer, wait=False: (0, 0.0, 0)
    )


class Hooks:
    """Worker-side hooks. Every method is a no-op by default."""

    def __init__(self, ctx: HookContext) -> None:
        self.ctx = ctx

    def after_step(self, step: int, trainer: Trainer) -> list[CheckpointEvent]:
        """Called after each optimizer step; its time counts as the step's blocked time."""
        return []

    def restore(
        self, instruction: RestoreInstruction, trainer: Trainer, local: Packed | None
    ) -> list[CheckpointEvent]:
        """Load this rank's shard of `instruction.step` into `trainer` (a rank that keeps its
        own state is not asked). `local`: this process's own copy of it, if any (a snapshot,
        a hot spare's mirror). By default from whatever the plan names: a checkpoint file, a
        donor's copy in the object store, a live peer, a just-in-time file."""
        return sources.load(instruction, self.ctx, trainer, local=local)

    def donate(self, instruction: RestoreInstruction, trainer: Trainer) -> list[CheckpointEvent]:
        """This rank keeps its own state (already loaded into `trainer`), and goes first: it
        may hand it to the ranks that restore (a just-in-time checkpoint). Nothing by default."""
        return []

    def save_now(self, step: int, trainer: Trainer) -> list[CheckpointEvent]:
        """Save the state of `step` off the schedule (every rank at the same step: the driver
        asks on a preemption notice). Nothing by default; see `Mechanism.saves_on_notice`."""
        return []

    def close(self) -> None:
        """The trial's last step is done (finish background work)."""


class Mechanism(ABC):
    """A fault-tolerance mechanism. Subclasses set `name`, `summary`, `Params`, `hooks_cls`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = NoParams
    hooks_cls: ClassVar[type[Hooks]] = Hooks
    needs_survivor: ClassVar[bool] = False  # recovers from a live rank's state
    # Standby actors the controller starts for it (and ends with the trial): `holder_actors`
    # of the Ray actor class `holder_actor` (the object-store backend's `ReplicaHolderActor`)
    # and `spare_actors` hot spares (started workers). Copies of a rank's state go to the
    # actors `replica_targets` names.
    holder_actors: int = 0
    holder_actor: ClassVar[Any] = None
    spare_actors: int = 0
    rebalances_data: ClassVar[bool] = False  # survivors split the dead ranks' data (elastic)
    saves_on_notice: ClassVar[bool] = False  # its hooks' `save_now` saves (a preemption notice)
    # Windows of its own a second failure can strike in (`failbench search`), beyond the
    # recovery phases every mechanism has: `spec.WORKER_TRIGGERS` its hooks pass through every
    # `params.interval` steps, or a phase of its own (`regrowing`).
    windows: ClassVar[tuple[str, ...]] = ()

    def __init__(self, spec: ExperimentSpec, params: BaseModel) -> None:
        self.spec = spec
        self.params = params

    def not_applicable(self, arch: Architecture) -> str | None:
        """None if the mechanism applies to this architecture and trace, else the reason."""
        return None

    def replica_targets(
        self, rank: int, layout: StateLayout, members: tuple[int, ...], holders: list[ActorId]
    ) -> list[ActorId]:
        """Who pulls a copy of `rank`'s state when it publishes (pure; none by default)."""
        return []

    def match_expected(self, arch: Architecture) -> bool:
        """Whether a faulty trial must end bit-identical to the baseline."""
        return arch.exact_replay()

    def latest_checkpoint(
        self, run_dir: Path, layout: StateLayout, at_most: int | None = None
    ) -> int | None:
        """Latest complete durable checkpoint under run_dir of a step no later than `at_most`
        (driver side, reads the disk)."""
        return None

    def discard_after(self, run_dir: Path, step: int) -> list[int]:
        """Training rolled back to `step` past state that failed the corruption checks: drop
        the durable checkpoints of later steps (driver side). Returns the steps dropped."""
        from mechanisms import checkpoint_io  # the one on-disk layout every mechanism shares

        return checkpoint_io.discard_after(run_dir, step)

    @abstractmethod
    def plan(self, failure: FailureContext) -> RecoveryPlan:
        """Pure: decide how to recover from `failure`."""

    def grow_plan(self, failure: FailureContext, grown: tuple[int, ...]) -> RecoveryPlan:
        """Pure: the group grows back (elastic): survivors keep, `grown` heal from live peers."""
        raise RecoveryError(f"{self.name} does not grow back")

    def after_recovery(self, standbys: dict[ActorId, Any], step: int) -> None:  # noqa: B027 (a hook)
        """Driver side, once every rank holds the state of `step`: e.g. tell the standby
        actors (by identity) that their copies of later steps are stale. Nothing by default."""


def survivor_reason(arch: Architecture, spec: ExperimentSpec) -> str | None:
    """Why survivors keep no live state to recover from, if they do not."""
    if not arch.abortable:
        return (
            f"{arch.name}'s collectives block inside gloo and cannot be aborted, so the "
            "survivors are killed to quiesce and no live state is left to recover from"
        )
    if spec.quiesce == "kill_survivors":
        return "quiesce: kill_survivors throws the survivors' state away; use abort"
    return None


def single_holder_reason(layout: StateLayout, what: str) -> str | None:
    """Why a mechanism that needs a second holder of every shard does not apply, if so."""
    alone = shards_with_one_holder(layout)
    if not alone:
        return None
    holds = sorted({layout.holds[layout.writer_of(s)] for s in alone})
    return f"{len(alone)} shard(s) held by one rank only ({'; '.join(holds)[:120]}): {what}"


def live_plan(
    failure: FailureContext,
    replace: tuple[int, ...],
    kind: DonorKind,
    *,
    drop: tuple[int, ...] = (),
    grow: tuple[int, ...] = (),
    restored_also: tuple[int, ...] = (),
) -> RecoveryPlan | None:
    """Survivors at the furthest step they agree on keep their state; every other rank (the
    replaced, lagging survivors, `restored_also`) takes its shard from a live rank at that
    step. None if some shard has no surviving holder at any step survivors reached."""
    for step in sorted(set(failure.survivor_steps.values()), reverse=True):
        keep = tuple(r for r, at in sorted(failure.survivor_steps.items()) if at == step)
        restored = failure.to_restore(keep, drop) + [r for r in restored_also if r not in keep]
        restored = sorted(set(restored))
        donors = donors_at(failure, step, restored, peers=True, copies=False)
        if donors is None:
            continue
        donors = {shard: (name, kind) for shard, (name, _) in donors.items()}
        source: RestoreSource = kind if restored else "survivors"
        what = {"peer": "from a live peer", "jit": "from a just-in-time checkpoint"}[str(kind)]
        note = f"survivors keep step {step}; rank(s) {sorted(restored)} heal {what}"
        if not restored:
            note = f"survivors keep step {step}"
        return RecoveryPlan(replace, source, step, note, drop, keep, donors, grow=grow)
    return None


class FromLivePeer(Mechanism):
    """A mechanism whose replacements take their state from a surviving holder of the same
    shard (`jit_ckpt` through a file, `live_recovery` through the object store)."""

    donor_kind: ClassVar[DonorKind]
    without_peer: ClassVar[str]  # why it does not apply where a shard has one holder
    needs_survivor = True

    def not_applicable(self, arch: Architecture) -> str | None:
        return survivor_reason(arch, self.spec) or single_holder_reason(
            arch.layout(), self.without_peer
        )

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        replace = tuple(sorted(failure.dead))
        plan = live_plan(failure, replace, self.donor_kind)
        if plan is not None:
            return plan
        return RecoveryPlan(
            replace, "scratch", 0, "no survivor holds a dead rank's state: restart from step 0"
        )
