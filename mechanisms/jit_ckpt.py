"""Just-in-time checkpointing: no periodic cost. After a failure a survivor that holds the same
state as a dead rank writes it to disk, and the replacement loads that file."""

from __future__ import annotations

import time

from architectures.base import Trainer
from failbench_ray.identity import RankId
from failbench_ray.records import CheckpointEvent
from mechanisms import MECHANISMS
from mechanisms import checkpoint_io as io
from mechanisms.base import FromLivePeer, Hooks, RestoreInstruction


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


@MECHANISMS.register("jit_ckpt")
class JitCkpt(FromLivePeer):
    name = "jit_ckpt"
    summary = "no periodic cost; after a failure a data-parallel peer checkpoints just in time"
    hooks_cls = JitCkptHooks
    donor_kind = "jit"
    without_peer = "no data-parallel peer holds the same state to checkpoint"
