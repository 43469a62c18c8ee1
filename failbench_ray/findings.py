"""What the report may state from a sweep's cells, and nothing more than its statistics support.

A finding compares samples, never medians alone: per trial (overhead, time to the baseline's
loss, the throughput ratio around the failure) or per failure (time to resumed). Rules:
- a mechanism is "best" only where its 95% interval lies wholly below every other candidate's;
  otherwise the candidates whose intervals overlap the lowest are "not distinguishable";
- an overhead whose interval holds zero is "no detectable overhead";
- a throughput change is a finding only where its interval excludes no change;
- a cell with one trial has no interval: it is marked, and no finding comes from it.
Pure functions of the report's rows (tested without Ray).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scipy import stats as sps

from failbench_ray.results import FailureResult, TrialResult

MIN_TRIALS = 2  # below this a cell has no interval and yields no finding
ONE_TRIAL_MARK = "†"

# (row key of the samples, what it measures, unit, grouped by trace too)
MEASURES: tuple[tuple[str, str, str, bool], ...] = (
    ("overhead_samples", "steady-state overhead", "%", False),
    ("resumed_samples", "time from the kill to training again", " s", True),
    ("to_base_samples", "time to reach the baseline's final loss", " s", True),
)


@dataclass(frozen=True)
class Estimate:
    """A mean with its 95% t-interval (None below two samples) and n."""

    mean: float
    ci95: tuple[float, float] | None
    n: int

    def text(self, unit: str) -> str:
        if self.ci95 is None:
            return f"{self.mean:.3g}{unit}, n={self.n}"
        lo, hi = self.ci95
        return f"{self.mean:.3g}{unit} [{lo:.3g}, {hi:.3g}], n={self.n}"

    def holds(self, value: float) -> bool:
        return self.ci95 is not None and self.ci95[0] <= value <= self.ci95[1]


def estimate(
    values: Sequence[float], extra_var: float = 0.0, extra_df: float = math.inf
) -> Estimate | None:
    """The mean of `values` with its 95% t-interval. `extra_var` is the variance of a part
    every value shares (an overhead's baseline mean step time), with `extra_df` degrees of
    freedom: the interval widens by it, with Welch-Satterthwaite's degrees of freedom."""
    if not values:
        return None
    mean = statistics.fmean(values)
    n = len(values)
    if n < 2:
        return Estimate(mean, None, n)
    own = statistics.variance(values) / n
    total = own + extra_var
    if total == 0:
        return Estimate(mean, (mean, mean), n)
    df = total**2 / (own**2 / (n - 1) + (extra_var**2 / extra_df if extra_var else 0.0))
    half = float(sps.t.ppf(0.975, df)) * math.sqrt(total)
    return Estimate(mean, (mean - half, mean + half), n)


def baseline_noise(base_steps: Sequence[float], overhead_pct: float) -> tuple[float, float]:
    """What the baseline's own noise adds to an overhead's variance (in %^2), and its degrees
    of freedom. Every trial of a cell is compared with one baseline run: the uncertainty of its
    mean step time B moves every trial's overhead 100 (T/B - 1) alike, by 100 T/B^2 per second
    (delta method, T = B (1 + overhead/100)), so it is no part of the trials' own spread."""
    if len(base_steps) < 2:
        return 0.0, math.inf
    b = statistics.fmean(base_steps)
    se = statistics.stdev(base_steps) / math.sqrt(len(base_steps))
    return (100 * (1 + overhead_pct / 100) * se / b) ** 2, len(base_steps) - 1.0


def pooled(rows: Sequence[dict[str, Any]], key: str) -> Estimate | None:
    """The estimate of `key`'s samples over `rows`; overheads carry each row's baseline noise
    (`overhead_base_var`, `overhead_base_df`) into the pooled mean's interval."""
    values = [v for r in rows for v in r[key]]
    if key != "overhead_samples" or not values:
        return estimate(values)
    n = len(values)
    extra = sum(len(r[key]) ** 2 * r.get("overhead_base_var", 0.0) for r in rows) / n**2
    df = min([r.get("overhead_base_df", math.inf) for r in rows if r[key]] or [math.inf])
    return estimate(values, extra, df)


def samples(done: Sequence[TrialResult], to_base: Sequence[float | None]) -> dict[str, Any]:
    """A cell's per-trial and per-failure samples, for the findings (and the JSON result)."""
    failures = [f for t in done for f in t.failures if f.interrupted_by is None]
    ratios = []
    for t in done:
        extra = t.model_extra or {}
        before, after = (
            extra.get("samples_per_s_before_failure"),
            extra.get("samples_per_s_after_recovery"),
        )
        if before and after:
            ratios.append(after / before)
    return {
        "overhead_samples": [t.overhead_pct for t in done if t.overhead_pct is not None],
        "resumed_samples": [f.phases.resumed_s for f in failures if f.phases.resumed_s is not None],
        "restore_samples": _spans(failures, "reformed", "restored"),
        "reform_samples": _spans(failures, "quiesced", "reformed"),
        "to_base_samples": [v for v in to_base if v is not None],
        "throughput_ratios": ratios,
    }


def _spans(failures: Sequence[FailureResult], start: str, end: str) -> list[float]:
    """Each failure's seconds from phase `start` to phase `end` (where both were reached)."""
    out = []
    for f in failures:
        times = f.phases.model_dump()
        a, b = times[f"{start}_s"], times[f"{end}_s"]
        if a is not None and b is not None:
            out.append(b - a)
    return out


def _label(r: dict[str, Any], by_trace: bool) -> str:
    where = f"{r['architecture']}/{r['trace']}" if by_trace else r["architecture"]
    return where if r.get("reform", "standard") == "standard" else f"{where} [{r['reform']}]"


def ranking(per_mech: dict[str, Estimate], label: str, unit: str) -> str | None:
    """The lowest mean is "best" where its interval lies below every other's; else the
    candidates that cannot be told apart from it. Needs two mechanisms with intervals."""
    ok = {m: e for m, e in per_mech.items() if e.ci95 is not None}
    if len(ok) < 2:
        return None
    order = sorted(ok, key=lambda m: ok[m].mean)
    low = ok[order[0]]
    assert low.ci95 is not None
    tied = [m for m in order[1:] if (ci := ok[m].ci95) is not None and ci[0] <= low.ci95[1]]
    if not tied:
        return f"best by {label}: **{order[0]}** ({low.text(unit)})"
    names = ", ".join(f"{m} ({ok[m].text(unit)})" for m in [order[0], *tied])
    return f"by {label}, not distinguishable: {names}"


def best_findings(rows: list[dict[str, Any]]) -> list[str]:
    """Per architecture (and trace, for recovery measures), the best mechanism by each measure,
    only where the intervals separate it."""
    out: list[str] = []
    for key, label, unit, by_trace in MEASURES:
        groups: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
        for r in rows:
            if r["trials"] >= MIN_TRIALS:
                groups[_label(r, by_trace)][r["mechanism"]].append(r)
        for where in sorted(groups):
            ests = {m: e for m, rs in groups[where].items() if (e := pooled(rs, key)) is not None}
            found = ranking(ests, label, unit)
            if found is not None:
                out.append(f"{where}: {found}.")
    return out


def overhead_findings(rows: list[dict[str, Any]]) -> list[str]:
    """Per mechanism (and re-formation regime): where its overhead is not detectable, and how
    far it ranges across architectures where the extremes' intervals separate."""
    per: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["trials"] >= MIN_TRIALS:
            regime = r.get("reform", "standard")
            mech = r["mechanism"] if regime == "standard" else f"{r['mechanism']} [{regime}]"
            per[mech][r["architecture"]].append(r)
    out: list[str] = []
    for mech in sorted(per):
        ests = {
            a: e
            for a, rs in per[mech].items()
            if (e := pooled(rs, "overhead_samples")) and e.ci95 is not None
        }
        if not ests:
            continue
        none = sorted(a for a, e in ests.items() if e.holds(0.0))
        if none:
            out.append(f"{mech}: no detectable overhead on {', '.join(none)} (interval holds 0).")
        if len(ests) < 2:
            continue
        lo = min(ests, key=lambda a: ests[a].mean)
        hi = max(ests, key=lambda a: ests[a].mean)
        lo_ci, hi_ci = ests[lo].ci95, ests[hi].ci95
        assert lo_ci is not None and hi_ci is not None
        if lo_ci[1] < hi_ci[0]:
            out.append(
                f"{mech}'s overhead ranges from {ests[lo].text('%')} ({lo}) to "
                f"{ests[hi].text('%')} ({hi}) across {len(ests)} architectures."
            )
        else:
            out.append(
                f"{mech}'s overhead cannot be told apart across {len(ests)} architectures "
                f"(lowest {lo}, highest {hi}: their intervals overlap)."
            )
    return out


def throughput_finding(r: dict[str, Any]) -> str | None:
    """Where throughput changed after the failure (its interval excludes 1x): whether that
    became loss progress at matched time."""
    est = estimate(r["throughput_ratios"])
    cmp = r["loss_vs_baseline"]
    if r["trials"] < MIN_TRIALS or est is None or est.ci95 is None or est.holds(1.0):
        return None
    moved = "rose" if est.mean > 1 else "fell"
    became = ""
    if moved == "rose" and cmp is not None and cmp.difference is not None:
        became = (
            " and became loss progress (lower loss than the baseline at matched time)"
            if cmp.verdict == "lower"
            else f" and did not become loss progress ({cmp.verdict} at matched time)"
        )
    return f"{r['cell']}: throughput {moved} {est.text('x')} after the failure{became}."


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """Statements computed from the rows of cells with a mechanism (not `none`) that ran."""
    ft = [r for r in rows if r["mechanism"] != "none" and r["trials"]]
    out = best_findings(ft) + overhead_findings(ft)
    out += [f for r in ft if (f := throughput_finding(r)) is not None]
    single = [r for r in ft if r["trials"] < MIN_TRIALS]
    if single:
        out.append(
            f"{len(single)} of {len(ft)} cells ran one trial (marked {ONE_TRIAL_MARK} in the "
            f"table): they have no interval and give no finding; run them with `trials: 3` or more."
        )
    return out
