"""The trial controller: an explicit state machine that runs one trial on a worker group.

    STARTING -> TRAINING -> FINISHED
                   |  a worker died
                   v
               QUIESCING -> REFORMING -> RESTORING -> TRAINING
                   ^             |            |
                   +-------------+------------+  a worker died during recovery (cascading)

Deciding is separate from acting: the mechanism's pure `plan()` says what to do after a
failure, the controller carries it out and times every recovery phase.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import ray
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from failbench_ray import results
from failbench_ray.checks import Resolved
from failbench_ray.errors import RecoveryError, TrialInterrupted
from failbench_ray.pool import WorkerPool
from failbench_ray.records import CheckpointEvent, FailureRecord, StepRecord
from failbench_ray.recovery import decide
from failbench_ray.spec import Quiesce
from failbench_ray.telemetry import LIVE_PHASES, WORLD_SIZE, Recorder
from failbench_ray.worker import JoinInfo, RunReport, read_record_log
from failbench_ray.worker_group import Placement, WorkerGroup
from injector.chaos import ChaosActor, Injection
from mechanisms.base import FailureContext, RecoveryPlan, RestoreInstruction
from mechanisms.replication import ReplicaHolderActor

log = logging.getLogger("failbench.controller")

_POLL_S = 0.5
_PROBE_S = 10.0  # how long a live rank gets to answer a liveness probe


class State(str, Enum):
    STARTING = "starting"
    TRAINING = "training"
    QUIESCING = "quiescing"
    REFORMING = "reforming"
    RESTORING = "restoring"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class TrialOutcome:
    status: str  # "completed" or "failed"
    records: list[StepRecord] = field(default_factory=list)
    checkpoints: list[CheckpointEvent] = field(default_factory=list)
    failures: list[FailureRecord] = field(default_factory=list)
    params_digest: str | None = None
    state_bytes_per_rank: int | None = None  # measured on the final state (largest rank)
    members: list[int] = field(default_factory=list)  # ranks still training at the end
    replica_spread: float | None = None  # for architectures where every rank is a replica
    arch_metrics: dict[str, float] = field(default_factory=dict)  # mean over the ranks
    rank_nodes: dict[int, str] = field(default_factory=dict)  # Ray node of each rank at start
    error: str | None = None


@dataclass
class _Gathered:
    values: dict[int, Any] = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)
    errors: dict[int, str] = field(default_factory=dict)
    peer_lost: set[int] = field(default_factory=set)  # alive, but an actor it called died


def _one_line(err: BaseException) -> str:
    """A rank's error in one line: for an error raised inside the actor, its last line (the
    exception itself, not Ray's traceback header)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    if isinstance(err, RayTaskError) and lines:
        return lines[-1].strip()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def gather(calls: dict[int, Any]) -> _Gathered:
    """Results of finished calls, by rank: a dead actor's call lands in `dead`, an error in
    `errors`. A live rank whose call raised because an actor *it* called died is alive: it
    lands in `errors` and `peer_lost`, never in `dead`."""
    got = _Gathered()
    for rank, ref in calls.items():
        try:
            got.values[rank] = ray.get(ref)
        except RayActorError as err:
            if isinstance(err, RayTaskError):  # raised inside the live rank: not its death
                got.peer_lost.add(rank)
                got.errors[rank] = f"an actor it called died: {_one_line(err)}"
            else:
                got.dead.add(rank)
        except Exception as err:  # noqa: BLE001  (a rank's error is data, not a crash)
            got.errors[rank] = _one_line(err)
    return got


