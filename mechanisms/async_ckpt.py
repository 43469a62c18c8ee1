"""Asynchronous checkpoints (CheckFreq): snapshot in memory at a step boundary, persist in the
background. A checkpoint counts only once its file is durable (fsynced and renamed), so a
failure while persisting rolls back to the previous complete one."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from architectures.base import StateLayout, Trainer
from failbench_ray.records import CheckpointEvent
from failbench_ray.replication import Packed, pack
from failbench_ray.spec import CHECKPOINT_WRITE
from mechanisms import MECHANISMS
from mechanisms import checkpoint_io as io
from mechanisms.base import (
    FailureContext,
    HookContext,
    Hooks,
    Mechanism,
    RecoveryPlan,
    rollback_plan,
)


class AsyncCkptParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    interval: int = Field(10, ge=1, description="Snapshot and persist every this many steps.")


def _lower_priority() -> None:
    """Run the calling thread at the lowest CPU priority: on a busy machine the write then takes
    idle cycles (ranks waiting in a collective) instead of slowing the training threads, which
    in synchronous training slows every rank. (Linux: a nice value is per thread.)"""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class AsyncCkptHooks(Hooks):
    def __init__(self, ctx: HookContext) -> None:
        super().__init__(ctx)
        self._persisting: threading.Thread | None = None
        self._last: Packed | None = None

    def after_step(self, step: int, trainer: Trainer) -> list[CheckpointEvent]:
        if step % self.ctx.params.interval:
            return []
        return self.save_now(step, trainer)

    def save_now(self, step: int, trainer: Trainer) -> list[CheckpointEvent]:
        ctx = self.ctx
        shard = ctx.layout.shard_of_rank[ctx.rank]
        if ctx.layout.writer_of(shard) != ctx.rank:
            return []
        self._wait()  # at most one snapshot in flight (CheckFreq): memory stays bounded
        t0 = time.perf_counter()
        # One copy of the whole state into a flat buffer: the optimizer's tensors are live
        # references that the next steps would change under the writer.
        snapshot = pack({"step": step, **trainer.state_dict()}, reuse=self._last)
        self._last = snapshot  # written by then: the next snapshot refills its buffer
        snap_s = time.perf_counter() - t0
        path = io.shard_path(ctx.run_dir, step, shard)
        self._persisting = threading.Thread(
            target=self._persist, args=(snapshot, path, step, snap_s), daemon=True
        )
        self._persisting.start()
        return []

    def _persist(self, snapshot: Packed, path: Path, step: int, snap_s: float) -> None:
        ctx = self.ctx
        _lower_priority()
        nbytes, secs = io.save_packed_atomic(
            snapshot, path, on_first_write=lambda: ctx.failpoint("checkpoint_write", step)
        )
        # Reported only now that it is durable; duration = snapshot + write + fsync.
        ctx.emit(
            CheckpointEvent(ctx.rank, step, "save", nbytes, snap_s + secs, time.time(), str(path))
        )

    def _wait(self) -> None:
        if self._persisting is not None:
            self._persisting.join()
            self._persisting = None

    def close(self) -> None:
        self._wait()


@MECHANISMS.register("async_ckpt")
class AsyncCkpt(Mechanism):
    name = "async_ckpt"
    windows = (CHECKPOINT_WRITE,)
    summary = "snapshot in memory every K steps, persist in the background (CheckFreq)"
    Params = AsyncCkptParams
    hooks_cls = AsyncCkptHooks
    saves_on_notice = True

    def latest_checkpoint(
        self, run_dir: Path, layout: StateLayout, at_most: int | None = None
    ) -> int | None:
        return io.latest_complete(run_dir, layout.shard_ids(), at_most)

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        return rollback_plan(failure, tuple(sorted(failure.dead)), "")
