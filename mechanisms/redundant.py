"""Redundancy (Bamboo-style): every rank keeps, at every step, a shadow of its ring
neighbour's state; when the neighbour dies its replacement takes the shadow and the survivors
go on without rolling back. Where the neighbour holds the same shard (data parallel) its own
state is the shadow and costs nothing."""

from __future__ import annotations

import time

from architectures.base import Architecture, StateLayout, Trainer
from failbench_ray.identity import ActorId, RankId
from failbench_ray.records import CheckpointEvent
from failbench_ray.spec import REPLICA_TRANSFER
from mechanisms import MECHANISMS
from mechanisms.base import (
    FailureContext,
    Hooks,
    Mechanism,
    RecoveryPlan,
    copy_steps,
    newest_restorable,
    survivor_reason,
)


class RedundantHooks(Hooks):
    def after_step(self, step: int, trainer: Trainer) -> list[CheckpointEvent]:
        ctx = self.ctx
        # Synchronous: a rank's step is done only once its neighbour holds the shadow, so the
        # shadow is never behind and survivors need not roll back.
        nbytes, secs, copies = ctx.publish(step, trainer, wait=True)
        if not copies:
            return []
        return [CheckpointEvent(ctx.rank, step, "replicate", nbytes, secs, time.time(), "shadow")]


def ring_next(rank: int, members: tuple[int, ...]) -> int:
    ring = list(members)
    return ring[(ring.index(rank) + 1) % len(ring)]


@MECHANISMS.register("redundant")
class Redundant(Mechanism):
    name = "redundant"
    windows = (REPLICA_TRANSFER,)
    summary = "each rank shadows its ring neighbour's state every step; it takes over (Bamboo)"
    hooks_cls = RedundantHooks
    needs_survivor = True

    def not_applicable(self, arch: Architecture) -> str | None:
        return survivor_reason(arch, self.spec)

    def replica_targets(
        self, rank: int, layout: StateLayout, members: tuple[int, ...], holders: list[ActorId]
    ) -> list[ActorId]:
        nxt = ring_next(rank, members)
        if nxt == rank or layout.shard_of_rank[nxt] == layout.shard_of_rank[rank]:
            return []  # the neighbour's own state already is the shadow
        return [RankId(nxt)]

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        replace = tuple(sorted(failure.dead))
        steps = set(failure.survivor_steps.values()) | copy_steps(failure)
        found = newest_restorable(failure, steps, peers=True)
        if found is not None:
            step, keep, donors = found
            rolled = [r for r in failure.survivor_steps if r not in keep]
            note = f"rank(s) {list(replace)} take their shadow of step {step}"
            note += f"; rank(s) {sorted(rolled)} roll back to it" if rolled else ", no rollback"
            return RecoveryPlan(replace, "replica", step, note, keep=keep, donors=donors)
        return RecoveryPlan(
            replace,
            "scratch",
            0,
            "every shadow of a dead rank died with it (neighbours failed together): step 0",
        )