class TrialController:
    def __init__(
        self,
        resolved: Resolved,
        *,
        run_dir: Path,
        placement: Placement,
        label: str,
        inject: bool,
        store_host: str = "127.0.0.1",
        on_progress: Callable[[int], None] = lambda step: None,
        should_stop: Callable[[], str | None] = lambda: None,
        tags: dict[str, str] | None = None,
        pool: WorkerPool | None = None,
    ) -> None:
        self.pool = pool  # started processes to reuse (never for a replacement); None: fresh
        self.should_stop = should_stop  # a reason to stop (a cancel), checked between states
        self.spec = resolved.spec
        self.mech = resolved.mech
        self.layout = resolved.arch.layout()
        self.abortable = resolved.arch.abortable
        self.arch_name = resolved.arch.name
        self.run_dir = run_dir
        self.placement = placement
        self.label = label
        self.tags = dict(tags or {})
        self.metrics = Recorder(self.tags, enabled=self.spec.metrics)
        self.events = list(self.spec.failures.events) if inject else []
        self.store_host = store_host
        self.on_progress = on_progress
        self.state = State.STARTING
        self.outcome = TrialOutcome("running")
        self.generation = -1
        self.committed = 0  # last step every live rank completed
        self.furthest = 0  # last step the most advanced live rank completed
        self.members = list(range(self.spec.world_size))  # live ranks, in group-rank order
        self.continues_without_dead = resolved.arch.continues_without_dead()
        self.independent_replicas = resolved.arch.independent_replicas
        self.recoveries = 0
        self.dead: set[int] = set()
        self.open: list[FailureRecord] = []  # failures whose recovery is not done yet
        self.seen_injections: set[int] = set()
        self.injected_ranks: set[int] = set()
        self.pending: dict[int, Any] = {}  # rank -> ObjectRef of a running `run()`
        self.plan: RecoveryPlan | None = None
        self.store: dist.TCPStore | None = None
        self.chaos: Any = None
        self.group: WorkerGroup | None = None
        self.holders: dict[str, Any] = {}  # replica holders and ready hot spares, by name
        self.spare_info: dict[str, dict[str, Any]] = {}  # what each ready spare's ready() said
        self.starting_spares: dict[str, tuple[Any, Any]] = {}  # name -> (handle, ready ref)
        self.spares_made = 0
        self.adopted: dict[str, Any] = {}  # spares that took a rank, by their spare name
        self.survivor_steps: dict[int, int] = {}  # survivors of the last failure -> their step
        self.growing: dict[int, Any] = {}  # elastic: dropped rank -> (handle, ready ref)
        self.grow_failures: list[FailureRecord] = []  # failures whose ranks are growing back
        self._last_steps: dict[int, int] = {}  # what the ranks said at the last progress poll
        self._progressed_at = 0.0  # when that last changed (the stall watchdog)

    # -- driving ---------------------------------------------------------------------------
    def run(self) -> TrialOutcome:
        handlers = {
            State.STARTING: self._starting,
            State.TRAINING: self._training,
            State.QUIESCING: self._quiescing,
            State.REFORMING: self._reforming,
            State.RESTORING: self._restoring,
        }
        try:
            while self.state not in (State.FINISHED, State.FAILED):
                self._check_stop()
                t0, was = time.monotonic(), self.state
                self.state = handlers[self.state]()
                log.debug("%s: %s took %.3f s", self.label, was.value, time.monotonic() - t0)
        except RecoveryError as err:
            self.state, self.outcome.error = State.FAILED, str(err)
        finally:
            self.close()
        self.outcome.status = "completed" if self.state == State.FINISHED else "failed"
        return self.outcome

    def _check_stop(self) -> None:
        reason = self.should_stop()
        if reason is not None:
            raise TrialInterrupted(reason)  # `run` closes every actor on the way out

    def close(self) -> None:
        """Stop every actor of this trial (also on Ctrl-C)."""
        # Holders (and ready hot spares, which wait among them): given back or ended with
        # the group's actors.
        helpers = tuple(self.holders.values())
        self.holders.clear()
        if self.group is not None:
            self.group.shutdown(chaos=self.chaos, helpers=helpers)
        else:
            for h in [self.chaos, *helpers]:
                if h is not None:
                    ray.kill(h, no_restart=True)
        self.chaos = None
        self.store = None

    # -- states ----------------------------------------------------------------------------
    def _starting(self) -> State:
        self.store = dist.TCPStore(self.store_host, 0, is_master=True, wait_for_workers=False)
        # On the head node, which a node kill never takes (see _set_targets), so the injector
        # outlives its victims. (Not "the driver's node": a driver on a multi-node host may be
        # attached to another raylet; the multi-node test's chaos actor died with its victim.)
        home = _head_node_id() or ray.get_runtime_context().get_node_id()
        events = [e.model_dump() for e in self.events]
        if self.pool is not None:
            self.chaos = self.pool.chaos(events, home)
        else:
            self.chaos = ChaosActor.options(  # type: ignore[attr-defined]
                name=f"{self.label}-chaos",
                scheduling_strategy=NodeAffinitySchedulingStrategy(home, soft=False),  # pool.py
            ).remote(events)
        self.group = WorkerGroup(
            self.spec, self.run_dir, self.chaos, self.placement, self.label, self.tags, self.pool
        )
        self.group.check_stop = self._check_stop
        self.group.reserve()
        self._start_holders()
        self.group.start_first(list(range(self.spec.world_size)))
        self._spares_ready(wait=True)
        self._set_targets()
        self.outcome.rank_nodes = dict(self.group.nodes)
        log.info("%s: %d ranks started", self.label, self.spec.world_size)
        got = self._join_all()
        if not got.dead and not got.errors:
            got = self._on_all(lambda h, r: h.restore.remote(RestoreInstruction("scratch", 0)))
        if got.dead:
            return self._detected(got.dead)
        if got.errors:
            rank, err = next(iter(got.errors.items()))
            raise RecoveryError(f"rank {rank} could not start: {err}")
        ray.get(self.chaos.start.remote())
        self.metrics.set(WORLD_SIZE, len(self.members))
        return State.TRAINING

    def _training(self) -> State:
        assert self.group is not None
        fired = set(ray.get(self.chaos.fired.remote()))
        self.survivor_steps = {}
        self.pending = {
            r: h.run.remote(self.committed + 1, self.spec.steps, self._armed(r, fired))
            for r, h in self.group.handles.items()
        }
        reports: dict[int, RunReport] = {}
        last_poll = self._progressed_at = time.monotonic()
        self._last_steps = {}
        while self.pending:
            ready, _ = ray.wait(list(self.pending.values()), num_returns=1, timeout=_POLL_S)
            got = self._collect(ready)
            reports.update(got.values)
            self.survivor_steps = {r: rep.last_step for r, rep in reports.items()}
            self._absorb(got.values.values())
            if got.dead:
                return self._detected(got.dead)
            if got.errors:
                rank, err = next(iter(got.errors.items()))
                raise RecoveryError(f"rank {rank} failed: {err}")
            if time.monotonic() - last_poll >= _POLL_S:
                last_poll = time.monotonic()
                self._check_stop()
                self._poll_progress()
                if self._spares_ready(wait=False):
                    self._tell_holders()
                if self.growing and self._grown_ready():
                    return self._regrow()
        aborted = [r for r in reports.values() if r.status != "completed"]
        if aborted:
            raise RecoveryError(
                f"rank {aborted[0].rank} stopped with no dead peer: {aborted[0].reason}"
            )
        self.on_progress(self.spec.steps)
        self.outcome.params_digest = self._digest()
        return State.FINISHED

    def _quiescing(self) -> State:
        assert self.group is not None
        self._phase_trigger("quiescing")
        alive = [r for r in self.pending if r not in self.dead]
        strategy, _ = self._quiesce()
        if strategy is Quiesce.ABORT:
            for r in alive:
                self.group.handles[r].abort.remote()
        elif strategy is Quiesce.KILL_SURVIVORS:
            self._kill_survivors(alive)
        got = self._collect(list(self.pending.values()), wait_all=True)
        self._absorb(got.values.values())
        t = time.time()
        # Ranks whose run() returned while training (a collective failed at once) count too.
        self.survivor_steps |= {
            r: rep.last_step for r, rep in got.values.items() if isinstance(rep, RunReport)
        }
        self.survivor_steps = {
            r: s for r, s in self.survivor_steps.items() if r not in got.dead | self.dead
        }
        survivors = list(self.survivor_steps.values())
        if survivors:
            self.committed, self.furthest = min(survivors), max(survivors)
        if got.dead - self.dead:
            self._detected(got.dead - self.dead)
        self._stamp("quiesced", t)
        for f in self.open:
            if f.injected_at_step < 0:
                f.injected_at_step = self.committed + 1
        return State.REFORMING

    def _reforming(self) -> State:
        assert self.group is not None
        self.recoveries += 1
        if self.recoveries > self.spec.max_recoveries:
            raise RecoveryError(
                f"gave up after {self.spec.max_recoveries} recoveries (raise max_recoveries)"
            )
        self._phase_trigger("reforming")
        plan = decide(
            self.mech, self._failure_context(), continues_without_dead=self.continues_without_dead
        )
        self.plan = plan
        for f in self.open:
            f.replacement = _replacement(plan)
        self.group.kill([r for r in plan.replace if r not in self.dead])
        for r, name in plan.spares.items():  # hot spares take their ranks at once
            handle = self.holders.pop(name)
            self.adopted[name] = handle  # still a donor of its mirror in this restore
            self.group.adopt(r, handle, self.spare_info.pop(name))
            self._start_spare()  # a new spare comes up in the background
        self.group.start([r for r in plan.replace if r not in plan.spares])
        self.dead -= set(plan.replace)
        for r in plan.drop:  # training goes on without them
            self.members.remove(r)
            self.group.handles.pop(r)
            self.dead.discard(r)
        if plan.grow:  # elastic: replacements start in the background; the group grows later
            self.growing.update(self.group.start_async(list(plan.grow)))
            self.grow_failures += self.open
        self._set_targets()
        got = self._on_all(lambda h, r: h.ready.remote())
        if not got.dead:
            got = self._join_all()
        if got.dead:
            return self._detected(got.dead)
        if got.errors:  # a rendezvous timed out: try the whole re-formation again
            return State.REFORMING
        self._stamp("reformed", time.time())
        log.info("%s: reformed with ranks %s (plan: %s)", self.label, self.members, plan.source)
        return State.RESTORING

    def _restoring(self) -> State:
        assert self.plan is not None
        self._phase_trigger("restoring")
        dead = self._restore(self._instruction(self.plan), "restore")
        if dead:
            return self._detected(dead)
        for h in self.holders.values():  # copies after the restored step are stale now
            h.truncate.remote(self.plan.restore_step)
        t = time.time()
        self._stamp("restored", t)
        for f in self.open:
            f.restored_from_step = self.plan.restore_step
            f.restore_source = (
                f"{self.plan.source}: {self.plan.note}" if self.plan.note else self.plan.source
            )
        for f in self.open:
            self.metrics.recovery(f.phases, LIVE_PHASES)  # the rest: when the trial ends
            log.info(
                "%s: failure %d restored from step %d (%s) in %.2f s",
                self.label,
                f.index,
                self.plan.restore_step,
                f.restore_source,
                f.phases["restored"] or 0.0,
            )
        self.open = []
        self.committed = self.plan.restore_step
        self.metrics.set(WORLD_SIZE, len(self.members))
        self._phase_trigger("resuming")
        return State.TRAINING

    # -- failures --------------------------------------------------------------------------
    def _detected(self, dead: set[int]) -> State:
        """Record newly dead ranks as failures (from the chaos actor's log) and go quiesce."""
        t_detect = time.time()
        injections: list[Injection] = [
            i
            for i in ray.get(self.chaos.injections.remote())
            if i.index not in self.seen_injections
        ]
        new: list[FailureRecord] = []
        for inj in injections:
            self.seen_injections.add(inj.index)
            step = inj.step if inj.step is not None else -1
            new.append(self._failure(inj.ranks, inj.kill_kind, inj.trigger, step, inj.t_injected))
        self.injected_ranks |= {r for f in new for r in f.ranks}
        unplanned = sorted(dead - self.injected_ranks - self.dead)
        if unplanned and not new:
            new.append(self._failure(unplanned, "unplanned", "crash", -1, t_detect))
        for f in new:
            f.phases["detected"] = t_detect - f.t_injected
            for old in self.open:
                old.interrupted_by = (
                    old.interrupted_by if old.interrupted_by is not None else f.index
                )
        self.open += new
        self._recover_records(dead - self.dead)
        self.dead |= dead
        for f in new:
            self.metrics.failure(f.kill_kind, len(f.ranks))
            log.warning(
                "%s: failure %d detected after %.2f s: rank(s) %s (%s, %s)",
                self.label,
                f.index,
                f.phases["detected"],
                f.ranks,
                f.kill_kind,
                f.trigger,
            )
        self.metrics.set(WORLD_SIZE, len(set(self.members) - self.dead))
        return State.QUIESCING

    def _recover_records(self, dead: set[int]) -> None:
        """Add the step records and checkpoint events dead ranks logged but never handed over
        (events of a background save that was still running are not in the log)."""
        assert self.group is not None
        have = {(r.rank, r.step, r.generation) for r in self.outcome.records}
        seen = set(self.outcome.checkpoints)
        for rank in dead:
            pid = self.group.pids.get(rank)
            if pid is None:
                continue
            records, events = read_record_log(self.run_dir, pid)
            for rec in records:
                if rec.rank == rank and (rec.rank, rec.step, rec.generation) not in have:
                    self.outcome.records.append(rec)
            self.outcome.checkpoints += [e for e in events if e.rank == rank and e not in seen]

    def _failure(
        self, ranks: list[int], kind: str, trigger: str, step: int, t: float
    ) -> FailureRecord:
        f = FailureRecord(
            index=len(self.outcome.failures),
            ranks=list(ranks),
            kill_kind=kind,
            trigger=trigger,
            injected_at_step=step,
            t_injected=t,
        )
        strategy, f.quiesce_reason = self._quiesce()
        f.quiesce = strategy.value
        self.outcome.failures.append(f)
        return f

    def _quiesce(self) -> tuple[Quiesce, str]:
        """The spec's strategy, unless this architecture cannot honour `abort` (then why)."""
        asked = Quiesce(self.spec.quiesce)
        if asked is Quiesce.ABORT and not self.abortable:
            why = f"abort asked, but {self.arch_name}'s collectives are not abortable"
            return Quiesce.KILL_SURVIVORS, why
        return asked, ""

    def _failure_context(self) -> FailureContext:
        steps = [f.injected_at_step for f in self.open] or [self.committed + 1]
        alive = {r: s for r, s in self.survivor_steps.items() if r not in self.dead}
        own, replicas = self._inventories(alive)
        return FailureContext(
            survivor_steps=alive,
            own_snapshots=own,
            replicas=replicas,
            spares=tuple(n for n in self.holders if n.startswith("spare")),
            members=tuple(self.members),
            world_size=self.spec.world_size,
            dead=frozenset(self.dead),
            layout=self.layout,
            committed_step=self.committed,
            failure_step=max(steps),
            quiesce=self._quiesce()[0].value,
            latest_checkpoint=self.mech.latest_checkpoint(self.run_dir, self.layout),
            furthest_step=max(self.furthest, self.committed),
        )

    def _inventories(
        self, alive: dict[int, int]
    ) -> tuple[dict[int, tuple[int, ...]], dict[int, dict[int, tuple[str, ...]]]]:
        """Who holds which copies now: survivors' own snapshots, every live holder's copies."""
        assert self.group is not None
        asked = {f"rank{r}": self.group.handles[r] for r in alive}
        asked.update({n: h for n, h in self.holders.items()})
        refs = {n: h.inventory.remote() for n, h in asked.items()}
        own: dict[int, tuple[int, ...]] = {}
        replicas: dict[int, dict[int, tuple[str, ...]]] = {}
        for name, ref in refs.items():
            try:
                inv = ray.get(ref, timeout=10)
            except (RayActorError, GetTimeoutError):
                continue  # a holder that died took its copies with it
            if name.startswith("rank"):
                own[int(name[4:])] = tuple(inv["own"])
                copies = inv["copies"]
            else:
                copies = inv if name.startswith("holder") else inv["copies"]
            for shard, steps in copies.items():
                for step in steps:
                    at = replicas.setdefault(int(shard), {}).setdefault(int(step), ())
                    replicas[int(shard)][int(step)] = (*at, name)
        return own, replicas

    def _restore(self, instruction: RestoreInstruction, what: str) -> set[int]:
        """Every live rank loads its state; ranks that keep their own go first (a just-in-time
        donor writes its file then). Returns ranks that died meanwhile."""
        for keepers in (True, False):

            def call(h: Any, r: int, keepers: bool = keepers) -> Any:
                return h.restore.remote(instruction) if (r in instruction.keep) == keepers else None

            got = self._on_all(call)
            for events in got.values.values():
                self.outcome.checkpoints += events
            if got.peer_lost and not got.dead:
                got.dead = self._probe_dead()  # a donor died: find which rank it was
            if got.dead:
                return got.dead
            if got.errors:
                raise RecoveryError(f"{what} failed: {next(iter(got.errors.values()))}")
        return set()

    def _instruction(self, plan: RecoveryPlan) -> RestoreInstruction:
        assert self.group is not None
        keep = set(plan.keep)
        if plan.source == "survivors":
            keep |= set(self.survivor_steps) - self.dead
        by_name = self.adopted | {f"rank{r}": h for r, h in self.group.handles.items()}
        by_name |= self.holders
        donors = {shard: (name, kind, by_name[name]) for shard, (name, kind) in plan.donors.items()}
        return RestoreInstruction(plan.source, plan.restore_step, frozenset(keep), donors)

    # -- replica holders, hot spares, growing back -----------------------------------------
    def _start_holders(self) -> None:
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
            self._start_spare()

    def _start_spare(self) -> None:
        assert self.group is not None
        name = f"spare{self.spares_made}"
        self.spares_made += 1
        self.starting_spares[name] = self.group.start_spare(name)

    def _spares_ready(self, *, wait: bool) -> bool:
        """Move spares that finished starting into the holders. True if any did."""
        moved = False
        for name, (handle, ref) in list(self.starting_spares.items()):
            done, _ = ray.wait([ref], timeout=None if wait else 0)
            if not done:
                continue
            del self.starting_spares[name]
            try:
                self.spare_info[name] = ray.get(ref)
            except RayActorError:
                continue
            self.holders[name] = handle
            moved = True
        return moved

    def _tell_holders(self) -> None:
        """Workers learn of a new holder (a spare came up) without stopping."""
        assert self.group is not None
        members = tuple(self.members)
        for r, h in self.group.handles.items():
            if r not in self.dead:
                h.set_holders.remote(self.holders, members)

    def _grown_ready(self) -> bool:
        refs = [ref for _, ref in self.growing.values()]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(done) == len(refs)

    def _regrow(self) -> State:
        """Elastic: the replacements are up; stop at a step boundary and take them back in."""
        assert self.group is not None
        for h in self.group.handles.values():
            h.abort.remote()
        got = self._collect(list(self.pending.values()), wait_all=True)
        self._absorb(got.values.values())
        if got.dead:
            return self._detected(got.dead)
        steps = {r: rep.last_step for r, rep in got.values.items()}
        self.committed, self.furthest = min(steps.values()), max(steps.values())
        self.survivor_steps = steps
        grown = dict(self.growing)
        self.growing = {}
        died = self.group.wait_started(grown)
        if died:
            raise RecoveryError(f"rank(s) {died} died while coming back to grow the group")
        self.members = sorted(self.members + list(grown))
        self._set_targets()
        got = self._join_all()
        if got.dead:
            return self._detected(got.dead)
        if got.errors:
            raise RecoveryError(f"growing back failed: {next(iter(got.errors.values()))}")
        self.plan = self.mech.grow_plan(self._failure_context(), tuple(grown))
        dead = self._restore(self._instruction(self.plan), "growing back")
        if dead:
            return self._detected(dead)
        t = time.time()
        for f in self.grow_failures:
            f.phases["grown"] = t - f.t_injected
        self.grow_failures = []
        self.committed = self.plan.restore_step
        self.metrics.set(WORLD_SIZE, len(self.members))
        log.info("%s: grew back to ranks %s", self.label, self.members)
        return State.TRAINING

    def _set_targets(self) -> None:
        """Tell the chaos actor the current worker of each rank. A node kill must never take
        the head node: the driver and the cluster's control plane live there."""
        assert self.group is not None
        targets = self.group.targets()
        fired = set(ray.get(self.chaos.fired.remote()))
        node_ranks = {
            r
            for i, e in enumerate(self.events)
            if e.kill == "node" and i not in fired
            for r in e.ranks
        }
        head = _head_node_id() if node_ranks else ""
        on_head = sorted(r for r in node_ranks if targets[r][2] == head)
        if on_head:
            raise RecoveryError(
                f"a node kill targets rank(s) {on_head}, which run on the Ray head node; node "
                f"kills need ranks on worker nodes: start the head with num_cpus=0 (and no "
                f"GPUs) so no rank is placed there, or name other ranks"
            )
        ray.get(self.chaos.set_targets.remote(targets))

    def _phase_trigger(self, phase: str) -> None:
        """Let the chaos actor fire a cascading failure as this recovery phase starts."""
        if self.open:
            log.info("%s: %s", self.label, phase)
        ray.get(self.chaos.on_phase.remote(phase, self.committed))

    def _stamp(self, phase: str, t: float) -> None:
        for f in self.open:
            if f.phases.get(phase) is None:
                f.phases[phase] = t - f.t_injected

    def _kill_survivors(self, alive: list[int]) -> None:
        assert self.group is not None
        for r in alive:
            try:
                records, checkpoints = ray.get(self.group.handles[r].drain.remote(), timeout=5)
            except (RayActorError, GetTimeoutError):
                continue
            self.outcome.records += records
            self.outcome.checkpoints += checkpoints
            self.committed = max(self.committed, max((rec.step for rec in records), default=0))
        self.group.kill(alive)
        self.dead |= set(alive)

    # -- helpers ---------------------------------------------------------------------------
    def _armed(self, rank: int, fired: set[int]) -> dict[tuple[str, int], int]:
        armed = {}
        for i, e in enumerate(self.events):
            point = e.worker_point
            if point is not None and rank in e.ranks and i not in fired:
                armed[point] = i
        return armed

    def _join_all(self) -> _Gathered:
        self.generation += 1
        info = JoinInfo(
            generation=self.generation,
            store_host=self.store_host,
            store_port=self.store.port if self.store is not None else 0,
            members=tuple(self.members),
            peers=dict(self.group.handles) if self.group is not None else {},
            holders=dict(self.holders),
            backend=self.placement.backend,
            device=self.placement.device,
        )
        return self._on_all(lambda h, r: h.join.remote(info))

    def _on_all(self, call: Callable[[Any, int], Any]) -> _Gathered:
        """Call every live rank: `call(handle, rank)` returns the call's ref, or None to skip
        that rank."""
        assert self.group is not None
        refs = {r: call(h, r) for r, h in self.group.handles.items() if r not in self.dead}
        refs = {r: ref for r, ref in refs.items() if ref is not None}
        self.pending = refs
        return self._collect(list(refs.values()), wait_all=True)

    def _collect(self, refs: list[Any], wait_all: bool = False) -> _Gathered:
        """Results of finished calls (see `gather`); they are no longer pending."""
        by_ref = {ref: r for r, ref in self.pending.items()}
        if wait_all and refs:
            ray.wait(refs, num_returns=len(refs))
        for ref in refs:
            self.pending.pop(by_ref[ref], None)
        return gather({by_ref[ref]: ref for ref in refs})

    def _probe_dead(self) -> set[int]:
        """Ranks whose actor no longer answers (when a live rank saw some actor die)."""
        assert self.group is not None
        refs = {r: h.ready.remote() for r, h in self.group.handles.items() if r not in self.dead}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=_PROBE_S)
        dead = set()
        for r, ref in refs.items():
            with contextlib.suppress(GetTimeoutError):
                try:
                    ray.get(ref, timeout=0)
                except RayActorError:
                    dead.add(r)
        return dead

    def _absorb(self, reports: Any) -> None:
        for rep in reports:
            if isinstance(rep, RunReport):
                self.outcome.records += rep.records
                self.outcome.checkpoints += rep.checkpoints

    def _poll_progress(self) -> None:
        """Report progress, and fail the trial when no live rank completes a step for
        `stall_timeout_s`: a hang (a lost message, a collective stuck on a hung rank) must
        not hold a sweep forever. A rank that does not answer counts as not progressing."""
        assert self.group is not None
        live = sorted(set(self.group.handles) - self.dead)
        refs = {r: self.group.handles[r].progress.remote() for r in live}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=2)
        steps: dict[int, int] = {}
        for r, ref in refs.items():
            with contextlib.suppress(RayActorError, GetTimeoutError):
                steps[r] = ray.get(ref, timeout=0)
        if steps:
            self.on_progress(steps[min(steps)])
        now = time.monotonic()
        if steps != self._last_steps:
            self._last_steps, self._progressed_at = steps, now
        elif now - self._progressed_at > self.spec.stall_limit_s:
            raise RecoveryError(
                f"no rank completed a step for {now - self._progressed_at:.0f} s while "
                f"training (ranks at steps {steps}, unanswered ranks left out): a hang, not a "
                "failure; raise stall_timeout_s if steps really take this long"
            )

    def _digest(self) -> str:
        """Digest of the whole model: each shard's digest, replicas checked against each other."""
        got = self._on_all(lambda h, r: h.digest.remote())
        if got.dead or got.errors:
            raise RecoveryError(f"computing the final digest failed: {got.errors or got.dead}")
        self.outcome.state_bytes_per_rank = max(v[1] for v in got.values.values())
        self.outcome.members = list(self.members)
        self.outcome.arch_metrics = results.mean_by_key([v[3] for v in got.values.values()])
        if self.independent_replicas:
            # Every rank its own replica (gossip): how far apart did they end?
            self.outcome.replica_spread = results.replica_spread(
                [v[2] for v in got.values.values()]
            )
        h = hashlib.sha256()
        for shard, group in zip(self.layout.shard_ids(), self.layout.replica_groups(), strict=True):
            digests = {got.values[r][0] for r in group if r in got.values}
            if not digests:
                continue  # every holder left the group (training went on without them)
            if len(digests) != 1:
                self.outcome.error = f"replicas of shard {shard} diverged across ranks {group}"
                return "diverged"
            h.update(digests.pop().encode())
        return h.hexdigest()


def _replacement(plan: RecoveryPlan) -> str:
    """How the ranks a plan brings back are brought back: standbys that already run
    ("warm"), new processes started now ("cold"), or none (training goes on without them)."""
    back = set(plan.replace) | set(plan.grow)
    if not back:
        return "none"
    return "warm" if back <= set(plan.spares) else "cold"


def _head_node_id() -> str:
    """The Ray head node (it carries Ray's `node:__internal_head__` resource)."""
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return str(node["NodeID"])
    return ""
