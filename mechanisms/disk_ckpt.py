"""Periodic synchronous checkpoints to disk; recovery rolls every rank back to the latest one."""

from __future__ import annotations

import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from architectures.base import StateLayout, Trainer
from failbench_ray.records import CheckpointEvent
from failbench_ray.spec import CHECKPOINT_WRITE
from mechanisms import MECHANISMS
from mechanisms import checkpoint_io as io
from mechanisms.base import FailureContext, Hooks, Mechanism, RecoveryPlan


class DiskCkptParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    interval: int = Field(10, ge=1, description="Save a checkpoint every this many steps.")


class DiskCkptHooks(Hooks):
    def after_step(self, step: int, trainer: Trainer) -> list[CheckpointEvent]:
        if step % self.ctx.params.interval:
            return []
        return self.save_now(step, trainer)

    def save_now(self, step: int, trainer: Trainer) -> list[CheckpointEvent]:
        ctx = self.ctx
        shard = ctx.layout.shard_of_rank[ctx.rank]
        if ctx.layout.writer_of(shard) != ctx.rank:
            return []
        path = io.shard_path(ctx.run_dir, step, shard)
        state = {"step": step, **trainer.state_dict()}
        nbytes, secs = io.save_atomic(
            state, path, on_first_write=lambda: ctx.failpoint("checkpoint_write", step)
        )
        return [CheckpointEvent(ctx.rank, step, "save", nbytes, secs, time.time(), str(path))]


@MECHANISMS.register("disk_ckpt")
class DiskCkpt(Mechanism):
    name = "disk_ckpt"
    windows = (CHECKPOINT_WRITE,)
    summary = "synchronous checkpoint to disk every K steps (temp file, fsync, rename)"
    Params = DiskCkptParams
    hooks_cls = DiskCkptHooks
    saves_on_notice = True

    def latest_checkpoint(
        self, run_dir: Path, layout: StateLayout, at_most: int | None = None
    ) -> int | None:
        return io.latest_complete(run_dir, layout.shard_ids(), at_most)

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        replace = tuple(sorted(failure.dead))
        if failure.latest_checkpoint is None:
            return RecoveryPlan(replace, "scratch", 0, "no complete checkpoint yet: step 0")
        return RecoveryPlan(
            replace,
            "checkpoint",
            failure.latest_checkpoint,
            f"every rank rolls back to the checkpoint of step {failure.latest_checkpoint}",
        )
