"""The standby actors a mechanism asks for: replica holders (copies of ranks' state in the
object store) and hot spares (started workers waiting to take a dead rank's place)."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayActorError

from failbench_ray.identity import ActorId, HolderId, SpareId
from failbench_ray.pool import WorkerPool
from failbench_ray.worker_group import WorkerGroup
from mechanisms.base import Mechanism, RecoveryPlan


class Standby:
    def __init__(self, mech: Mechanism, label: str, pool: WorkerPool | None) -> None:
        self.mech, self.label, self.pool = mech, label, pool
        # Replica holders and ready hot spares (which wait among them): the workers' replica
        # targets.
        self.holders: dict[ActorId, Any] = {}
        self.spare_info: dict[SpareId, dict[str, Any]] = {}  # what each spare's ready() said
        self.starting: dict[SpareId, tuple[Any, Any]] = {}  # spare -> (handle, ready ref)
        self.adopted: dict[ActorId, Any] = {}  # spares that took a rank
        self._spares_made = 0

    def start(self, group: WorkerGroup) -> None:
        """Start the holders (and wait for them) and the spares (in the background)."""
        actor = self.mech.holder_actor
        if self.mech.holder_actors and actor is None:
            raise TypeError(f"mechanism {self.mech.name} wants holders but names no holder_actor")
        for i in range(self.mech.holder_actors):
            holder = HolderId(i)
            if self.pool is not None:
                self.holders[holder] = self.pool.holder(actor)
                continue
            self.holders[holder] = actor.options(
                name=f"{self.label}-{holder}", scheduling_strategy="SPREAD"
            ).remote()
        ray.get([h.ready.remote() for h in self.holders.values()])
        for _ in range(self.mech.spare_actors):
            self._start_spare(group)

    def _start_spare(self, group: WorkerGroup) -> None:
        spare = SpareId(self._spares_made)
        self._spares_made += 1
        self.starting[spare] = group.start_spare(str(spare))

    def spares_ready(self, *, wait: bool) -> bool:
        """Move spares that finished starting into the holders. True if any did."""
        moved = False
        for spare, (handle, ref) in list(self.starting.items()):
            done, _ = ray.wait([ref], timeout=None if wait else 0)
            if not done:
                continue
            del self.starting[spare]
            try:
                self.spare_info[spare] = ray.get(ref)
            except RayActorError:
                continue
            self.holders[spare] = handle
            moved = True
        return moved

    def spares(self) -> tuple[SpareId, ...]:
        """The ready hot spares."""
        return tuple(n for n in self.holders if isinstance(n, SpareId))

    def take_ranks(self, plan: RecoveryPlan, group: WorkerGroup) -> None:
        """Hot spares take their ranks at once; a new spare comes up in the background for
        each."""
        for r, spare in plan.spares.items():
            handle = self.holders.pop(spare)
            self.adopted[spare] = handle  # still a donor of its mirror in this restore
            group.adopt(r, handle, self.spare_info.pop(spare))
            self._start_spare(group)

    def tell(self, group: WorkerGroup, members: list[int], dead: set[int]) -> None:
        """Workers learn of a new holder (a spare came up) without stopping."""
        for r, h in group.handles.items():
            if r not in dead:
                h.set_holders.remote(self.holders, tuple(members))

    def release(self) -> tuple[Any, ...]:
        """The standby actors, to end or give back with the trial's workers."""
        helpers = tuple(self.holders.values())
        self.holders.clear()
        return helpers
