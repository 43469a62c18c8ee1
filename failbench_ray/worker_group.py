"""The worker group: one actor per rank, placed one per GPU when there are GPUs, else on CPUs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from failbench_ray.spec import ExperimentSpec
from failbench_ray.worker import WorkerActor


@dataclass(frozen=True)
class Placement:
    num_cpus: float
    num_gpus: float
    backend: str
    device: str


def choose_placement(world_size: int, resources: dict[str, float]) -> Placement:
    """One GPU per worker with NCCL when the cluster has enough GPUs, else CPU shares and gloo."""
    if resources.get("GPU", 0) >= world_size:
        return Placement(1.0, 1.0, "nccl", "cuda")
    # Fractional CPUs so that 8 ranks fit on a 2-core machine; torch threads are set per worker.
    share = math.floor(resources.get("CPU", 1.0) / world_size * 100) / 100
    return Placement(min(1.0, max(0.01, share)), 0.0, "gloo", "cpu")


class WorkerGroup:
    def __init__(
        self, spec: ExperimentSpec, run_dir: Path, chaos: Any, placement: Placement, label: str
    ) -> None:
        self._spec = spec.model_dump(mode="json")
        self._ranks = range(spec.world_size)
        self._run_dir = str(run_dir)
        self._chaos = chaos
        self.placement = placement
        self._label = label
        self.handles: dict[int, Any] = {}
        self.pids: dict[int, int] = {}
        self.incarnation: dict[int, int] = {}
        self.extra: list[Any] = []  # every actor created (spares, actors still starting)

    def start(self, ranks: list[int]) -> None:
        """Create (or re-create) the actors of `ranks` and wait until each is up."""
        self.wait_started(self.start_async(ranks))

    def start_async(self, ranks: list[int]) -> dict[int, Any]:
        """Create actors for `ranks` without waiting: rank -> (handle, ref of its ready())."""
        new = {}
        for r in ranks:
            n = self.incarnation.get(r, -1) + 1
            self.incarnation[r] = n
            # Shows on the Ray dashboard which rank (and which replacement) an actor is.
            handle = self._create(f"{self._label}-rank{r}-i{n}", r, self.placement.num_cpus)
            new[r] = (handle, handle.ready.remote())
            # Known at once, so that a shutdown while they start (Ctrl-C) kills them too.
            self.extra.append(handle)
        return new

    def wait_started(self, new: dict[int, Any]) -> None:
        """Make started actors members (`start_async`'s result), once each is up."""
        infos = ray.get([ref for _, ref in new.values()])
        for (r, (handle, _)), info in zip(new.items(), infos, strict=True):
            self.handles[r] = handle
            self.pids[r] = info["pid"]

    def start_spare(self, name: str) -> tuple[Any, Any]:
        """A hot spare: a worker with torch imported, no rank yet. (handle, ref of ready())."""
        # num_cpus=0: a spare mostly waits; on a small machine it must not block a rank.
        handle = self._create(f"{self._label}-{name}", -1, 0.0)
        self.extra.append(handle)
        return handle, handle.ready.remote()

    def adopt(self, rank: int, handle: Any, pid: int) -> None:
        """A ready spare becomes `rank`."""
        ray.get(handle.adopt.remote(rank))
        self.handles[rank] = handle
        self.pids[rank] = pid

    def _create(self, name: str, rank: int, num_cpus: float) -> Any:
        return WorkerActor.options(  # type: ignore[attr-defined]
            num_cpus=num_cpus,
            num_gpus=self.placement.num_gpus if rank >= 0 else 0,
            # The training thread, the driver's abort/progress calls, and peers' requests
            # (a parameter server serves every worker's push and pull at once; holders pull).
            max_concurrency=len(self._ranks) + 4,
            name=name,
        ).remote(rank, self._spec, self._run_dir, self._chaos)

    def targets(self) -> dict[int, tuple[int, Any]]:
        return {r: (self.pids[r], h) for r, h in self.handles.items()}

    def kill(self, ranks: list[int]) -> None:
        for r in ranks:
            h = self.handles.get(r)
            if h is not None:
                ray.kill(h, no_restart=True)

    def shutdown(self) -> None:
        self.kill(list(self.handles))
        for h in self.extra:
            ray.kill(h, no_restart=True)
        self.handles.clear()
        self.extra.clear()
