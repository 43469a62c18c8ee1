"""Where a rank's state comes from at recovery: the generic half of every mechanism's restore.

The plan (driver side) names a source and, per shard, a donor; here (worker side) a rank that
does not keep its own state loads its shard from it, and times what it moved.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray

from architectures.base import Trainer
from failbench_ray.errors import RecoveryError
from failbench_ray.records import CheckpointEvent
from failbench_ray.replication import Packed, fetch, unpack
from mechanisms import checkpoint_io as io

if TYPE_CHECKING:  # base calls `load` as every mechanism's default restore
    from mechanisms.base import HookContext, RestoreInstruction


def load(
    instruction: RestoreInstruction,
    ctx: HookContext,
    trainer: Trainer,
    *,
    local: Packed | None = None,
) -> list[CheckpointEvent]:
    """Load this rank's shard at `instruction.step` into `trainer`.

    `local` is this process's own copy of the shard at that step (a survivor's snapshot, or
    a hot spare's mirror): used before anything is moved.
    """
    if instruction.source == "scratch":
        return []
    shard = ctx.layout.shard_of_rank[ctx.rank]
    step = instruction.step
    t0 = time.perf_counter()
    where: str
    if local is not None:
        trainer.load_state_dict(unpack(local))
        nbytes, where = local.nbytes, "local copy"
    elif instruction.source == "checkpoint":
        state, nbytes, _ = io.load(io.shard_path(ctx.run_dir, step, shard))
        trainer.load_state_dict(state)
        where = str(io.shard_path(ctx.run_dir, step, shard))
    else:
        if shard not in instruction.donors:
            raise RecoveryError(f"no donor for shard {shard} at step {step}")
        name, kind, handle = instruction.donors[shard]
        if kind == "jit":
            path = io.jit_path(ctx.run_dir, step, shard)
            state, nbytes, _ = io.load(path)
            trainer.load_state_dict(state)
            where = f"{name}: {path}"
        else:
            packed = fetch(handle, shard, step) if kind == "replica" else _live(handle, step)
            trainer.load_state_dict(unpack(packed))
            nbytes, where = packed.nbytes, f"{kind} from {name}"
    secs = time.perf_counter() - t0
    return [CheckpointEvent(ctx.rank, step, "restore", nbytes, secs, time.time(), where)]


def _live(handle: Any, step: int) -> Packed:
    packed, at = ray.get(handle.live_state.remote())
    if at != step:
        raise RecoveryError(f"the live peer is at step {at}, the plan expected step {step}")
    result: Packed = packed
    return result
