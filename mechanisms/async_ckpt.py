"""Asynchronous checkpoints (CheckFreq): snapshot in memory at a step boundary, persist in the
background. A checkpoint counts only once its file is durable (fsynced and renamed), so a
failure while persisting rolls back to the previous complete one."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from architectures.base import StateLayout, Trainer
from failbench_ray.records import CheckpointEvent
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


def _copy_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copy_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_copy_tensors(v) for v in obj)
    return obj


class AsyncCkptHooks(Hooks):
    def __init__(self, ctx: HookContext) -> None:
        super().__init__(ctx)
        self._persisting: threading.Thread | None = None

    def after_step(self, step: int, trainer: Trainer) -> list[CheckpointEvent]:
        ctx = self.ctx
        shard = ctx.layout.shard_of_rank[ctx.rank]
        if step % ctx.params.interval or ctx.layout.writer_of(shard) != ctx.rank:
            return []
        self._wait()  # at most one snapshot in flight (CheckFreq): memory stays bounded
        t0 = time.perf_counter()
        state = trainer.state_dict()
        # The model part is already a copy; the optimizer's tensors are live references that
        # the next steps would change under the writer.
        snapshot = {"step": step, "model": state["model"]}
        snapshot |= {k: _copy_tensors(v) for k, v in state.items() if k != "model"}
        snap_s = time.perf_counter() - t0
        path = io.shard_path(ctx.run_dir, step, shard)
        self._persisting = threading.Thread(
            target=self._persist, args=(snapshot, path, step, snap_s), daemon=True
        )
        self._persisting.start()
        return []

    def _persist(self, state: dict[str, Any], path: Path, step: int, snap_s: float) -> None:
        ctx = self.ctx
        nbytes, secs = io.save_atomic(
            state, path, on_first_write=lambda: ctx.failpoint("checkpoint_write", step)
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
    summary = "snapshot in memory every K steps, persist in the background (CheckFreq)"
    Params = AsyncCkptParams
    hooks_cls = AsyncCkptHooks

    def latest_checkpoint(self, run_dir: Path, layout: StateLayout) -> int | None:
        return io.latest_complete(run_dir, layout.shard_ids())

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        return rollback_plan(failure, tuple(sorted(failure.dead)), "")
