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

    def start(self, ranks: list[int]) -> None:
        """Create (or re-create) the actors of `ranks` and wait until each is up."""
        new = {}
        for r in ranks:
            n = self.incarnation.get(r, -1) + 1
            self.incarnation[r] = n
            new[r] = WorkerActor.options(  # type: ignore[attr-defined]
                num_cpus=self.placement.num_cpus,
                num_gpus=self.placement.num_gpus,
                # The training thread, the driver's abort/progress calls, and peers' requests
                # (a parameter server serves every worker's push and pull at once).
                max_concurrency=len(self._ranks) + 2,
                # Shows on the Ray dashboard which rank (and which replacement) an actor is.
                name=f"{self._label}-rank{r}-i{n}",
            ).remote(r, self._spec, self._run_dir, self._chaos)
            # Known at once, so that a shutdown while they start (Ctrl-C) kills them too.
            self.handles[r] = new[r]
        infos = ray.get([h.ready.remote() for h in new.values()])
        for r, info in zip(new, infos, strict=True):
            self.pids[r] = info["pid"]

    def targets(self) -> dict[int, tuple[int, Any]]:
        return {r: (self.pids[r], h) for r, h in self.handles.items()}

    def kill(self, ranks: list[int]) -> None:
        for r in ranks:
            h = self.handles.get(r)
            if h is not None:
                ray.kill(h, no_restart=True)

    def shutdown(self) -> None:
        self.kill(list(self.handles))
        self.handles.clear()
