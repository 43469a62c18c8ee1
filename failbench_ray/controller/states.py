"""The trial's states. Each runs once and returns the next state with the data it needs.

    Starting -> Training -> Finished
                   |   ^ \\ the replacements of dropped ranks are up (elastic)
     a rank died   |   |  +--> Regrowing --+
                   v   |                   |
               Quiescing -> Reforming -> Restoring -> Training
                   ^             |            |
                   +-------------+------------+  a rank died during recovery (cascading)

Deciding is apart from acting: `recovery.decide` (the mechanism's pure `plan()`) says what to
do after a failure; the states carry it out, and the timeline times every recovery phase.
A `RecoveryError` from any state fails the trial (the controller's `Failed`).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from failbench_ray.comm import rendezvous_store
from failbench_ray.controller.calls import gather
from failbench_ray.controller.final_check import check
from failbench_ray.controller.stragglers import flag_records
from failbench_ray.controller.trial import Trial
from failbench_ray.errors import RecoveryError
from failbench_ray.recovery import decide
from failbench_ray.spec import Quiesce
from failbench_ray.worker import RunReport
from failbench_ray.worker_group import WorkerGroup
from injector.kill_kinds import KILL_KINDS
from mechanisms.base import RecoveryPlan, RestoreInstruction

log = logging.getLogger("failbench.controller")
_POLL_S = 0.5  # how often training checks for a stop, progress, spares and regrowth
_BEAT_S = 0.1  # how often training pings the ranks (the heartbeat) and reads notices


class TrialState(ABC):
    name: ClassVar[str]
    terminal: ClassVar[bool] = False

    @abstractmethod
    def run(self, t: Trial) -> TrialState:
        """Do this state's work; return the next state."""


def failed_ranks(t: Trial, dead: set[int], detector: str = "death") -> TrialState:
    """Ranks died (or hung): record the failure, then quiesce whatever still runs."""
    t.detected(dead, detector)
    return Quiescing()


@dataclass(frozen=True)
class Starting(TrialState):
    name = "starting"

    def run(self, t: Trial) -> TrialState:
        s = t.setup
        t.store = rendezvous_store(s.store_host)
        chaos = t.chaos.start()
        t.group = WorkerGroup(t.spec, s.run_dir, chaos, s.placement, s.label, s.tags, s.pool)
        t.group.check_stop = t.check_stop
        t.group.reserve()
        t.standby.start(t.group)
        t.group.start_first(list(range(t.spec.world_size)))
        t.standby.spares_ready(wait=True)
        t.set_targets()
        t.outcome.rank_nodes = dict(t.group.nodes)
        t.cb.after_start(list(t.members))
        got = t.join_all()
        if not got.dead and not got.errors:
            scratch = RestoreInstruction("scratch", 0)
            got = t.calls.on_all(lambda h, r: h.restore.remote(scratch))
        if got.dead:
            return failed_ranks(t, got.dead)
        if got.errors:
            rank, err = got.first_error()
            raise RecoveryError(f"rank {rank} could not start: {err}")
        t.chaos.go()
        t.cb.after_live_ranks(len(t.members))
        return Training()


@dataclass(frozen=True)
class Training(TrialState):
    name = "training"

    def run(self, t: Trial) -> TrialState:
        fired = t.chaos.fired()
        t.survivor_steps = {}
        start, end = t.committed + 1, t.spec.steps
        t.calls.start(lambda h, r: h.run.remote(start, end, t.chaos.armed(r, fired)))
        reports: dict[int, RunReport] = {}
        last_poll = time.monotonic()
        t.watchdog.restart()
        t.restart_beats()
        while t.calls.pending:
            got = t.calls.next_done(timeout=_BEAT_S)
            reports.update(got.values)
            t.survivor_steps = {r: rep.last_step for r, rep in reports.items()}
            t.absorb(got.values.values())
            if got.dead:
                return failed_ranks(t, got.dead)
            if got.errors:
                rank, err = got.first_error()
                raise RecoveryError(f"rank {rank} failed: {err}")
            found = self._detect(t, got.values)
            if found is not None:
                return found
            if time.monotonic() - last_poll >= _POLL_S:
                last_poll = time.monotonic()
                t.check_stop()
                self._report_progress(t)
                if t.standby.spares_ready(wait=False):
                    t.standby.tell(t.workers, t.members, t.dead)
                if t.growth.ready():
                    return Regrowing()
        aborted = [r for r in reports.values() if r.status != "completed"]
        mismatch = t.final_audit() if not aborted else None
        if mismatch is not None:  # training ends on state that passed the check, or replays
            t.corrupted(set(mismatch.ranks), t.audit.verified)
            return failed_ranks(t, set(mismatch.ranks), "digest")
        if aborted:
            raise RecoveryError(
                f"rank {aborted[0].rank} stopped with no dead peer: {aborted[0].reason}"
            )
        t.cb.after_progress(t.spec.steps)
        return Finishing()

    @staticmethod
    def _detect(t: Trial, reports: dict[int, RunReport]) -> TrialState | None:
        """The detectors of failures that leave the process alive (`kill_kinds.DETECTORS`):
        the state to go to if one fired."""
        corrupt = {r: rep for r, rep in reports.items() if rep.status == "corrupt"}
        if corrupt:
            clean = min(rep.clean_step or 0 for rep in corrupt.values())
            t.corrupted(set(corrupt), clean)
            return failed_ranks(t, set(corrupt), "nonfinite")
        hung = t.beat()
        if hung:
            t.end_hung(hung)
            return failed_ranks(t, hung, "heartbeat")
        slow = t.outliers.check(t.live_handles())
        if slow:
            action = t.spec.detectors.straggler_action
            for o in slow:
                log.warning("%s: straggler: %s", t.setup.label, o.describe())
            t.outcome.stragglers += flag_records(slow, t.chaos.injections(), time.time(), action)
            if action == "replace":
                ranks = {o.rank for o in slow}
                t.end_hung(ranks)
                return failed_ranks(t, ranks, "step_time")
        mismatch = t.audit.check(t.live_handles())
        if mismatch is not None:
            t.corrupted(set(mismatch.ranks), t.audit.verified)
            return failed_ranks(t, set(mismatch.ranks), "digest")
        return None

    @staticmethod
    def _report_progress(t: Trial) -> None:
        """Report progress (the heartbeat's answers); the watchdog fails the trial when no
        rank moves (a hang the heartbeat cannot blame on one rank, or with it off)."""
        steps = {r: s for r, s in t.steps.items() if r not in t.dead}
        if steps:
            t.cb.after_progress(steps[min(steps)])
        t.watchdog.observe(steps)


