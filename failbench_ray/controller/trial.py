"""One trial's shared state, and the actions more than one state takes (join the group,
restore, ask who holds which copies, record a failure)."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from failbench_ray import banners
from failbench_ray.checks import Resolved
from failbench_ray.controller.audit import DigestAudit, Mismatch
from failbench_ray.controller.callbacks import TrialCallback
from failbench_ray.controller.calls import Gathered, RankCalls, gather
from failbench_ray.controller.chaos_link import ChaosLink
from failbench_ray.controller.heartbeat import Heartbeat
from failbench_ray.controller.notice import NoticeResponder
from failbench_ray.controller.regrow import Growth
from failbench_ray.controller.standby import Standby
from failbench_ray.controller.stragglers import StepTimeOutliers
from failbench_ray.controller.timeline import RecoveryTimeline
from failbench_ray.controller.watchdog import StallWatchdog
from failbench_ray.errors import RecoveryError, TrialInterrupted
from failbench_ray.identity import ActorId, HolderId, RankId
from failbench_ray.pool import WorkerPool
from failbench_ray.records import CheckpointEvent, FailureRecord, StepRecord
from failbench_ray.spec import FailureEvent, Quiesce
from failbench_ray.worker import JoinInfo, RunReport, read_record_log
from failbench_ray.worker_group import Placement, WorkerGroup
from injector.kill_kinds import Target, signal_ranks
from mechanisms.base import FailureContext, RecoveryPlan, RestoreInstruction


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
    # Corruptions injected and never detected: what the final state silently carries.
    silently_diverged: list[dict[str, Any]] = field(default_factory=list)
    # Ranks the step-time outlier detector flagged (each with what was injected there, if any).
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    # Slowdowns injected and never ended by a recovery: (when they began, when they end).
    slowed: list[tuple[float, float]] = field(default_factory=list)
    error: str | None = None


@dataclass
class TrialSetup:
    """Where and how a trial runs (what the runner gives the controller)."""

    run_dir: Path
    placement: Placement
    label: str  # prefix of the trial's actor names
    events: list[FailureEvent]  # none for a baseline
    store_host: str
    tags: dict[str, str]
    pool: WorkerPool | None  # started processes to reuse (never for a replacement)
    should_stop: Callable[[], str | None]  # a reason to stop (a cancel)


class Trial:
    def __init__(self, resolved: Resolved, setup: TrialSetup, callbacks: TrialCallback) -> None:
        self.spec, self.mech, self.arch = resolved.spec, resolved.mech, resolved.arch
        self.layout = resolved.arch.layout()
        self.setup = setup
        self.cb = callbacks
        self.outcome = TrialOutcome("running")
        self.timeline = RecoveryTimeline(self.quiesce(), failures=self.outcome.failures)
        self.chaos = ChaosLink(setup.events, setup.label, setup.pool)
        self.standby = Standby(self.mech, setup.label, setup.pool)
        self.growth = Growth()
        self.watchdog = StallWatchdog(self.spec.stall_limit_s)
        self.heartbeat = Heartbeat(self.spec.detectors.heartbeat_timeout_s)
        self.outliers = StepTimeOutliers.of(self.spec.detectors, self.arch.abortable)
        self.notices = NoticeResponder(self.mech.saves_on_notice)
        self._pings: dict[int, Any] = {}  # rank -> its unanswered progress() call
        self.steps: dict[int, int] = {}  # rank -> the last step it said it completed
        self.calls = RankCalls(self.live_handles)
        self.group: WorkerGroup | None = None
        self.store: dist.TCPStore | None = None
        self.generation = -1
        self.committed = 0  # last step every live rank completed
        self.furthest = 0  # last step the most advanced live rank completed
        self.members = list(range(self.spec.world_size))  # live ranks, in group-rank order
        self.dead: set[int] = set()
        self.recoveries = 0
        self.survivor_steps: dict[int, int] = {}  # survivors of the last failure -> their step
        comparable = self.spec.detectors.digest_every and not self.arch.independent_replicas
        self.audit = DigestAudit(self.layout.replica_groups() if comparable else [])
        # A silent corruption was found: no state newer than this step may be restored.
        self.restore_at_most: int | None = None

    @property
    def workers(self) -> WorkerGroup:
        if self.group is None:
            raise RuntimeError("the worker group is not started yet")
        return self.group

    def live_handles(self) -> dict[int, Any]:
        handles = self.group.handles if self.group is not None else {}
        return {r: h for r, h in handles.items() if r not in self.dead}

    def check_stop(self) -> None:
        reason = self.setup.should_stop()
        if reason is not None:
            raise TrialInterrupted(reason)  # the controller closes every actor on the way out

    def quiesce(self) -> tuple[Quiesce, str]:
        """The spec's strategy, unless this architecture cannot honour `abort` (then why)."""
        asked = Quiesce(self.spec.quiesce)
        if asked is Quiesce.ABORT and not self.arch.abortable:
            why = f"abort asked, but {self.arch.name}'s collectives are not abortable"
            return Quiesce.KILL_SURVIVORS, why
        return asked, ""

    def close(self) -> None:
        """Stop every actor of this trial (also on Ctrl-C)."""
        self.chaos.stop()  # a throttled rank runs again before it is ended or given back
        helpers = self.standby.release()  # ended or given back with the group's actors
        if self.group is not None:
            self.group.shutdown(chaos=self.chaos.actor, helpers=helpers)
        else:
            for h in [self.chaos.actor, *helpers]:
                if h is not None:
                    ray.kill(h, no_restart=True)
        self.chaos.actor = None
        self.store = None

    # -- what more than one state does -------------------------------------------------------
    def absorb(self, reports: Any) -> None:
        for rep in reports:
            if isinstance(rep, RunReport):
                self.outcome.records += rep.records
                self.outcome.checkpoints += rep.checkpoints

    def detected(self, dead: set[int], detector: str = "death") -> None:
        """Record newly dead ranks as failures (from the chaos actor's log), found by
        `detector` (`kill_kinds.DETECTORS`)."""
        t_detect = time.time()
        injections = self.chaos.injections()
        new = self.timeline.detected(injections, dead, self.dead, t_detect, detector)
        # Ray's crash banner for a death we caused would read like a real crash: drop it
        hit = {r for inj in injections for r in inj.ranks} & (dead - self.dead)
        banners.injected(self.workers.pids[r] for r in hit if r in self.workers.pids)
        self._recover_records(dead - self.dead)
        self.dead |= dead
        for f in new:
            self.cb.after_failure(f)
        self.cb.after_live_ranks(len(set(self.members) - self.dead))

    def _recover_records(self, dead: set[int]) -> None:
        """Add the step records and checkpoint events dead ranks logged but never handed over
        (events of a background save that was still running are not in the log)."""
        have = {(r.rank, r.step, r.generation) for r in self.outcome.records}
        seen = set(self.outcome.checkpoints)
        for rank in dead:
            pid = self.workers.pids.get(rank)
            if pid is None:
                continue
            records, events = read_record_log(self.setup.run_dir, pid)
            for rec in records:
                if rec.rank == rank and (rec.rank, rec.step, rec.generation) not in have:
                    self.outcome.records.append(rec)
            self.outcome.checkpoints += [e for e in events if e.rank == rank and e not in seen]

    # -- the heartbeat -------------------------------------------------------------------
    def restart_beats(self) -> None:
        self.heartbeat.restart()
        self.outliers.restart()
        self._pings, self.steps = {}, {}

    def beat(self) -> set[int]:
        """Ping every live rank that has no ping out, take the answers that came back, act on
        any notice; return the ranks the heartbeat finds hung."""
        live = self.live_handles()
        for r, h in live.items():
            if r not in self._pings:
                self._pings[r] = h.progress.remote()
                self.heartbeat.sent(r)
        by_ref = {ref: r for r, ref in self._pings.items()}
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        for ref in ready:
            r = by_ref[ref]
            del self._pings[r]
            self.heartbeat.answered(r)  # a dead rank too: its run() call reports its death
            try:
                self.steps[r], sums, compute = ray.get(ref)
            except RayActorError:
                continue
            self.audit.add(r, sums)
            self.outliers.add(r, compute)
        if self.chaos.has_notices:
            self.notices.poll(self.chaos.noticed(), self.steps, self.spec.steps, live)
        return self.heartbeat.hung(live)

    def final_audit(self) -> Mismatch | None:
        """Training ended: compare the checksums no ping brought back yet (a short run can end
        between two beats)."""
        if not self.audit.groups:
            return None
        live = self.live_handles()
        got = gather({r: h.progress.remote() for r, h in live.items()})
        for r, (step, sums, _) in got.values.items():
            self.steps[r] = step
            self.audit.add(r, sums)
        return self.audit.check(live)

    def suspect_after(self, clean_step: int) -> None:
        """State newer than `clean_step` may be corrupt: the next restore takes none of it."""
        bound = self.restore_at_most
        self.restore_at_most = clean_step if bound is None else min(bound, clean_step)

    def corrupted(self, ranks: set[int], clean_step: int) -> None:
        """Silent corruption was found on `ranks`: state newer than `clean_step` is suspect.
        The ranks are replaced (as a node with bad memory would be), every rank rolls back."""
        self.suspect_after(clean_step)
        self.end_hung(ranks)

    def end_hung(self, ranks: set[int]) -> None:
        """Hung ranks are failed ranks: end their processes (a SIGKILL ends a stopped one)."""
        targets = {r: Target(*t) for r, t in self.workers.targets().items() if r in ranks}
        # A rank whose node died is silent too, until Ray reports the node dead: no task can
        # reach that node, and there is no process left to signal.
        with contextlib.suppress(RayError):
            signal_ranks(sorted(targets), targets, signal.SIGKILL)
        self.workers.kill(sorted(ranks))

    def phase(self, phase: str) -> None:
        """A recovery phase starts: a cascading failure may fire now."""
        self.cb.before_phase(phase, bool(self.timeline.open))
        self.chaos.on_phase(phase, self.committed)

    def set_targets(self) -> None:
        self.chaos.set_targets(self.workers.targets())

    def reach_early(self, ranks: list[int]) -> tuple[int, list[Any]]:
        """The fast re-formation: `ranks` (the survivors, and spares that took a rank) leave
        the dead group and count in at a new generation's rendezvous now, while the
        replacements start; their join (`join_all(generation)`) then finds that done.
        Returns the generation, taken for good (a re-formation cut short uses another), and
        the calls' refs."""
        self.generation += 1
        port = self.store.port if self.store is not None else 0
        handles, n = self.workers.handles, len(self.members)
        refs = [
            handles[r].reach.remote(self.generation, self.setup.store_host, port, n) for r in ranks
        ]
        return self.generation, refs

    def join_all(self, generation: int | None = None) -> Gathered:
        """Every live rank joins a new process group: a new generation, or the one
        `reach_early` took."""
        if generation is None:
            self.generation += 1
        info = JoinInfo(
            generation=self.generation,
            store_host=self.setup.store_host,
            store_port=self.store.port if self.store is not None else 0,
            members=tuple(self.members),
            peers=dict(self.workers.handles),
            holders=dict(self.standby.holders),
            backend=self.setup.placement.backend,
            device=self.setup.placement.device,
        )
        return self.calls.on_all(lambda h, r: h.join.remote(info))

    def kill_survivors(self, alive: list[int]) -> None:
        """Quiesce by killing: take what each survivor recorded first."""
        for r in alive:
            try:
                records, checkpoints = ray.get(self.workers.handles[r].drain.remote(), timeout=5)
            except (RayActorError, GetTimeoutError):
                self._recover_records({r})  # died first (a failure during quiescing): its log
                continue
            self.outcome.records += records
            self.outcome.checkpoints += checkpoints
            self.committed = max(self.committed, max((rec.step for rec in records), default=0))
        self.workers.kill(alive)
        self.dead |= set(alive)

    # -- deciding and restoring ---------------------------------------------------------------
    def failure_context(self) -> FailureContext:
        alive = {r: s for r, s in self.survivor_steps.items() if r not in self.dead}
        own, replicas = self._inventories(alive)
        bound = self.restore_at_most
        if bound is not None:  # after a silent corruption: only state that passed the checks
            own = {r: tuple(s for s in steps if s <= bound) for r, steps in own.items()}
            replicas = {
                shard: {s: who for s, who in by_step.items() if s <= bound}
                for shard, by_step in replicas.items()
            }
        return FailureContext(
            survivor_steps=alive,
            own_snapshots=own,
            replicas=replicas,
            spares=self.standby.spares(),
            members=tuple(self.members),
            world_size=self.spec.world_size,
            dead=frozenset(self.dead),
            layout=self.layout,
            committed_step=self.committed,
            failure_step=self.timeline.failure_step(self.committed),
            quiesce=self.quiesce()[0].value,
            latest_checkpoint=self.mech.latest_checkpoint(self.setup.run_dir, self.layout, bound),
            furthest_step=max(self.furthest, self.committed),
            restore_at_most=bound,
        )

    def _inventories(
        self, alive: dict[int, int]
    ) -> tuple[dict[int, tuple[int, ...]], dict[int, dict[int, tuple[ActorId, ...]]]]:
        """Who holds which copies now: survivors' own snapshots, every live holder's copies."""
        asked: dict[ActorId, Any] = {RankId(r): self.workers.handles[r] for r in alive}
        asked.update(self.standby.holders)
        refs = {who: h.inventory.remote() for who, h in asked.items()}
        own: dict[int, tuple[int, ...]] = {}
        replicas: dict[int, dict[int, tuple[ActorId, ...]]] = {}
        for who, ref in refs.items():
            try:
                inv = ray.get(ref, timeout=10)
            except (RayActorError, GetTimeoutError):
                continue  # a holder that died took its copies with it
            if isinstance(who, RankId):
                own[who.index] = tuple(inv["own"])
            # a dedicated holder answers its copies; a worker (rank, spare) says more
            copies = inv if isinstance(who, HolderId) else inv["copies"]
            for shard, steps in copies.items():
                for step in steps:
                    at = replicas.setdefault(int(shard), {}).setdefault(int(step), ())
                    replicas[int(shard)][int(step)] = (*at, who)
        return own, replicas

    def instruction(self, plan: RecoveryPlan) -> RestoreInstruction:
        keep = set(plan.keep)
        if plan.source == "survivors":
            keep |= set(self.survivor_steps) - self.dead
        handles: dict[ActorId, Any] = {RankId(r): h for r, h in self.workers.handles.items()}
        handles |= self.standby.adopted | self.standby.holders
        donors = {shard: (who, kind, handles[who]) for shard, (who, kind) in plan.donors.items()}
        return RestoreInstruction(plan.source, plan.restore_step, frozenset(keep), donors)

    def restore(self, instruction: RestoreInstruction, what: str) -> set[int]:
        """Every live rank loads its state; ranks that keep their own go first (a just-in-time
        donor writes its file then). Returns ranks that died meanwhile."""
        for keepers in (True, False):

            def call(h: Any, r: int, keepers: bool = keepers) -> Any:
                return h.restore.remote(instruction) if (r in instruction.keep) == keepers else None

            got = self.calls.on_all(call)
            for events in got.values.values():
                self.outcome.checkpoints += events
            if got.peer_lost and not got.dead:
                got.dead = self.calls.probe_dead()  # a donor died: find which rank it was
            if got.dead:
                return got.dead
            if got.errors:
                raise RecoveryError(f"{what} failed: {next(iter(got.errors.values()))}")
        return set()
