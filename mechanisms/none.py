"""No fault tolerance: restart the whole job from step 0."""

from __future__ import annotations

from mechanisms import MECHANISMS
from mechanisms.base import FailureContext, Mechanism, RecoveryPlan


@MECHANISMS.register("none")
class NoFT(Mechanism):
    name = "none"
    summary = "no fault tolerance: replace the dead, every rank restarts from step 0"

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        return RecoveryPlan(
            replace=tuple(sorted(failure.dead)),
            source="scratch",
            restore_step=0,
            note="restart from step 0",
        )