@dataclass(frozen=True)
class Quiescing(TrialState):
    """Stop the survivors (abort their collectives, or kill them) and see where they got."""

    name = "quiescing"

    def run(self, t: Trial) -> TrialState:
        t.phase("quiescing")
        alive = [r for r in t.calls.pending if r not in t.dead]
        strategy, _ = t.quiesce()
        if strategy is Quiesce.ABORT:
            for r in alive:
                t.workers.handles[r].abort.remote()
        elif strategy is Quiesce.KILL_SURVIVORS:
            t.kill_survivors(alive)
        got = t.calls.finish()
        t.absorb(got.values.values())
        now = time.time()
        # Ranks whose run() returned while training (a collective failed at once) count too.
        t.survivor_steps |= {
            r: rep.last_step for r, rep in got.values.items() if isinstance(rep, RunReport)
        }
        # A survivor whose own check found its parameters not finite keeps no usable state:
        # it is restored like a replacement, from state no newer than its last clean step.
        corrupt = {
            r: rep.clean_step or 0
            for r, rep in got.values.items()
            if isinstance(rep, RunReport) and rep.status == "corrupt"
        }
        if corrupt:
            t.suspect_after(min(corrupt.values()))
        gone = got.dead | t.dead | set(corrupt)
        t.survivor_steps = {r: s for r, s in t.survivor_steps.items() if r not in gone}
        survivors = list(t.survivor_steps.values())
        if survivors:
            t.committed, t.furthest = min(survivors), max(survivors)
        # A failure that struck a rank this quiesce killed anyway (kill_survivors) is no new
        # death, but it struck: it is recorded too.
        struck = [
            inj
            for inj in t.chaos.injections()
            if inj.index not in t.timeline.seen_injections
            and not KILL_KINDS.get(inj.kill_kind).leaves_alive
        ]
        if got.dead - t.dead or struck:
            t.detected(got.dead - t.dead)
        t.timeline.quiesced(now, t.committed)
        return Reforming()


@dataclass(frozen=True)
class Reforming(TrialState):
    """Decide how to recover, bring back (or drop) the dead ranks, form a new group."""

    name = "reforming"

    def run(self, t: Trial) -> TrialState:
        group = t.workers
        t.recoveries += 1
        if t.recoveries > t.spec.max_recoveries:
            raise RecoveryError(
                f"gave up after {t.spec.max_recoveries} recoveries (raise max_recoveries)"
            )
        t.phase("reforming")
        plan = decide(
            t.mech, t.failure_context(), continues_without_dead=t.arch.continues_without_dead()
        )
        t.timeline.planned(plan)
        group.kill([r for r in plan.replace if r not in t.dead])
        t.standby.take_ranks(plan, group)
        for r in plan.drop:  # training goes on without them
            t.members.remove(r)
            group.handles.pop(r)
            t.dead.discard(r)
        cold = [r for r in plan.replace if r not in plan.spares]
        early: list[Any] = []
        generation = None
        if cold:
            t.timeline.reform_part("spawned", time.time())
        if cold and t.spec.reform == "fast":
            starting = group.start_async(cold)
            generation, early = t.reach_early([r for r in t.members if r not in cold])
            died = group.wait_started(starting)
            if died:  # e.g. its node just failed: start it the slow way
                group.start(died)
        else:
            group.start(cold)
        t.timeline.reform_part("replaced", time.time())
        t.dead -= set(plan.replace)
        if plan.grow:  # elastic: replacements start in the background; the group grows later
            t.growth.begin(group.start_async(list(plan.grow)), t.timeline.open)
        t.set_targets()
        got = t.calls.on_all(lambda h, r: h.ready.remote())
        if not got.dead:
            got = t.join_all(generation)
        gather(dict(enumerate(early)))  # done by now (a join waits for its rank's reach)
        if got.dead:
            return failed_ranks(t, got.dead)
        if got.errors:  # a rendezvous timed out: try the whole re-formation again
            return Reforming()
        t.timeline.joined(got.values, replaced=set(cold))
        t.timeline.stamp("reformed", time.time())
        t.cb.after_reform(t.members, plan)
        return Restoring(plan)


