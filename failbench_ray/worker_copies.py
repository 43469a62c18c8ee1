"""The object-store side of a worker: the copies of other ranks' state it holds, and the
snapshots of its own that others pull (the `Worker` actor mixes this in).

A rank's copies go where its mechanism's `replica_targets` says: dedicated holders, hot spares
or peer ranks (`inmem_replica` with `placement: peers`, `redundant`), so every worker can hold
copies. The backend itself is `failbench_ray/replication.py`.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from architectures.base import StateLayout, Trainer
from failbench_ray.identity import ActorId, RankId
from failbench_ray.replication import Packed, ReplicaStore, pack
from failbench_ray.spec import REPLICA_TRANSFER, ExperimentSpec
from mechanisms.base import Mechanism

_OWN_SNAPSHOTS = 2  # snapshots of its own state a rank keeps (to roll back one interval)


class HoldsCopies:
    # Set by the worker (`Worker.configure`, `Worker.join`).
    rank: int
    step: int
    spec: ExperimentSpec
    mech: Mechanism
    layout: StateLayout
    trainer: Trainer | None
    me: Any  # this actor's own handle (holders call back on it)
    replicas: ReplicaStore  # copies of other ranks' state this process owns
    snapshots: dict[int, Packed]  # this rank's own, by step
    holders: dict[ActorId, Any]
    targets: list[Any]  # who pulls this rank's snapshots
    holder_lost: str | None
    _peers: dict[int, Any]
    _failpoint: Any  # `TakesFaults._failpoint`

    @ray.method(concurrency_group="pull")
    def pull(self, shard: int, step: int, source: Any) -> bool:
        return self.replicas.pull(shard, step, source)

    @ray.method(concurrency_group="serve")
    def replica_ref(self, shard: int, step: int) -> list[Any]:
        return self.replicas.ref(shard, step)

    def inventory(self) -> dict[str, Any]:
        """Copies this process holds, its own snapshots and its last completed step."""
        return {
            "copies": self.replicas.inventory(),
            "own": sorted(self.snapshots),
            "step": self.step,
        }

    def truncate(self, step: int) -> None:
        """Forget held copies newer than `step` (a hot spare, after a rollback)."""
        self.replicas.truncate(step)

    @ray.method(concurrency_group="serve")
    def snapshot_for(self, step: int) -> Packed:
        """This rank's snapshot of `step` (a holder pulls it, and so owns the copy)."""
        self._failpoint(REPLICA_TRANSFER, step)  # a failure while the copy is in flight
        return self.snapshots[step]

    @ray.method(concurrency_group="serve")
    def live_state(self) -> tuple[Packed, int]:
        """This rank's current state and its step (a replacement heals from it)."""
        assert self.trainer is not None
        return pack(self.trainer.state_dict()), self.step

    def set_holders(self, holders: dict[ActorId, Any], members: tuple[int, ...]) -> None:
        """Learn the current replica holders (e.g. a hot spare that just came up)."""
        self.holders = dict(holders)
        ids = [RankId(r) for r in members if r != self.rank] + list(holders)
        wanted = self.mech.replica_targets(self.rank, self.layout, members, ids)
        peers: dict[ActorId, Any] = {RankId(r): h for r, h in self._peers.items()}
        self.targets = [self.holders.get(n) or peers[n] for n in wanted]

    def _publish(self, step: int, trainer: Trainer, wait: bool = False) -> tuple[int, float, int]:
        """Snapshot at the step boundary; the targets pull it in the background, or (`wait`)
        before the step counts as done, so their copy is never behind this rank."""
        t0 = time.perf_counter()
        packed = pack(trainer.state_dict())
        self.snapshots[step] = packed
        for old in sorted(self.snapshots)[:-_OWN_SNAPSHOTS]:
            del self.snapshots[old]
        shard = self.layout.shard_of_rank[self.rank]
        pulls = [target.pull.remote(shard, step, self.me) for target in self.targets]
        if wait:
            try:
                # As long as a collective may take: a holder that neither answers nor dies
                # must not hold this rank, and its peers, forever.
                ray.get(pulls, timeout=self.spec.pg_timeout_s)
            except (RayActorError, GetTimeoutError) as err:
                # The step is done here but its copy is held nowhere: stop after it and let
                # the driver, which sees the holder's death, decide. (Raising would make this
                # live rank look dead to the driver.)
                self.holder_lost = f"a holder of this rank's copy failed: {type(err).__name__}"
                if not isinstance(err, RayActorError):
                    self.holder_lost += f" ({err})"
                return packed.nbytes, time.perf_counter() - t0, 0
        return packed.nbytes, time.perf_counter() - t0, len(self.targets)
