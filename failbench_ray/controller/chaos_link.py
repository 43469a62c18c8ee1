"""The driver's side of the chaos actor: where it lives, whom it may kill, when it fires."""

from __future__ import annotations

import contextlib
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from failbench_ray.errors import RecoveryError
from failbench_ray.pool import WorkerPool
from failbench_ray.spec import FailureEvent
from injector.chaos import ChaosActor, Injection
from injector.kill_kinds import KILL_KINDS


def head_node_id() -> str:
    """The Ray head node (it carries Ray's `node:__internal_head__` resource)."""
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return str(node["NodeID"])
    return ""


class ChaosLink:
    def __init__(self, events: list[FailureEvent], label: str, pool: WorkerPool | None) -> None:
        self.events = events
        self.label, self.pool = label, pool
        self.actor: Any = None
        # Whether a kind of the trace gives notice first (only then is it asked each beat).
        self.has_notices = any(KILL_KINDS.get(e.kill).notice_s is not None for e in events)

    def start(self) -> Any:
        """On the head node, which a node kill never takes (see `set_targets`), so the
        injector outlives its victims. (Not "the driver's node": a driver on a multi-node
        host may be attached to another raylet.) Hard affinity: a soft one put it on a worker
        node when the head had no CPUs."""
        home = head_node_id() or ray.get_runtime_context().get_node_id()
        events = [e.model_dump() for e in self.events]
        if self.pool is not None:
            self.actor = self.pool.chaos(events, home)
        else:
            self.actor = ChaosActor.options(  # type: ignore[attr-defined]
                name=f"{self.label}-chaos",
                scheduling_strategy=NodeAffinitySchedulingStrategy(home, soft=False),
            ).remote(events)
        return self.actor

    def go(self) -> None:
        """Timers start now (training starts)."""
        ray.get(self.actor.start.remote())

    def stop(self) -> None:
        """The trial ends: timers cancelled, throttled ranks resumed (before the processes are
        ended or given back to the pool, so none is left stopped)."""
        if self.actor is not None:
            with contextlib.suppress(RayError):
                ray.get(self.actor.stop.remote(), timeout=30)

    def fired(self) -> set[int]:
        return set(ray.get(self.actor.fired.remote()))

    def injections(self) -> list[Injection]:
        return list(ray.get(self.actor.injections.remote()))

    def noticed(self) -> dict[int, tuple[list[int], float]]:
        """Notices given whose failure has not struck yet: index -> (ranks, when it strikes)."""
        return dict(ray.get(self.actor.noticed.remote()))

    def armed(self, rank: int, fired: set[int]) -> dict[tuple[str, int], int]:
        """The failpoints `rank` must stop at (event index by (where, step))."""
        armed = {}
        for i, e in enumerate(self.events):
            point = e.worker_point
            if point is not None and rank in e.ranks and i not in fired:
                armed[point] = i
        return armed

    def on_phase(self, phase: str, committed: int) -> None:
        """Let a cascading failure fire as this recovery phase starts."""
        ray.get(self.actor.on_phase.remote(phase, committed))

    def set_targets(self, targets: dict[int, tuple[int, Any, str]]) -> None:
        """Tell the chaos actor the current worker of each rank. A node kill must never take
        the head node: the driver and the cluster's control plane live there."""
        fired = self.fired()
        node_ranks = {
            r
            for i, e in enumerate(self.events)
            if e.kill == "node" and i not in fired
            for r in e.ranks
        }
        head = head_node_id() if node_ranks else ""
        on_head = sorted(r for r in node_ranks if targets[r][2] == head)
        if on_head:
            raise RecoveryError(
                f"a node kill targets rank(s) {on_head}, which run on the Ray head node; node "
                f"kills need ranks on worker nodes: start the head with num_cpus=0 (and no "
                f"GPUs) so no rank is placed there, or name other ranks"
            )
        ray.get(self.actor.set_targets.remote(targets))