@dataclass(frozen=True)
class Restoring(TrialState):
    """Every rank loads the state of `plan.restore_step` (or keeps its own)."""

    plan: RecoveryPlan
    name = "restoring"

    def run(self, t: Trial) -> TrialState:
        plan = self.plan
        t.phase("restoring")
        dead = t.restore(t.instruction(plan), "restore")
        if dead:
            return failed_ranks(t, dead)
        t.mech.after_recovery(dict(t.standby.holders), plan.restore_step)
        t.audit.rolled_back(plan.restore_step)
        if t.restore_at_most is not None:  # the corrupt timeline's checkpoints are not state
            t.mech.discard_after(t.setup.run_dir, plan.restore_step)
            t.restore_at_most = None
        done = t.timeline.restored(plan, time.time())
        t.cb.after_restore(done, plan)
        t.committed = plan.restore_step
        t.cb.after_live_ranks(len(t.members))
        t.phase("resuming")
        return Training()


@dataclass(frozen=True)
class Regrowing(TrialState):
    """Elastic: the replacements are up; stop at a step boundary and take them back in."""

    name = "regrowing"

    def run(self, t: Trial) -> TrialState:
        t.growth.regrowing(time.time())
        t.phase("regrowing")
        group = t.workers
        for h in group.handles.values():
            h.abort.remote()
        got = t.calls.finish()
        t.absorb(got.values.values())
        if got.dead:
            return failed_ranks(t, got.dead)
        steps = {r: rep.last_step for r, rep in got.values.items()}
        t.committed, t.furthest = min(steps.values()), max(steps.values())
        t.survivor_steps = steps
        grown = t.growth.take()
        died = group.wait_started(grown)
        if died:
            raise RecoveryError(f"rank(s) {died} died while coming back to grow the group")
        t.members = sorted(t.members + list(grown))
        t.set_targets()
        got = t.join_all()
        if got.dead:
            return failed_ranks(t, got.dead)
        if got.errors:
            raise RecoveryError(f"growing back failed: {next(iter(got.errors.values()))}")
        plan = t.mech.grow_plan(t.failure_context(), tuple(grown))
        dead = t.restore(t.instruction(plan), "growing back")
        if dead:
            return failed_ranks(t, dead)
        t.growth.grown(time.time())
        t.committed = plan.restore_step
        t.cb.after_live_ranks(len(t.members))
        t.cb.after_regrow(t.members)
        return Training()


@dataclass(frozen=True)
class Finishing(TrialState):
    """Training is done: check the final state (see `final_check`)."""

    name = "finishing"

    def run(self, t: Trial) -> TrialState:
        got = t.calls.on_all(lambda h, r: h.digest.remote())
        if got.dead or got.errors:
            raise RecoveryError(f"computing the final digest failed: {got.errors or got.dead}")
        final = check(t.layout, got.values, independent_replicas=t.arch.independent_replicas)
        o = t.outcome
        o.params_digest, o.state_bytes_per_rank = final.digest, final.state_bytes_per_rank
        o.arch_metrics, o.replica_spread = final.arch_metrics, final.replica_spread
        o.members = list(t.members)
        undetected = [
            inj
            for inj in (t.chaos.injections() if t.setup.events else [])
            if inj.index not in t.timeline.seen_injections
        ]
        o.silently_diverged = [
            {"kind": inj.kill_kind, "ranks": inj.ranks, "step": inj.step, "trigger": inj.trigger}
            for inj in undetected
            if KILL_KINDS.get(inj.kill_kind).corrupts
        ]
        o.slowed = [
            (inj.t_injected, inj.t_injected + inj.lasts_s)
            for inj in undetected
            if inj.lasts_s is not None
        ]
        # Replicas that disagree are the expected end of an undetected corruption, not an error.
        if final.error is not None and not o.silently_diverged:
            o.error = final.error
        return Finished()


@dataclass(frozen=True)
class Finished(TrialState):
    name = "finished"
    terminal = True

    def run(self, t: Trial) -> TrialState:
        return self


@dataclass(frozen=True)
class Failed(TrialState):
    error: str
    name = "failed"
    terminal = True

    def run(self, t: Trial) -> TrialState:
        return self
