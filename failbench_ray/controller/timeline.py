"""The recovery timeline: every failure of a trial and when each of its recovery phases ended.

Pure bookkeeping (tested without Ray): the states tell it what they saw and when; it keeps the
`FailureRecord`s the result is made of. Phase times are seconds after the injection.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from failbench_ray.comm import JoinTimes
from failbench_ray.records import FailureRecord
from failbench_ray.spec import Quiesce
from injector.chaos import Injection
from mechanisms.base import RecoveryPlan


def replacement(plan: RecoveryPlan) -> str:
    """How the ranks a plan brings back are brought back: standbys that already run
    ("warm"), new processes started now ("cold"), or none (training goes on without them)."""
    back = set(plan.replace) | set(plan.grow)
    if not back:
        return "none"
    return "warm" if back <= set(plan.spares) else "cold"


@dataclass
class RecoveryTimeline:
    # How this trial quiesces, with the reason when it is not what the spec asked.
    quiesce: tuple[Quiesce, str]
    failures: list[FailureRecord] = field(default_factory=list)
    open: list[FailureRecord] = field(default_factory=list)  # recovery not done yet
    seen_injections: set[int] = field(default_factory=set)
    injected_ranks: set[int] = field(default_factory=set)

    def detected(
        self,
        injections: list[Injection],
        dead: set[int],
        known_dead: set[int],
        t_detect: float,
        detector: str = "death",
    ) -> list[FailureRecord]:
        """Ranks in `dead` were found dead (or hung) at `t_detect` by `detector`: a failure
        per new injection in the chaos actor's log, or one "unplanned" failure for ranks no
        injection names. A failure detected while others recover interrupts them
        (cascading)."""
        new: list[FailureRecord] = []
        for inj in injections:
            if inj.index in self.seen_injections:
                continue
            self.seen_injections.add(inj.index)
            step = inj.step if inj.step is not None else -1
            new.append(self._failure(inj.ranks, inj.kill_kind, inj.trigger, step, inj.t_injected))
        self.injected_ranks |= {r for f in new for r in f.ranks}
        unplanned = sorted(dead - self.injected_ranks - known_dead)
        if unplanned and not new:
            new.append(self._failure(unplanned, "unplanned", "crash", -1, t_detect))
        for f in new:
            f.phases["detected"] = t_detect - f.t_injected
            f.detector = detector
            for old in self.open:
                old.interrupted_by = (
                    old.interrupted_by if old.interrupted_by is not None else f.index
                )
        self.open += new
        return new

    def _failure(
        self, ranks: list[int], kind: str, trigger: str, step: int, t: float
    ) -> FailureRecord:
        f = FailureRecord(
            index=len(self.failures),
            ranks=list(ranks),
            kill_kind=kind,
            trigger=trigger,
            injected_at_step=step,
            t_injected=t,
        )
        strategy, f.quiesce_reason = self.quiesce
        f.quiesce = strategy.value
        self.failures.append(f)
        return f

    def stamp(self, phase: str, t: float) -> None:
        """`phase` ended at `t` for every open failure (the first time only)."""
        for f in self.open:
            if f.phases.get(phase) is None:
                f.phases[phase] = t - f.t_injected

    def reform_part(self, part: str, t: float) -> None:
        """A part of re-formation (`records.REFORM_PARTS`) ended at `t` (the first time only)."""
        for f in self.open:
            if f.reform.get(part) is None:
                f.reform[part] = t - f.t_injected

    def joined(self, times: Mapping[int, JoinTimes], replaced: Collection[int] = ()) -> None:
        """Every member joined the new group: each part ended when the last rank finished it.
        `survivors`: when the last of the ranks not `replaced` had reached the store (before
        `replaced` where the fast re-formation overlapped it with the replacements' start)."""
        got = list(times.values())
        if not got:
            return
        kept = [j.reached for r, j in times.items() if r not in replaced and j.reached]
        if replaced and kept:
            self.reform_part("survivors", max(kept))
        self.reform_part("rendezvous", max(j.arrived for j in got))
        self.reform_part("connected", max(j.connected for j in got))
        self.reform_part("collective", max(j.collective for j in got))

    def quiesced(self, t: float, committed: int) -> None:
        """Failures injected at no known step (a phase or a timer) hit the step in flight."""
        self.stamp("quiesced", t)
        for f in self.open:
            if f.injected_at_step < 0:
                f.injected_at_step = committed + 1

    def planned(self, plan: RecoveryPlan) -> None:
        for f in self.open:
            f.replacement = replacement(plan)

    def restored(self, plan: RecoveryPlan, t: float) -> list[FailureRecord]:
        """The open failures are recovered from `plan.restore_step`; returns them, closed."""
        self.stamp("restored", t)
        done, self.open = self.open, []
        for f in done:
            f.restored_from_step = plan.restore_step
            f.restore_source = f"{plan.source}: {plan.note}" if plan.note else plan.source
        return done

    def failure_step(self, committed: int) -> int:
        """The step in flight when the latest open failures hit."""
        return max([f.injected_at_step for f in self.open] or [committed + 1])
