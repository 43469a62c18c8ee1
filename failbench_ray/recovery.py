"""Deciding how to recover: a pure function of the failure, the mechanism and the architecture.

The architecture has the first word where training simply goes on without the dead (gossip,
unless it asks for replacements); otherwise the mechanism's plan decides.
"""

from __future__ import annotations

from failbench_ray.errors import RecoveryError
from mechanisms.base import FailureContext, Mechanism, RecoveryPlan, continue_without_dead


def decide(
    mechanism: Mechanism, failure: FailureContext, *, continues_without_dead: bool
) -> RecoveryPlan:
    survivors = failure.world_size - len(failure.dead)
    if continues_without_dead and survivors >= 2:
        plan = continue_without_dead(failure)
    else:
        plan = mechanism.plan(failure)
    bound = failure.restore_at_most
    if bound is not None and plan.restore_step > bound:
        raise RecoveryError(
            f"{mechanism.name} keeps no state from step {bound} or before, the last that passed "
            f"the corruption checks (its plan restores step {plan.restore_step}): it cannot undo "
            "silent corruption; use disk_ckpt or async_ckpt, or check more often than it saves"
        )
    left = set(failure.dead) - set(plan.replace) - set(plan.drop)
    if left:
        raise RecoveryError(
            f"{mechanism.name}'s plan leaves dead ranks {sorted(left)} in the group"
        )
    return plan
