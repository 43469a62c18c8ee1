"""A pool of started worker processes that trial after trial reuse (what a sweep mostly paid
for was starting processes and importing torch, not training).

What is reused, and what never is:
- A trial's first ranks and hot spares come from the pool: processes with torch imported and
  no state. `Worker.configure` makes each one its rank as a fresh process would be (random
  state, threads, trainer, files); `Worker.reset` sheds the trial and says whether it could.
  A thread parked in a collective on a dead peer is freed by nothing but that group's
  timeout: such a process is parked until then and reset again, or ended if that is far.
- A replacement for a dead rank is always a new, cold process (a fresh interpreter that
  imports torch inside the measured recovery): it is never taken from the idle ones. It is
  made by the pool, though, so that it serves later trials once this one is over.
- The chaos actor is pooled too; it is re-armed with each trial's events.

Pooled processes ask Ray for no CPU (`num_cpus=0`): the trial's placement group still reserves
a bundle per rank, and a pooled process runs on the node of the bundle it serves, so placement
and reservation are the trial's, as with fresh actors. GPU ranks are never pooled (Ray binds a
GPU to an actor when it starts).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger("failbench.pool")

# Threads of a pooled worker's default group: the training thread, the driver's calls and one
# per peer (a parameter server serves every worker at once). Trials with more ranks than this
# allows start fresh actors sized for them.
POOL_CONCURRENCY = 36
_MAX_IDLE = 16  # idle processes kept; more are ended (each holds a few hundred MB)
_RESET_TIMEOUT_S = 10.0  # a reset takes well under a second
# A process parked on a dead peer is kept for another trial if its collective times out
# within this (the paper matrix's 60 s pg_timeout_s does; torch's 30 min default does not).
_MAX_PARK_S = 180.0
# A collective parked on a live peer ends as soon as that peer closes the old group's sockets,
# which its own reset does: after a round that reset some workers, the parked ones are tried
# again before they wait for their timeout.
_RESET_ROUNDS = 3
_RESET_ROUND_GAP_S = 0.2


def process_resources(pid: int) -> dict[str, int]:
    """Resident memory (bytes), threads and open files of a Linux process, from /proc."""
    fields = {}
    for line in open(f"/proc/{pid}/status").read().splitlines():  # noqa: SIM115
        key, _, value = line.partition(":")
        fields[key] = value.split()
    return {
        "pid": pid,
        "rss_bytes": int(fields["VmRSS"][0]) * 1024,
        "threads": int(fields["Threads"][0]),
        "open_files": len(os.listdir(f"/proc/{pid}/fd")),
    }


@dataclass(frozen=True)
class ResetOutcome:
    """What `Worker.reset` says: None, reset and reusable; else why not, and (a collective
    parked on a dead peer) in how many seconds its timeout will have freed the thread."""

    reason: str | None
    retry_in_s: float | None = None


@dataclass(frozen=True)
class PoolStats:
    """What the pool did so far (a sweep reports it)."""

    started: int  # processes the pool started
    reused: int  # times an idle process served another trial
    ended: int  # processes let go: dead, not resettable, or more than the pool keeps
    idle: int
    parked: int  # waiting for a stale collective's timeout before they are reset again


class WorkerPool:
    """Idle worker processes by Ray node, plus one idle chaos actor. Thread-safe: several
    dispatcher threads take from and give back to one pool."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[str, list[Any]] = defaultdict(list)  # node id -> idle workers
        self._chaos: list[Any] = []
        self._holders: list[Any] = []  # idle standby actors of mechanisms (replica holders)
        self._holder_class: dict[Any, Any] = {}  # their Ray actor classes, by actor id
        self._parked: list[tuple[float, str, Any]] = []  # (retry at, node, worker)
        self._mine: set[Any] = set()  # actor ids of every live process the pool made
        # Workers lent to trials now, and the most ever lent at once: the pool keeps no more
        # idle than that (a working set, not every process a sweep ever started).
        self._lent: set[Any] = set()
        self._high = 0
        self._names = itertools.count()
        self._prefix = f"fb-pool-{os.getpid()}"
        self.started = self.reused = self.ended = 0
        self.closing = False  # set: the driver is stopping, nothing given back is kept

    def fits(self, world_size: int, num_gpus: float) -> bool:
        return num_gpus == 0 and world_size + 4 <= POOL_CONCURRENCY

    def owns(self, handle: Any) -> bool:
        return handle._actor_id in self._mine

    # -- taking ----------------------------------------------------------------------------
    def workers(self, nodes: list[str]) -> list[tuple[Any, bool]]:
        """A worker process on each of `nodes` (in order): (handle, reused). An idle one
        where there is one, else a new one (not waited for: its first call waits)."""
        self._revive()
        out = []
        with self._lock:
            for node in nodes:
                if self._idle[node]:
                    out.append((self._idle[node].pop(), True))
                    self.reused += 1
                else:
                    out.append((self._new_worker(node), False))
                self._lend(out[-1][0])
        return out

    def _lend(self, handle: Any) -> None:
        self._lent.add(handle._actor_id)
        self._high = max(self._high, len(self._lent))

    def new_worker(self, node: str) -> Any:
        """A new process on `node`, never an idle one (a replacement for a dead rank: cold).
        It joins the pool when its trial ends."""
        with self._lock:
            handle = self._new_worker(node)
            self._lend(handle)
            return handle

    def _new_worker(self, node: str) -> Any:
        from failbench_ray.worker import WorkerActor

        strategy = NodeAffinitySchedulingStrategy(node, soft=False) if node else None
        handle = WorkerActor.options(  # type: ignore[attr-defined]
            num_cpus=0,
            max_concurrency=POOL_CONCURRENCY,
            name=f"{self._prefix}-w{next(self._names)}",
            scheduling_strategy=strategy,
        ).remote()
        self._mine.add(handle._actor_id)
        self.started += 1
        return handle

    def holder(self, actor: Any) -> Any:
        """A standby actor of the Ray actor class `actor` (a mechanism's `holder_actor`) with
        nothing in it: an idle one of that class, else a new one (anywhere)."""
        with self._lock:
            for i, idle in enumerate(self._holders):
                if self._holder_class.get(idle._actor_id) is actor:
                    self.reused += 1
                    return self._holders.pop(i)
            handle = actor.options(
                name=f"{self._prefix}-holder{next(self._names)}", scheduling_strategy="SPREAD"
            ).remote()
            self._holder_class[handle._actor_id] = actor
            self._mine.add(handle._actor_id)
            self.started += 1
            return handle

    def chaos(self, events: list[dict[str, Any]], home: str) -> Any:
        """The chaos actor, armed with `events`, on node `home` where possible."""
        from injector.chaos import ChaosActor

        with self._lock:
            handle = self._chaos.pop() if self._chaos else None
        if handle is not None:
            try:
                ray.get(handle.rearm.remote(events), timeout=_RESET_TIMEOUT_S)
                return handle
            except (RayActorError, GetTimeoutError):
                self._end([handle])
        handle = ChaosActor.options(  # type: ignore[attr-defined]
            name=f"{self._prefix}-chaos{next(self._names)}",
            # hard: Ray's soft affinity places it elsewhere when `home` has no CPUs (a head
            # node kept free of ranks), where a node kill can take it with its victim
            scheduling_strategy=NodeAffinitySchedulingStrategy(home, soft=False) if home else None,
        ).remote(events)
        with self._lock:
            self._mine.add(handle._actor_id)
        return handle

    # -- giving back -----------------------------------------------------------------------
    def give_back(
        self, workers: list[Any], chaos: Any = None, holders: tuple[Any, ...] = ()
    ) -> None:
        """Reset `workers` and `holders` (pooled ones; dead ones are forgotten) and keep those
        that can serve again; end the others."""
        workers = [h for h in workers if self.owns(h)]
        with self._lock:
            self._lent -= {h._actor_id for h in workers}
        if self.closing:  # resetting for a next trial that will not come costs seconds
            self._end([*workers, *[h for h in holders if self.owns(h)]])
            if chaos is not None and self.owns(chaos):
                self._end([chaos])
            return
        if chaos is not None and self.owns(chaos):
            chaos.stop.remote()
            with self._lock:
                self._chaos.append(chaos)
        emptied = self._reset([h for h in holders if self.owns(h)])
        with self._lock:
            self._holders += [h for h, (out, _) in emptied.items() if out.reason is None]
        self._end([h for h, (out, _) in emptied.items() if out.reason is not None])
        self._settle(workers)

    def _settle(self, workers: list[Any]) -> None:
        """Reset each of `workers`: idle if it could, parked if a stale collective's timeout
        will free it, else ended."""
        keep, park, end = [], [], []
        for attempt in range(_RESET_ROUNDS):
            outcomes = self._reset(workers)
            workers = []
            for h, (out, node) in outcomes.items():
                if out.reason is None:
                    keep.append((node, h))
                elif out.retry_in_s is None or out.retry_in_s > _MAX_PARK_S:
                    log.info("ending pooled worker %s: %s", h, out.reason)
                    end.append(h)
                elif attempt + 1 < _RESET_ROUNDS and keep:
                    workers.append(h)  # see _RESET_ROUNDS
                else:
                    park.append((time.monotonic() + out.retry_in_s, node, h))
            if not workers:
                break
            time.sleep(_RESET_ROUND_GAP_S)
        with self._lock:
            keep_at_most = min(_MAX_IDLE, max(self._high, 1))
            room = keep_at_most - sum(map(len, self._idle.values())) - len(self._parked)
            for node, h in keep:
                if room > 0:
                    self._idle[node].append(h)
                    room -= 1
                else:
                    end.append(h)
            for entry in park:
                if room > 0:
                    self._parked.append(entry)
                    room -= 1
                else:
                    end.append(entry[2])
        self._end(end)

    @staticmethod
    def _reset(workers: list[Any]) -> dict[Any, tuple[ResetOutcome, str]]:
        """Each worker's reset outcome and node; one that does not answer within
        `_RESET_TIMEOUT_S` (e.g. a hung, SIGSTOPped rank) is not waited for longer."""
        refs = {h: (h.reset.remote(), h.ready.remote()) for h in workers}
        every = [ref for pair in refs.values() for ref in pair]
        ray.wait(every, num_returns=len(every), timeout=_RESET_TIMEOUT_S)
        got = {}
        for h, (reset_ref, ready_ref) in refs.items():
            try:
                out: ResetOutcome = ray.get(reset_ref, timeout=0)
                info = ray.get(ready_ref, timeout=0)
                node = info["node_id"] if isinstance(info, dict) else ""  # a holder: its pid
            except RayError as err:  # died (also killed by Ray's memory monitor), or hung
                out, node = ResetOutcome(f"did not answer ({type(err).__name__})"), ""
            got[h] = (out, node)
        return got

    def _revive(self) -> None:
        """Reset again the parked workers whose stale collectives have timed out."""
        now = time.monotonic()
        with self._lock:
            due = [h for t, _, h in self._parked if t <= now]
            self._parked = [p for p in self._parked if p[0] > now]
        if due:
            self._settle(due)

    def forget(self, handle: Any) -> None:
        """A pooled process that was killed (a failure, or its survivors ended)."""
        with self._lock:
            self._mine.discard(handle._actor_id)
            self._lent.discard(handle._actor_id)
            self._holder_class.pop(handle._actor_id, None)

    def _end(self, handles: list[Any]) -> None:
        for h in handles:
            with self._lock:
                self._mine.discard(h._actor_id)
                self._holder_class.pop(h._actor_id, None)
                self.ended += 1
            ray.kill(h, no_restart=True)

    def idle_workers(self) -> list[Any]:
        with self._lock:
            return self.idle_workers_locked()

    def idle_workers_locked(self) -> list[Any]:
        return [h for hs in self._idle.values() for h in hs]

    def idle_actor_ids(self) -> set[str]:
        """Idle and parked processes, holders and the chaos actor: alive between trials."""
        with self._lock:
            hs = [h for hs in self._idle.values() for h in hs] + self._chaos + self._holders
            hs += [h for _, _, h in self._parked]
        return {h._actor_id.hex() for h in hs}

    def resources(self) -> dict[str, Any]:
        """A leak check between trials: the driver's and each idle pooled worker's memory,
        threads and open files, and how many other actors are still alive (a trial that is
        over must leave none)."""
        from ray._private import state

        with self._lock:
            idle = self.idle_workers_locked() + self._holders
        pooled = ray.get([h.resources.remote() for h in idle], timeout=_RESET_TIMEOUT_S)
        mine = self.idle_actor_ids()
        others = [
            a.get("Name", "")
            for aid, a in state.actors().items()
            if a["State"] != "DEAD" and a.get("ActorID", aid) not in mine
        ]
        return {
            "driver": process_resources(os.getpid()),
            "pooled": pooled,
            "other_actors_alive": others,
            **asdict(self.stats()),
        }

    def stats(self) -> PoolStats:
        with self._lock:
            idle = sum(map(len, self._idle.values()))
            parked = len(self._parked)
        return PoolStats(self.started, self.reused, self.ended, idle, parked)

    def shutdown(self) -> None:
        """End every idle process (a process still lent to a trial ends with the trial)."""
        with self._lock:
            idle = [h for hs in self._idle.values() for h in hs] + self._chaos + self._holders
            idle += [h for _, _, h in self._parked]
            self._idle.clear()
            self._chaos, self._parked, self._holders = [], [], []
        for h in idle:
            ray.kill(h, no_restart=True)
        with self._lock:
            self._mine -= {h._actor_id for h in idle}
            self._holder_class.clear()


_POOL: tuple[tuple[str, str], WorkerPool] | None = None  # (the connection it belongs to, the pool)
_POOL_LOCK = threading.Lock()


def shared_pool() -> WorkerPool:
    """This driver's pool, made on first use in each Ray connection (its processes die with
    the connection; `shutdown_shared_pool` ends them before)."""
    global _POOL
    # A job id alone does not tell two connections apart: each new local cluster numbers its
    # jobs from 01000000 again, and a pool kept across a `ray.shutdown()` and a new cluster
    # handed out actors of the dead one ("Can't find actor ..."). The driver's node id is new
    # with every cluster.
    ctx = ray.get_runtime_context()
    connection = (ctx.get_job_id(), ctx.get_node_id())
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != connection:
            _POOL = (connection, WorkerPool())
        return _POOL[1]


def stop_reusing() -> None:
    """The driver is stopping: trials that end from now on end their processes at once
    instead of resetting them for reuse (`failbench serve` on SIGTERM). Thread-safe."""
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL[1].closing = True


def shutdown_shared_pool() -> None:
    global _POOL
    with _POOL_LOCK:
        held, _POOL = _POOL, None
    if held is not None and ray.is_initialized():
        held[1].shutdown()
