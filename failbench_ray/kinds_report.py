"""The report's "Fault kinds" table: which mechanisms recovered from which kinds of failure,
what found each failure and how fast. Pure: it reads the cells' results."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from failbench_ray import markdown
from failbench_ray.results import ExperimentResult


@dataclass
class KindRow:
    mechanism: str
    kind: str
    trials: int = 0  # faulty trials with at least one failure of this kind
    completed: int = 0  # of which ran to the last step
    exact_expected: int = 0  # of which the oracle expects the baseline's bits
    exact: int = 0  # of those, how many ended bit-equal to it
    detectors: set[str] = field(default_factory=set)
    detected_s: list[float] = field(default_factory=list)
    silent: int = 0  # trials where a corruption of this kind was never detected


def kind_rows(cells: Iterable[tuple[str, ExperimentResult]]) -> list[KindRow]:
    """One row per mechanism x kill kind over `(mechanism, result)` pairs, in name order."""
    rows: dict[tuple[str, str], KindRow] = {}
    for mechanism, result in cells:
        for t in result.trials:
            silent = {d["kind"] for d in getattr(t, "silently_diverged", None) or []}
            for kind in sorted({f.kill_kind for f in t.failures} | silent):
                row = rows.setdefault((mechanism, kind), KindRow(mechanism, kind))
                row.trials += 1
                row.silent += kind in silent
                row.completed += t.status == "completed"
                if t.match_expected:
                    row.exact_expected += 1
                    row.exact += t.matches_baseline is True
            for f in t.failures:
                row = rows[(mechanism, f.kill_kind)]
                row.detectors.add(f.detector)
                if f.phases.detected_s is not None:
                    row.detected_s.append(f.phases.detected_s)
    return [rows[k] for k in sorted(rows)]


def table(rows: list[KindRow]) -> tuple[list[str], list[list[str]]]:
    head = [
        "mechanism",
        "kind",
        "detected by",
        "median detected (s)",
        "trials completed",
        "bit-exact where expected",
        "silently diverged",
    ]
    body = [
        [
            r.mechanism,
            r.kind,
            ", ".join(sorted(r.detectors)) or "-",
            f"{statistics.median(r.detected_s):.3f}" if r.detected_s else "-",
            f"{r.completed}/{r.trials}",
            f"{r.exact}/{r.exact_expected}" if r.exact_expected else "not expected",
            f"{r.silent}/{r.trials}" if r.silent else "-",
        ]
        for r in rows
    ]
    return head, body


def section(
    cells: Iterable[tuple[str, ExperimentResult]],
) -> tuple[list[str], list[str], list[list[str]]]:
    """The report's section: its markdown lines, and the table's head and body (for HTML)."""
    head, body = table(kind_rows(cells))
    md = [
        "## Fault kinds",
        "Which mechanisms recovered from which kinds of failure (`failbench list` shows the "
        'kinds), what found them, and how long after the injection. "Silently diverged": '
        "trials where a corruption was never detected (its check off, or no replica to compare "
        "with) and the run ended on wrong numbers.",
        "",
        *markdown.table(head, body),
    ]
    return md, head, body
