"""In-memory replication (Gemini): every K steps each shard's state is copied into other
processes' memory through the Ray object store; after a failure every rank rolls back to the
newest step whose copies all survived, else to the last disk checkpoint."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from architectures.base import Architecture, StateLayout, Trainer
from failbench_ray.identity import ActorId, HolderId, RankId
from failbench_ray.records import CheckpointEvent
from failbench_ray.replication import ReplicaHolderActor, truncate_copies
from failbench_ray.spec import REPLICA_TRANSFER, ExperimentSpec
from mechanisms import MECHANISMS
from mechanisms import checkpoint_io as io
from mechanisms.base import (
    FailureContext,
    Hooks,
    Mechanism,
    RecoveryPlan,
    copy_steps,
    newest_restorable,
    rollback_plan,
)


class InmemReplicaParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    interval: int = Field(5, ge=1, description="Replicate every this many steps.")
    replicas: int = Field(1, ge=1, description="Copies of each shard (replication factor).")
    placement: Literal["holders", "peers"] = Field(
        "holders",
        description="holders: dedicated holder actors (spread over nodes); peers: the next "
        "ranks in ring order hold the copies (a copy dies with its holder).",
    )
    disk_interval: int = Field(
        20, ge=0, description="Also checkpoint to disk every this many steps (0: never)."
    )


class InmemReplicaHooks(Hooks):
    def after_step(self, step: int, trainer: Trainer) -> list[CheckpointEvent]:
        ctx, p = self.ctx, self.ctx.params
        events: list[CheckpointEvent] = []
        if step % p.interval == 0:
            nbytes, secs, copies = ctx.publish(step, trainer)
            if copies:
                events.append(
                    CheckpointEvent(
                        ctx.rank,
                        step,
                        "replicate",
                        nbytes * copies,
                        secs,
                        time.time(),
                        f"{copies} cop{'y' if copies == 1 else 'ies'}",
                    )
                )
        shard = ctx.layout.shard_of_rank[ctx.rank]
        writer = ctx.layout.writer_of(shard) == ctx.rank
        if p.disk_interval and step % p.disk_interval == 0 and writer:
            path = io.shard_path(ctx.run_dir, step, shard)
            nbytes, secs = io.save_atomic({"step": step, **trainer.state_dict()}, path)
            events.append(
                CheckpointEvent(ctx.rank, step, "save", nbytes, secs, time.time(), str(path))
            )
        return events


@MECHANISMS.register("inmem_replica")
class InmemReplica(Mechanism):
    name = "inmem_replica"
    windows = (REPLICA_TRANSFER,)
    summary = "copies of each shard in other processes' memory via the Ray object store (Gemini)"
    Params = InmemReplicaParams
    hooks_cls = InmemReplicaHooks

    def __init__(self, spec: ExperimentSpec, params: BaseModel) -> None:
        super().__init__(spec, params)
        assert isinstance(params, InmemReplicaParams)
        self.p = params
        self.holder_actors = params.replicas if params.placement == "holders" else 0

    holder_actor = ReplicaHolderActor

    def not_applicable(self, arch: Architecture) -> str | None:
        if self.p.placement == "peers" and self.spec.world_size <= self.p.replicas:
            return (
                f"placement peers needs more ranks than replicas={self.p.replicas} "
                f"(world_size={self.spec.world_size}); lower replicas or use placement holders"
            )
        return None

    def replica_targets(
        self, rank: int, layout: StateLayout, members: tuple[int, ...], holders: list[ActorId]
    ) -> list[ActorId]:
        if layout.writer_of(layout.shard_of_rank[rank]) != rank:
            return []  # one copy per shard: its lowest rank publishes
        if self.p.placement == "holders":
            return [HolderId(i) for i in range(self.p.replicas)]
        ring = list(members)
        at = ring.index(rank)
        return [RankId(ring[(at + k) % len(ring)]) for k in range(1, self.p.replicas + 1)]

    def latest_checkpoint(
        self, run_dir: Path, layout: StateLayout, at_most: int | None = None
    ) -> int | None:
        if not self.p.disk_interval:
            return None
        return io.latest_complete(run_dir, layout.shard_ids(), at_most)

    def after_recovery(self, standbys: dict[ActorId, Any], step: int) -> None:
        truncate_copies(standbys.values(), step)

    def plan(self, failure: FailureContext) -> RecoveryPlan:
        replace = tuple(sorted(failure.dead))
        steps = copy_steps(failure)
        if failure.survivor_steps:  # never "roll back" past where the survivors got
            steps = {s for s in steps if s <= failure.furthest_step}
        found = newest_restorable(failure, steps, peers=False)
        if found is not None:
            step, keep, donors = found
            note = f"every rank rolls back to the in-memory copies of step {step}"
            return RecoveryPlan(replace, "replica", step, note, keep=keep, donors=donors)
        lost = [s for s in failure.layout.shard_ids() if not failure.replicas.get(s)]
        why = (
            f"in-memory copies of shard(s) {lost} died with their holders: falls back to disk; "
            if lost
            else "no step with a copy of every shard: falls back to disk; "
        )
        return rollback_plan(failure, replace, why)
