"""Just-in-time checkpointing: no periodic cost. After a failure a survivor that holds the same
state as a dead rank writes it to disk, and the replacement loads that file. On a preemption
notice every rank saves the same step in time (`save_now`): where no survivor holds a dead
rank's state (every holder of a shard was preempted), every rank rolls back to that save
instead of to step 0."""

from __future__ import annotations

import time
from pathlib import Path

from architectures.base import StateLayout, Trainer
from failbench_ray.identity import RankId
from failbench_ray.records import CheckpointEvent
from mechanisms import MECHANISMS
from mechanisms import checkpoint_io as io
from mechanisms.base import (
    FailureContext,
    FromLivePeer,
    Hooks,
    RecoveryPlan,
    RestoreInstruction,
    live_plan,
    rollback_plan,
)
from mechanisms.disk_ckpt import DiskCkptHooks


class JitCkptHooks(Hooks):
    def donate(self, instruction: RestoreInstruction, trainer: Trainer) -> list[CheckpointEvent]:
        """The survivor the plan names writes its shard for the ranks that restore it."""
        ctx, step = self.ctx, instruction.step
        shard = ctx.layout.shard_of_rank[ctx.rank]
        donor = instruction.donors.get(shard)
        if donor is None or donor[1] != "jit" or donor[0] != RankId(ctx.rank):
            return []
        path = io.jit_path(ctx.run_dir, step, shard)
        nbytes, secs = io.save_atomic(trainer.state_dict(), path)
        return [CheckpointEvent(ctx.rank, step, "save", nbytes, secs, time.time(), str(path))]

    # On a notice: the shard's writer saves it as a disk checkpoint does (the step it was asked).
    save_now = DiskCkptHooks.save_now


@MECHANISMS.register("jit_ckpt")
class JitCkpt(FromLivePeer):
    name = "jit_ckpt"
    summary = "no periodic cost; after a failure a data-parallel peer checkpoints just in time"
    hooks_cls = JitCkptHooks
    donor_kind = "jit"
    without_peer = "no data-parallel peer holds the same state to checkpoint"
    saves_on_notice = True

    def latest_checkpoint(
        self, run_dir: Path, layout: StateLayout, at_most: int | None = None
    ) -> int | None:
        return io.latest_complete(run_dir, layout.shard_ids(), at_most)  # saved on a notice

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        replace = tuple(sorted(failure.dead))
        plan = live_plan(failure, replace, self.donor_kind)
        if plan is not None:
            return plan
        return rollback_plan(failure, replace, "no survivor holds a dead rank's state: ")
