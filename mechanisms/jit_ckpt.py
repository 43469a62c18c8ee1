"""Just-in-time checkpointing: no periodic cost. After a failure a survivor that holds the same
state as a dead rank writes it to disk, and the replacement loads that file."""

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


@MECHANISMS.register("jit_ckpt")
class JitCkpt(Mechanism):
    name = "jit_ckpt"
    summary = "no periodic cost; after a failure a data-parallel peer checkpoints just in time"
    needs_survivor = True

    def not_applicable(self, arch: Architecture) -> str | None:
        return survivor_reason(arch, self.spec) or single_holder_reason(
            arch.layout(), "no data-parallel peer holds the same state to checkpoint"
        )

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        replace = tuple(sorted(failure.dead))
        plan = live_plan(failure, replace, "jit")
        if plan is not None:
            return plan
        return RecoveryPlan(
            replace, "scratch", 0, "no survivor holds a dead rank's state: restart from step 0"
        )
