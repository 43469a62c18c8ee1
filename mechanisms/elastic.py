"""Elastic training (TorchElastic-style shrink and grow): the survivors go on at once with the
global batch re-split among them; replacements start in the background and join back, healed
from a live peer, as soon as they are up."""

from __future__ import annotations

from architectures.base import Architecture
from mechanisms import MECHANISMS
from mechanisms.base import (
    FailureContext,
    Mechanism,
    RecoveryPlan,
    live_plan,
    single_holder_reason,
    survivor_reason,
)


@MECHANISMS.register("elastic")
class Elastic(Mechanism):
    name = "elastic"
    windows = ("regrowing",)
    summary = "go on with the survivors (data re-balanced), grow back when replacements are up"
    needs_survivor = True
    rebalances_data = True

    def not_applicable(self, arch: Architecture) -> str | None:
        reason = survivor_reason(arch, self.spec) or single_holder_reason(
            arch.layout(), "the group cannot shrink without losing that state"
        )
        if reason is None and len(arch.layout().shard_ids()) > 1:
            # e.g. hybrid: a rank's death leaves its pipeline replica without a stage.
            reason = (
                "ranks hold different parts of the model, so the survivors cannot go on "
                "without one; shrinking needs every rank to hold the full model"
            )
        return reason

    def match_expected(self, arch: Architecture) -> bool:
        return False  # fewer ranks split the batch differently for a while

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        dead = tuple(sorted(failure.dead))
        plan = live_plan(failure, (), "peer", drop=dead, grow=dead)
        if plan is not None:
            return plan
        return RecoveryPlan(dead, "scratch", 0, "no survivor holds a dead rank's state: step 0")

    def grow_plan(self, failure: FailureContext, grown: tuple[int, ...]) -> RecoveryPlan:
        plan = live_plan(failure, (), "peer", restored_also=grown)
        if plan is None:
            raise ValueError("growing back needs a live peer for every shard")
        return plan
