"""Live peer recovery (torchft): survivors never roll back; a replacement heals from a live
peer's state at the current step, sent through the object store."""

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


@MECHANISMS.register("live_recovery")
class LiveRecovery(Mechanism):
    name = "live_recovery"
    summary = "replacements heal from a live peer at the current step, no rollback (torchft)"
    needs_survivor = True

    def not_applicable(self, arch: Architecture) -> str | None:
        return survivor_reason(arch, self.spec) or single_holder_reason(
            arch.layout(), "no live peer holds the same state to heal from"
        )

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        replace = tuple(sorted(failure.dead))
        plan = live_plan(failure, replace, "peer")
        if plan is not None:
            return plan
        return RecoveryPlan(
            replace, "scratch", 0, "no live peer holds a dead rank's state: restart from step 0"
        )
