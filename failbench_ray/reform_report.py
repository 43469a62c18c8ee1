"""The report's view of re-formation: where its time went in each cell, and the paper's first
claim checked separately in each re-formation regime (`ExperimentSpec.reform`) a sweep ran.

The paper: "when process-group re-formation takes seconds, mechanisms differ more in runtime
overhead than restore speed". Whether that holds depends on how long re-formation takes, so the
claim is stated per regime, with the numbers it rests on, never as one verdict for all.
Pure functions of the results (tested without Ray).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from failbench_ray.records import REFORM_PARTS
from failbench_ray.results import FailureResult, TrialResult

# The spans between quiesced, each of `records.REFORM_PARTS`, and reformed.
PART_SPANS: tuple[str, ...] = (
    "replacement",
    "rendezvous",
    "connect",
    "first collective",
    "trainer",
)


def regime(spec: dict[str, Any]) -> str:
    """The re-formation regime an experiment ran under (results stored before the field
    existed ran the standard one)."""
    return str(spec.get("reform", "standard"))


def part_spans(f: FailureResult) -> dict[str, float | None]:
    """How long each part of one failure's re-formation took (None where a bound is missing)."""
    parts = f.reform.model_dump()
    ends = [f.phases.quiesced_s, *(parts[f"{p}_s"] for p in REFORM_PARTS), f.phases.reformed_s]
    spans = [b - a if a is not None and b is not None else None for a, b in pairwise(ends)]
    return dict(zip(PART_SPANS, spans, strict=True))


def startup_span(f: FailureResult) -> float | None:
    """The cold replacements' own start-up inside this recovery: from when the driver asked
    for their processes to when they were up (None where no new process was made)."""
    a, b = f.reform.spawned_s, f.reform.replaced_s
    return b - a if a is not None and b is not None else None


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _span(f: FailureResult, start: str, end: str) -> float | None:
    times = f.phases.model_dump()
    a, b = times[f"{start}_s"], times[f"{end}_s"]
    return b - a if a is not None and b is not None else None


def reform_numbers(trials: Sequence[TrialResult], reform: str) -> dict[str, Any]:
    """A cell's medians over its completed failures: re-formation (quiesced -> reformed),
    restore (reformed -> restored) and each part of re-formation; `reform` is its regime."""
    failures = [f for t in trials if t.status == "completed" for f in t.failures]
    spans: dict[str, list[float]] = defaultdict(list)
    for f in failures:
        for name, v in part_spans(f).items():
            if v is not None:
                spans[name].append(max(0.0, v))
    reforms = [v for f in failures if (v := _span(f, "quiesced", "reformed")) is not None]
    restore = [v for f in failures if (v := _span(f, "reformed", "restored")) is not None]
    startups = [(f, v) for f in failures if (v := startup_span(f)) is not None]
    beyond = [r - v for f, v in startups if (r := _span(f, "quiesced", "reformed")) is not None]
    return {
        "reform": reform,
        "reform_s": _median(reforms),
        # cold replacements: their start-up inside the recovery, and what re-formation took
        # beyond it (the cost of re-forming itself)
        "startup_s": _median([v for _, v in startups]),
        "beyond_startup_s": _median(beyond),
        "restore_s": _median(restore),
        "reform_parts_s": {p: _median(spans[p]) for p in PART_SPANS},
    }


def _per_mechanism(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    per: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r[key] is not None:
            per[r["mechanism"]].append(r[key])
    return {m: statistics.median(v) for m, v in per.items()}


def _range_text(values: dict[str, float], unit: str) -> tuple[str, float] | None:
    if len(values) < 2:
        return None
    lo, hi = min(values, key=values.__getitem__), max(values, key=values.__getitem__)
    text = f"{values[lo]:.3g}{unit} ({lo}) to {values[hi]:.3g}{unit} ({hi})"
    return text, values[hi] - values[lo]


def first_claim(rows: list[dict[str, Any]]) -> list[str]:
    """The paper's first claim, once per regime that has cells with a mechanism and a failure:
    how long re-formation took, how far restore times and overheads range across mechanisms,
    and whether the spread of restore times is smaller than re-formation itself (then restore
    speed hides behind re-formation, as the paper found)."""
    by_regime: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["mechanism"] != "none" and r["trials"] and r["reform_s"] is not None:
            by_regime[r["reform"]].append(r)
    out: list[str] = []
    hidden: dict[str, bool] = {}
    for name in sorted(by_regime, key=lambda n: (n != "standard", n)):  # today's first
        rs = by_regime[name]
        reform = statistics.median(r["reform_s"] for r in rs)
        spread = _range_text(_per_mechanism(rs, "reform_s"), " s")
        restore = _range_text(_per_mechanism(rs, "restore_s"), " s")
        overhead = _range_text(_per_mechanism(rs, "overhead_pct"), "%")
        text = (
            f"The paper's first claim, re-formation `{name}` ({len(rs)} cells): re-formation "
            f"took a median {reform:.3g} s" + (f", from {spread[0]}" if spread else "")
        )
        if restore is not None:
            hidden[name] = restore[1] < reform
            text += (
                f"; restore times range from {restore[0]}, a spread of {restore[1]:.3g} s, "
                + ("smaller" if hidden[name] else "not smaller")
                + " than re-formation"
            )
        if overhead is not None:
            text += f"; overheads range from {overhead[0]}"
        if all(r["trials"] < 2 for r in rs):
            text += "; one trial per cell, so single mechanisms cannot be told apart"
        out.append(text + ".")
    if len(hidden) >= 2:
        verdicts = set(hidden.values())
        out.append(
            "Across the regimes, restore speed "
            + (
                "hides behind re-formation in every one: the conclusion does not depend on it."
                if verdicts == {True}
                else "shows through in none: the conclusion does not depend on it."
                if verdicts == {False}
                else "hides behind re-formation only in "
                + ", ".join(f"`{n}`" for n, v in hidden.items() if v)
                + ": the paper's conclusion depends on how fast the group re-forms."
            )
        )
    return out


def parts_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Per cell, the median seconds of each part of re-formation."""
    head = [
        "cell",
        "re-formation s",
        *[f"{p} s" for p in PART_SPANS],
        "of which start-up s",
        "restore s",
    ]
    body = []
    for r in rows:
        if r["reform_s"] is None:
            continue
        parts = r["reform_parts_s"]
        body.append(
            [
                r["cell"],
                _fmt(r["reform_s"]),
                *[_fmt(parts[p]) for p in PART_SPANS],
                _fmt(r.get("startup_s")),
                _fmt(r["restore_s"]),
            ]
        )
    return head, body


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"
