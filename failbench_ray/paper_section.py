"""The report's "Paper vs this run" section: the verdicts of `failbench_ray.paper` as a
table, the measurements behind each claim that does not hold, and one figure per claim."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from failbench_ray import markdown, paper


@dataclass
class Section:
    head: list[str]
    body: list[list[str]]
    notes: list[str]  # the A2 choice, then why each failing claim fails
    figures: list[str]
    verdicts: list[paper.Verdict]

    def markdown(self) -> list[str]:
        return [
            self.notes[0],
            "",
            *markdown.table(self.head, self.body),
            *self.notes[1:],
            *[f"![{name}]({name})" for name in self.figures],
            "",
        ]

    def json(self) -> list[dict[str, Any]]:
        keys = ("claim", "text", "paper", "ours", "cells", "verdict", "reason")
        return [{k: getattr(v, k) for k in keys} for v in self.verdicts]


def section(rows: list[dict[str, Any]], out: Path) -> Section:
    a2_why, verdicts = paper.compare(rows)
    head, body = paper_table(verdicts)
    notes = [f"{paper.PAPER_NOTE} {a2_why}", *why_not(verdicts, rows)]
    return Section(head, body, notes, list(claim_figures(verdicts, out).values()), verdicts)


def paper_table(verdicts: list[paper.Verdict]) -> tuple[list[str], list[list[str]]]:
    head = ["claim", "the paper", "this run (mean [95% CI], n)", "cells", "verdict", "why"]
    body = [
        [f"{v.claim}: {v.text}", v.paper, v.ours, ", ".join(v.cells) or "-", v.verdict, v.reason]
        for v in verdicts
    ]
    return head, body


def why_not(verdicts: list[paper.Verdict], rows: list[dict[str, Any]]) -> list[str]:
    """For each claim that does not hold: what its cells measured."""
    out = []
    for v in verdicts:
        if v.verdict == paper.FAILS and (lines := paper.explain(v, rows)):
            out += [f"Why claim {v.claim} ({v.text}) does not hold here, from what was measured:"]
            out += [f"- {line}" for line in lines] + [""]
    return out


def claim_figures(verdicts: list[paper.Verdict], out: Path) -> dict[int, str]:
    """One figure per claim of the paper: this run's means with their 95% intervals, by
    mechanism or architecture, the paper's figure marked where it gave one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: dict[int, str] = {}
    for claim in sorted({v.claim for v in verdicts}):
        panels = [v for v in verdicts if v.claim == claim and v.plot]
        if not panels:
            continue
        cols = min(2, len(panels))  # two across: at most ~1,000 px wide
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.2 * rows), squeeze=False)
        for ax, v in zip(axes.flat, panels, strict=False):
            claim_panel(ax, v)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        theirs = "shaded: the paper's 3.7% to 176%" if claim == 3 else "red x: the paper's"
        fig.suptitle(f"Paper claim {claim} vs this run\n(95% intervals; {theirs})", fontsize=10)
        names[claim] = save(fig, out / f"paper_claim{claim}.png")
    return names


def claim_panel(ax: Any, v: paper.Verdict) -> None:
    labels = sorted(v.plot, key=lambda k: v.plot[k][0].mean)
    for y, label in enumerate(labels):
        est, theirs = v.plot[label]
        lo, hi = est.ci95 or (est.mean, est.mean)
        ax.errorbar(est.mean, y, xerr=[[est.mean - lo], [hi - est.mean]], fmt="o", color="C0")
        if theirs is not None:
            ax.plot(theirs, y, "x", color="red", markersize=9, mew=2)
    if v.unit == "%":  # where no change would be
        ax.axvline(0, color="grey", lw=0.8)
    if v.claim == 3:  # the paper's range across architectures
        ax.axvspan(3.7, 176, color="red", alpha=0.08)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(-0.7, len(labels) - 0.3)
    ax.set_xlabel(v.unit.strip() or "ratio")
    ax.set_title(textwrap.fill(f"{v.text}: {v.verdict}", 48), fontsize=8)


def save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
