"""The worker group: one actor per rank, placed one per GPU when there are GPUs, else on CPUs.

Ranks are placed with a Ray placement group, one bundle per rank, packed on as few nodes as
possible or spread across them (`ExperimentSpec.placement`). A replacement takes its rank's
bundle again; when a node dies, Ray moves that node's bundles to the nodes left.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnschedulableError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from failbench_ray.errors import RecoveryError
from failbench_ray.pool import WorkerPool
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


_PLACEMENT_TIMEOUT_S = 120.0
_START_TIMEOUT_S = 300.0  # an actor that is not up by then will not be
_POLL_S = 0.5
_START_ATTEMPTS = 5


class WorkerGroup:
    def __init__(
        self,
        spec: ExperimentSpec,
        run_dir: Path,
        chaos: Any,
        placement: Placement,
        label: str,
        tags: dict[str, str] | None = None,
        pool: WorkerPool | None = None,
    ) -> None:
        self._spec = spec.model_dump(mode="json")
        # First ranks and spares from the pool where it serves this trial; replacements never.
        self.pool = pool if pool and pool.fits(spec.world_size, placement.num_gpus) else None
        self._strategy = spec.placement.upper()
        self._tags = dict(tags or {})
        self.pg: PlacementGroup | None = None
        self._ranks = range(spec.world_size)
        self._run_dir = str(run_dir)
        self._chaos = chaos
        self.placement = placement
        self._label = label
        self.handles: dict[int, Any] = {}
        self.pids: dict[int, int] = {}
        self.nodes: dict[int, str] = {}  # rank -> Ray node id of its current worker
        self.incarnation: dict[int, int] = {}
        self.extra: list[Any] = []  # every actor created (spares, actors still starting)
        # Pooled processes' configure() calls: one still running when the trial ends would
        # make a process the pool lends out again the old trial's rank afterwards.
        self._configuring: dict[Any, Any] = {}  # actor id -> ref of configure()
        # Raises to stop the trial (a cancel, a shutdown) while actors are being waited for.
        self.check_stop: Callable[[], None] = lambda: None

    def reserve(self) -> None:
        """Reserve one bundle per rank (the ranks' actors are created into them)."""
        bundle = {"CPU": self.placement.num_cpus}
        if self.placement.num_gpus:
            bundle["GPU"] = self.placement.num_gpus
        self.pg = placement_group(
            [dict(bundle) for _ in self._ranks], strategy=self._strategy, name=f"{self._label}-pg"
        )
        if not self.pg.wait(timeout_seconds=_PLACEMENT_TIMEOUT_S):
            raise RecoveryError(
                f"the Ray cluster cannot place {len(self._ranks)} ranks of {bundle} each "
                f"({self._strategy}) within {_PLACEMENT_TIMEOUT_S:g} s: "
                f"it has {ray.available_resources()} free; lower world_size or add nodes"
            )

    def start_first(self, ranks: list[int]) -> None:
        """The trial's first actors: pooled processes where the pool serves (each becomes
        its rank as a fresh one would), else new ones. Not timed as any recovery."""
        if self.pool is None:
            self.start(ranks)
            return
        nodes = self._bundle_nodes()
        taken = self.pool.workers([nodes.get(r, "") for r in ranks])
        new = {}
        for r, (handle, _) in zip(ranks, taken, strict=True):
            self.incarnation[r] = 0
            self.extra.append(handle)
            new[r] = (handle, self._configure(handle, r))
        died = self.wait_started(new)
        if died:  # a pooled process that died while idle: a new one takes its rank
            self.start(died)

    def _bundle_nodes(self) -> dict[int, str]:
        if self.pg is None:
            return {}
        table = ray.util.placement_group_table(self.pg)
        return {int(i): n for i, n in table.get("bundles_to_node_id", {}).items()}

    def _configure(self, handle: Any, rank: int) -> Any:
        ref = handle.configure.remote(*self._args(rank))
        self._configuring[handle._actor_id] = ref
        return ref

    def _still_configuring(self) -> set[Any]:
        """Pooled processes whose configure() has not returned (e.g. an elastic replacement
        still importing when training ended): not fit to lend again."""
        busy = self._configuring.items()
        refs = [ref for _, ref in busy]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        settled = set(done)
        return {aid for aid, ref in busy if ref not in settled}

    def _args(self, rank: int) -> tuple[Any, ...]:
        return (rank, self._spec, self._run_dir, self._chaos, self._tags)

    def start(self, ranks: list[int]) -> None:
        """Create (or re-create) the actors of `ranks` and wait until each is up.

        A new actor can die before it runs when its bundle was on a node that just failed and
        Ray has not moved the bundle yet: it is created again once the group is placed."""
        for _ in range(_START_ATTEMPTS):
            ranks = self.wait_started(self.start_async(ranks))
            if not ranks:
                return
            if self.pg is not None:
                self.pg.wait(timeout_seconds=_PLACEMENT_TIMEOUT_S)
            time.sleep(0.5)  # the node's death may not be known yet
        raise RecoveryError(f"rank(s) {ranks} died {_START_ATTEMPTS} times while starting")

    def start_async(self, ranks: list[int]) -> dict[int, Any]:
        """Create actors for `ranks` without waiting: rank -> (handle, ref of its ready())."""
        new = {}
        nodes = self._bundle_nodes() if self.pool is not None else {}
        for r in ranks:
            n = self.incarnation.get(r, -1) + 1
            self.incarnation[r] = n
            if self.pool is not None:  # a new process all the same, kept for later trials
                handle = self.pool.new_worker(nodes.get(r, ""))
                new[r] = (handle, self._configure(handle, r))
            else:
                # Shows on the Ray dashboard which rank (and which replacement) an actor is.
                handle = self._create(f"{self._label}-rank{r}-i{n}", r, self.placement.num_cpus)
                new[r] = (handle, handle.ready.remote())
            # Known at once, so that a shutdown while they start (Ctrl-C) kills them too.
            self.extra.append(handle)
        return new

    def wait_started(self, new: dict[int, Any]) -> list[int]:
        """Make started actors members (`start_async`'s result), once each is up. Returns the
        ranks whose new actor died before it was up.

        Waits in slices, calling `check_stop` between them: an actor that never comes up (its
        raylet was stopped with the service) must not hold a cancel or a shutdown."""
        refs = [ref for _, ref in new.values()]
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=_POLL_S)
            if len(done) == len(refs):
                break
            self.check_stop()
            if time.monotonic() > deadline:
                late = [r for r, (_, ref) in new.items() if ref not in done]
                raise RecoveryError(
                    f"rank(s) {late} did not start within {_START_TIMEOUT_S:g} s: is the Ray "
                    "cluster overloaded, or its node gone?"
                )
        died = []
        for r, (handle, ref) in new.items():
            try:
                info = ray.get(ref)
            except (RayActorError, ActorUnschedulableError):  # e.g. its node just died
                died.append(r)
                continue
            self.handles[r] = handle
            self.pids[r] = info["pid"]
            self.nodes[r] = info["node_id"]
        return died

    def start_spare(self, name: str) -> tuple[Any, Any]:
        """A hot spare: a worker with torch imported, no rank yet. (handle, ref of ready())."""
        if self.pool is not None:  # a standby is warm by design: a pooled process serves
            ((handle, _),) = self.pool.workers([""])
            self.extra.append(handle)
            return handle, self._configure(handle, -1)
        # num_cpus=0: a spare mostly waits; on a small machine it must not block a rank.
        handle = self._create(f"{self._label}-{name}", -1, 0.0)
        self.extra.append(handle)
        return handle, handle.ready.remote()

    def adopt(self, rank: int, handle: Any, info: dict[str, Any]) -> None:
        """A ready spare (`info`: what its ready() said) becomes `rank`."""
        ray.get(handle.adopt.remote(rank))
        self.handles[rank] = handle
        self.pids[rank] = info["pid"]
        self.nodes[rank] = info["node_id"]

    def _create(self, name: str, rank: int, num_cpus: float) -> Any:
        strategy: Any = None  # a spare: wherever Ray puts it
        if rank >= 0 and self.pg is not None:
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
        return WorkerActor.options(  # type: ignore[attr-defined]
            num_cpus=num_cpus,
            num_gpus=self.placement.num_gpus if rank >= 0 else 0,
            # The training thread, the driver's abort/progress calls, and peers' requests
            # (a parameter server serves every worker's push and pull at once; holders pull).
            max_concurrency=len(self._ranks) + 4,
            name=name,
            scheduling_strategy=strategy,
        ).remote(*self._args(rank))

    def targets(self) -> dict[int, tuple[int, Any, str]]:
        """rank -> (pid, handle, node id): what the chaos actor needs to kill a rank."""
        return {r: (self.pids[r], h, self.nodes.get(r, "")) for r, h in self.handles.items()}

    def kill(self, ranks: list[int]) -> None:
        for r in ranks:
            h = self.handles.get(r)
            if h is not None:
                ray.kill(h, no_restart=True)
                if self.pool is not None:
                    self.pool.forget(h)

    def shutdown(self, chaos: Any = None, helpers: tuple[Any, ...] = ()) -> None:
        """End the trial's actors; pooled ones (and `chaos`, and the replica holders among
        `helpers`) go back to the pool, which keeps those that reset cleanly."""
        everyone = [*self.handles.values(), *self.extra, *helpers]
        actors = list({h._actor_id: h for h in everyone}.values())
        try:
            if self.pool is not None:
                actors = self._give_back(actors, chaos, helpers)
            elif chaos is not None:
                actors.append(chaos)
        except BaseException:
            actors += [chaos] if chaos is not None else []  # the pool took none of them
            raise
        finally:
            # Whatever went wrong giving processes back, nothing of the trial outlives it: a
            # placement group left behind would hold its CPUs from every later trial.
            for h in actors:
                with contextlib.suppress(RayError):
                    ray.kill(h, no_restart=True)
            self.handles.clear()
            self.extra.clear()
            self._configuring.clear()
            if self.pg is not None:
                remove_placement_group(self.pg)
                self.pg = None

    def _give_back(self, actors: list[Any], chaos: Any, helpers: tuple[Any, ...]) -> list[Any]:
        """Give the pooled processes back; returns the actors left to end. If the pool fails,
        every actor is ended and forgotten by it."""
        assert self.pool is not None
        ours = {h._actor_id for h in [*self.handles.values(), *self.extra]}
        busy = self._still_configuring()
        for h in actors:
            if h._actor_id in busy:
                self.pool.forget(h)  # ended by the caller, with the actors not pooled
        holders = tuple(h for h in helpers if h._actor_id not in ours)
        workers = [h for h in actors if self.pool.owns(h) and h._actor_id in ours]
        try:
            self.pool.give_back(workers, chaos, holders)
        except BaseException:
            for h in [*actors, *([chaos] if chaos is not None else [])]:
                self.pool.forget(h)
            raise
        return [h for h in actors if not self.pool.owns(h)]
