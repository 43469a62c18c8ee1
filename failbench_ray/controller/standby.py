"""The standby actors a mechanism asks for: replica holders (copies of ranks' state in the
object store) and hot spares (started workers waiting to take a dead rank's place)."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayActorError

from failbench_ray.pool import WorkerPool
from failbench_ray.worker_group import WorkerGroup
from mechanisms.base import Mechanism, RecoveryPlan
from mechanisms.replication import ReplicaHolderActor


class Standby:
    def __init__(self, mech: Mechanism, label: str, pool: WorkerPool | None) -> None:
        self.mech, self.label, self.pool = mech, label, pool
        # Replica holders and ready hot spares (which wait among them), by name: the workers'
        # replica targets.
        self.holders: dict[str, Any] = {}
        self.spare_info: dict[str, dict[str, Any]] = {}  # what each ready spare's ready() said
        self.starting: dict[str, tuple[Any, Any]] = {}  # spare name -> (handle, ready ref)
        self.adopted: dict[str, Any] = {}  # spares that took a rank, by their spare name
        self._spares_made = 0

    def start(self, group: WorkerGroup) -> None:
        """Start the holders (and wait for them) and the spares (in the background)."""
        for i in range(self.mech.holder_actors):
            name = f"holder{i}"
            if self.pool is not None:
                self.holders[name] = self.pool.holder()
                continue
            self.holders[name] = ReplicaHolderActor.options(  # type: ignore[attr-defined]
                name=f"{self.label}-{name}", scheduling_strategy="SPREAD"
            ).remote()
        ray.get([h.ready.remote() for h in self.holders.values()])
        for _ in range(self.mech.spare_actors):
            self._start_spare(group)

    def _start_spare(self, group: WorkerGroup) -> None:
        name = f"spare{self._spares_made}"
        self._spares_made += 1
        self.starting[name] = group.start_spare(name)

    def spares_ready(self, *, wait: bool) -> bool:
        """Move spares that finished starting into the holders. True if any did."""
        moved = False
        for name, (handle, ref) in list(self.starting.items()):
            done, _ = ray.wait([ref], timeout=None if wait else 0)
            if not done:
                continue
            del self.starting[name]
            try:
                self.spare_info[name] = ray.get(ref)
            except RayActorError:
                continue
            self.holders[name] = handle
            moved = True
        return moved

    def spares(self) -> tuple[str, ...]:
        """The ready hot spares, by name."""
        return tuple(n for n in self.holders if n.startswith("spare"))

    def take_ranks(self, plan: RecoveryPlan, group: WorkerGroup) -> None:
        """Hot spares take their ranks at once; a new spare comes up in the background for
        each."""
        for r, name in plan.spares.items():
            handle = self.holders.pop(name)
            self.adopted[name] = handle  # still a donor of its mirror in this restore
            group.adopt(r, handle, self.spare_info.pop(name))
            self._start_spare(group)

    def tell(self, group: WorkerGroup, members: list[int], dead: set[int]) -> None:
        """Workers learn of a new holder (a spare came up) without stopping."""
        for r, h in group.handles.items():
            if r not in dead:
                h.set_holders.remote(self.holders, tuple(members))

    def truncate(self, step: int) -> None:
        """Copies after `step` are stale once every rank is back at `step`."""
        for h in self.holders.values():
            h.truncate.remote(step)

    def release(self) -> tuple[Any, ...]:
        """The standby actors, to end or give back with the trial's workers."""
        helpers = tuple(self.holders.values())
        self.holders.clear()
        return helpers
