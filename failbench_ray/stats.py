"""Is a trial's loss progress different from its baseline's? Tested, not eyeballed.

A run's loss curve is its steps in the order they ran (a rollback runs steps again), each with
the wall-clock time since the run's first step, the samples consumed so far (repeated steps
count again: that is the work the failure cost) and the loss (mean over ranks). Trial and
baseline are compared at matched points, by wall-clock time or by samples: the losses of the
steps in a window around the point, pooled over the group's runs, go into Welch's t-test, and
the answer is the difference of means with its 95% interval, or "no detectable difference".
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats as sps

from failbench_ray.records import StepRecord

Axis = Literal["wall_s", "samples"]


@dataclass(frozen=True)
class Curve:
    wall_s: np.ndarray  # since the run's first step began, at each step's end
    samples: np.ndarray  # consumed so far, at each step's end
    loss: np.ndarray

    def axis(self, by: Axis) -> np.ndarray:
        return self.wall_s if by == "wall_s" else self.samples


def curve(records: Sequence[StepRecord]) -> Curve:
    """The loss curve of one run from its step records (every rank's)."""
    steps: dict[tuple[int, int], list[StepRecord]] = defaultdict(list)
    for r in records:
        steps[(r.generation, r.step)].append(r)
    if not steps:
        empty = np.array([], dtype=float)
        return Curve(empty, empty, empty)
    t0 = min(r.t_start for r in records)
    ordered = sorted(steps.values(), key=lambda rs: max(r.t_end for r in rs))
    wall = np.array([max(r.t_end for r in rs) - t0 for rs in ordered])
    samples = np.cumsum([sum(r.samples for r in rs) for rs in ordered]).astype(float)
    loss = np.array([_mean_seen([r.loss for r in rs]) for rs in ordered])
    return Curve(wall, samples, loss)


def _mean_seen(losses: list[float]) -> float:
    """The mean over the ranks that see the loss (inner pipeline stages and parameter
    servers report NaN); NaN if none does."""
    seen = [x for x in losses if np.isfinite(x)]
    return float(np.mean(seen)) if seen else float("nan")


@dataclass(frozen=True)
class Comparison:
    by: Axis
    at: float  # the matched point (seconds or samples)
    n_trial: int  # steps in the window, over every trial run
    n_baseline: int
    difference: float | None  # mean trial loss - mean baseline loss
    ci95: tuple[float, float] | None
    p_value: float | None
    verdict: str  # "lower", "higher", "no detectable difference", or why there is no answer


def _verdict(diff: float) -> str:
    return "lower" if diff < 0 else "higher"


def _window(curves: Sequence[Curve], by: Axis, lo: float, hi: float) -> np.ndarray:
    parts = [c.loss[(c.axis(by) >= lo) & (c.axis(by) <= hi)] for c in curves]
    return np.concatenate(parts) if parts else np.array([], dtype=float)


def compare(
    trials: Sequence[Curve],
    baselines: Sequence[Curve],
    by: Axis,
    at: float,
    half_width: float,
    alpha: float = 0.05,
) -> Comparison:
    """Trial vs baseline loss at `at` (steps within `half_width` of it), Welch's t-test."""
    a = _window(trials, by, at - half_width, at + half_width)
    b = _window(baselines, by, at - half_width, at + half_width)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        why = "the loss is not finite in the window (a run diverged)"
        return Comparison(by, at, len(a), len(b), None, None, None, why)
    if len(a) < 2 or len(b) < 2:
        return Comparison(by, at, len(a), len(b), None, None, None, "too few steps to compare")
    diff = float(a.mean() - b.mean())
    if np.ptp(a) == 0 and np.ptp(b) == 0:  # identical constant windows: no variance to test
        verdict = _verdict(diff) if diff else "no detectable difference"
        return Comparison(by, at, len(a), len(b), diff, (diff, diff), None, verdict)
    test = sps.ttest_ind(a, b, equal_var=False)
    ci = test.confidence_interval(1 - alpha)
    p = float(test.pvalue)
    verdict = _verdict(diff) if p < alpha else "no detectable difference"
    return Comparison(by, at, len(a), len(b), diff, (float(ci.low), float(ci.high)), p, verdict)


def progress(
    trials: Sequence[Curve], baselines: Sequence[Curve], by: Axis, points: int = 4
) -> list[Comparison]:
    """Comparisons at `points` evenly spaced points of the span every run covers (e.g. at
    25/50/75/100% of the shortest run's wall time), each with a window of 5% of the span."""
    runs = [c for c in (*trials, *baselines) if len(c.loss)]
    if not trials or not baselines or not runs:
        return []
    span = min(float(c.axis(by)[-1]) for c in runs)
    # 5% of the span, and at least about 3 steps each side (short runs)
    spacing = statistics.median(
        float(np.median(np.diff(c.axis(by)))) for c in runs if len(c.loss) > 1
    )
    half = max(0.05 * span, 3 * spacing)
    return [
        compare(
            trials, baselines, by, span * (i + 1) / points - (half if i + 1 == points else 0), half
        )
        for i in range(points)
    ]
