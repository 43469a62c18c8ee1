"""Hot spares: standby worker actors, started in advance (torch imported), mirror every shard's
state through the object store; after a failure a spare takes the dead rank's place at once
and restores from its own mirror, and a new spare starts in the background."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from architectures.base import StateLayout, Trainer
from failbench_ray.identity import ActorId, SpareId
from failbench_ray.records import CheckpointEvent
from failbench_ray.replication import truncate_copies
from failbench_ray.spec import REPLICA_TRANSFER, ExperimentSpec
from mechanisms import MECHANISMS
from mechanisms.base import (
    FailureContext,
    Hooks,
    Mechanism,
    RecoveryPlan,
    copy_steps,
    newest_restorable,
)


class HotSpareParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    spares: int = Field(1, ge=1, le=16, description="Standby actors kept ready.")
    interval: int = Field(1, ge=1, description="Mirror the state every this many steps.")


class HotSpareHooks(Hooks):
    def after_step(self, step: int, trainer: Trainer) -> list[CheckpointEvent]:
        ctx = self.ctx
        if step % ctx.params.interval:
            return []
        nbytes, secs, copies = ctx.publish(step, trainer)
        if not copies:
            return []
        return [
            CheckpointEvent(
                ctx.rank, step, "replicate", nbytes * copies, secs, time.time(), "mirror"
            )
        ]


@MECHANISMS.register("hot_spare")
class HotSpare(Mechanism):
    name = "hot_spare"
    windows = (REPLICA_TRANSFER,)
    summary = "pre-started standby actors mirror the state and take a dead rank's place at once"
    Params = HotSpareParams
    hooks_cls = HotSpareHooks

    def __init__(self, spec: ExperimentSpec, params: BaseModel) -> None:
        super().__init__(spec, params)
        assert isinstance(params, HotSpareParams)
        self.spare_actors = params.spares

    def replica_targets(
        self, rank: int, layout: StateLayout, members: tuple[int, ...], holders: list[ActorId]
    ) -> list[ActorId]:
        if layout.writer_of(layout.shard_of_rank[rank]) != rank:
            return []
        return [n for n in holders if isinstance(n, SpareId)]

    def after_recovery(self, standbys: dict[ActorId, Any], step: int) -> None:
        truncate_copies(standbys.values(), step)  # the spares' mirrors

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        replace = tuple(sorted(failure.dead))
        spares = dict(zip(replace, failure.spares, strict=False))
        steps = set(failure.survivor_steps.values()) | copy_steps(failure)
        found = newest_restorable(failure, steps, peers=True)
        if found is not None:
            step, keep, donors = found
            taken = ", ".join(f"{n} -> rank {r}" for r, n in spares.items()) or "no spare left"
            note = f"{taken}; state of step {step} from the mirror"
            return RecoveryPlan(
                replace, "replica", step, note, keep=keep, donors=donors, spares=spares
            )
        return RecoveryPlan(
            replace, "scratch", 0, "no mirror holds every shard: restart from step 0", spares=spares
        )
