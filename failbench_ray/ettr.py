"""The effective training time ratio (ETTR, Kokolis et al., HPCA 2025) of one trial, measured
from its step and failure records, with where the rest of the wall time went.

Definitions (the README's, exactly):
- the wall time W runs from the start of the first step to the end of the last;
- a step *counts* in its final execution (its records in the last generation that ran it, as
  in `results.sample_accounting`); its useful time is the shortest of those records' times
  with the after-step hook's blocking (`blocked_s`: a checkpoint or copy the step waited for)
  taken off: ranks that train side by side count once, and a rank that spent the step waiting
  for another's save (in the next collective) was not training;
- ETTR = the counted steps' useful time / W.

The rest of W, in `breakdown` (seconds): `checkpoint_stall_s` (the counted steps' blocking),
`replayed_s` (executions a rollback threw away, each its longest record), `lost_in_flight_s`
(from the end of the last step done before a failure to the failure: work that died with it),
`down_<phase>_s` (each recovery phase, from the failure records: to detection, quiesce,
re-formation, restore, resume; and an elastic group's regrow, when training stops to take the
grown ranks back; seconds two overlapping recoveries spend down count once), and `other_s`
(what none of these explain: the first steps after a recovery catching up, a smaller group
training, gaps between steps; overlaps make it negative).
`steady`: the median step's useful time, the median gap between two consecutive steps beyond
it (the driver's and the collectives' share), and the stall per step: what a calibration run
gives the model, robust to the first steps' warm-up.
Pure; tested without Ray.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from failbench_ray.records import FailureRecord, StepRecord

# (phase, the earlier mark it is measured from); None: the injection itself
DOWN_PHASES = (
    ("detect", None, "detected"),
    ("quiesce", "detected", "quiesced"),
    ("reform", "quiesced", "reformed"),
    ("restore", "reformed", "restored"),
    ("resume", "restored", "resumed"),
)
# An elastic group's second pause per failure: training stops to take the grown ranks back.
REGROW = ("regrow", "regrowing", "grown")


@dataclass
class _Executions:
    """Each step's final execution (useful time, stall, when it ended on every rank) and what
    earlier executions, rolled back, took."""

    final_gen: dict[int, int] = field(default_factory=dict)
    useful: dict[int, float] = field(default_factory=dict)
    stall: dict[int, float] = field(default_factory=dict)
    done: dict[int, float] = field(default_factory=dict)
    replayed: dict[tuple[int, int], float] = field(default_factory=lambda: defaultdict(float))

    @classmethod
    def of(cls, records: Sequence[StepRecord]) -> _Executions:
        ex = cls()
        for r in records:
            ex.final_gen[r.step] = max(ex.final_gen.get(r.step, r.generation), r.generation)
        for r in records:
            took = r.t_end - r.t_start
            if r.generation == ex.final_gen[r.step]:
                ex.useful[r.step] = min(ex.useful.get(r.step, took), took - r.blocked_s)
                ex.stall[r.step] = max(ex.stall.get(r.step, 0.0), r.blocked_s)
                ex.done[r.step] = max(ex.done.get(r.step, r.t_end), r.t_end)
            else:
                key = (r.step, r.generation)
                ex.replayed[key] = max(ex.replayed[key], took)
        return ex

    def steady(self) -> dict[str, float | None]:
        """Robust to the first steps' warm-up: the median step, and the median wall time
        between two consecutive counted steps of one generation beyond the later's own."""
        gaps = [
            self.done[s] - self.done[s - 1] - self.useful[s] - self.stall[s]
            for s in sorted(self.done)
            if s - 1 in self.done and self.final_gen[s - 1] == self.final_gen[s]
        ]
        mean = sum(self.stall.values()) / len(self.stall)
        # the steps that saved: those blocked longer than the mean (the others block ~0)
        stalls = [v for v in self.stall.values() if v > 0 and v >= mean]
        return {
            "step_s": statistics.median(self.useful.values()),
            "gap_s": statistics.median(gaps) if gaps else 0.0,
            "stall_s_per_step": mean,
            # the median blocking of a save (robust to the first ones, which are slower)
            "stall_s_median": statistics.median(stalls) if stalls else 0.0,
            "stall_s_per_step_settled": self._settled_stall(mean),
        }

    def _settled_stall(self, mean: float) -> float | None:
        """The mean stall per step over whole save periods after the first third of the run
        (from one save to a later one): what saves cost once warm, every kind of save that
        a mechanism makes (e.g. copies every 5 steps and a disk save every 20) in its share.
        None where fewer than two saves came after the first third."""
        steps = sorted(self.stall)
        late = [s for s in steps[len(steps) // 3 :] if self.stall[s] > 0 and self.stall[s] >= mean]
        if len(late) < 2:
            return None
        window = [self.stall[s] for s in steps if late[0] < s <= late[-1]]
        return sum(window) / len(window)


def _downtime(
    records: Sequence[StepRecord], failures: Sequence[FailureRecord], t0: float
) -> tuple[float, dict[str, float]]:
    """The work in flight the failures took, and each recovery phase's total downtime."""
    ends = sorted(r.t_end for r in records)
    in_flight = 0.0
    down: dict[str, float] = {name: 0.0 for name, _, _ in (*DOWN_PHASES, REGROW)}
    injected_at = {f.index: f.t_injected for f in failures}
    recovered_at = t0  # when the last recovery before this failure was through
    spans: list[tuple[float, float]] = []  # the downtime counted so far
    pauses: set[tuple[float, float]] = set()
    for f in sorted(failures, key=lambda f: f.t_injected):
        before = [t for t in ends if t <= f.t_injected]
        # nothing was in flight while a regrow pause held training (up to its end)
        paused = [min(end, f.t_injected) for start, end in pauses if start <= f.t_injected]
        if before:
            in_flight += max(0.0, f.t_injected - max(before[-1], recovered_at, *paused))
        for name, start, end in DOWN_PHASES:
            t_end = f.phases.get(end)
            t_start = 0.0 if start is None else f.phases.get(start)
            if t_start is None:
                continue
            if t_end is None and f.interrupted_by in injected_at:
                # cut short in this phase: it lasted until the failure that cut it
                t_end = injected_at[f.interrupted_by] - f.t_injected
            if t_end is None:
                continue
            # a failure during another's recovery is recovered from with it: the seconds both
            # spend down count once, in the earlier one's phase
            begin, until = max(f.t_injected + t_start, recovered_at), f.t_injected + t_end
            if until > begin:
                down[name] += until - begin
                spans.append((begin, until))
            recovered_at = max(recovered_at, until)
        began, grown = f.phases.get(REGROW[1]), f.phases.get(REGROW[2])
        if began is not None and grown is not None:
            pauses.add((f.t_injected + began, f.t_injected + grown))  # one regrow takes many
    # a regrow pause counts where no recovery was already counted (a failure during it)
    down[REGROW[0]] = _uncovered(sorted(pauses), spans)
    return in_flight, down


def _uncovered(intervals: list[tuple[float, float]], spans: list[tuple[float, float]]) -> float:
    """Seconds of the union of `intervals` (sorted by start) outside every one of `spans`."""
    total, reached = 0.0, -math.inf
    for start, end in intervals:
        start = max(start, reached)
        if end <= start:
            continue
        reached = end
        total += end - start
        total -= sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)
    return total


def measure(records: Sequence[StepRecord], failures: Sequence[FailureRecord]) -> dict[str, Any]:
    """{"ettr", "wall_s", "useful_s", "breakdown", "steady"}; ettr None with no records."""
    if not records:
        return {"ettr": None, "wall_s": None, "useful_s": None, "breakdown": {}, "steady": {}}
    t0 = min(r.t_start for r in records)
    wall = max(r.t_end for r in records) - t0
    ex = _Executions.of(records)
    in_flight, down = _downtime(records, failures, t0)
    useful_s = sum(ex.useful.values())
    breakdown = {
        "checkpoint_stall_s": sum(ex.stall.values()),
        "replayed_s": sum(ex.replayed.values()),
        "lost_in_flight_s": in_flight,
        **{f"down_{name}_s": s for name, s in down.items()},
    }
    breakdown["other_s"] = wall - useful_s - sum(breakdown.values())
    return {
        "ettr": useful_s / wall if wall > 0 else None,
        "wall_s": wall,
        "useful_s": useful_s,
        "breakdown": breakdown,
        "steady": ex.steady(),
    }
