"""`failbench report`: a sweep's results as `report.md`, `report.html` and PNG figures.

Everything in it is computed from the database: one row per architecture x mechanism x trace
cell (overhead with its 95% interval over trials, recovery phases, lost steps, throughput
around the failure, loss progress against the matched baseline with Welch's test, the oracle's
verdict, state bytes per rank), the cells that were skipped with their reasons, four kinds of
figure, and findings that name the best mechanism per architecture by three measures.
"""

from __future__ import annotations

import html
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy import stats as sps
from sqlalchemy import select

from failbench_ray import stats
from failbench_ray.errors import SweepNotFound
from failbench_ray.records import PHASES, StepRecord
from failbench_ray.results import ExperimentResult
from failbench_ray.storage import repo
from failbench_ray.storage.db import Database
from failbench_ray.storage.tables import Sweep, Trial

SHOWN_PHASES = PHASES[:5]  # detected .. resumed: the stacked bars


@dataclass
class Run:
    """One trial (or baseline) of a cell: its result and its step records."""

    records: list[StepRecord]
    t_injected: list[float]  # wall clock of each failure
    curve: stats.Curve


@dataclass
class Cell:
    architecture: str
    mechanism: str
    trace: str
    status: str
    reason: str | None
    result: ExperimentResult | None = None
    trials: list[Run] = field(default_factory=list)
    baseline: Run | None = None

    @property
    def name(self) -> str:
        return f"{self.architecture}/{self.mechanism}/{self.trace}"


def _run(records: list[StepRecord], t_injected: list[float]) -> Run:
    return Run(records, t_injected, stats.curve(records))


def gather(db: Database, sweep_id: str | None = None) -> tuple[Sweep, list[Cell]]:
    """The sweep (the newest when `sweep_id` is None) and its cells, with what they measured."""
    with db.session() as s:
        if sweep_id is None:
            sweep = s.scalars(select(Sweep).order_by(Sweep.created_at.desc())).first()
            if sweep is None:
                raise SweepNotFound(
                    "", "no sweep in this database: run `failbench sweep FILE` first"
                )
        else:
            sweep = repo.get_sweep(s, sweep_id)
        s.expunge(sweep)
        cells = []
        for c in repo.list_sweep_cells(s, sweep.id):
            cell = Cell(c.architecture, c.mechanism, c.trace, c.status, c.reason)
            if c.experiment_id is not None:
                cell.result = repo.load_result(s, c.experiment_id)
                rows = s.scalars(
                    select(Trial)
                    .where(Trial.experiment_id == c.experiment_id)
                    .order_by(Trial.kind, Trial.index)
                ).all()
                for t in rows:
                    injected = [f.t_injected for f in repo.load_failures(s, t.id)]
                    run = _run(repo.load_step_records(s, t.id), injected)
                    if t.kind == "baseline":
                        cell.baseline = run
                    elif t.status == "completed":
                        cell.trials.append(run)
            cells.append(cell)
    return sweep, cells


# -- the numbers of a cell -------------------------------------------------------------------
def mean_ci(values: list[float]) -> tuple[float | None, tuple[float, float] | None]:
    """Mean and its 95% t-interval (None with a single value)."""
    if not values:
        return None, None
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    half = sps.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, (mean - half, mean + half)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def phase_durations(cell: Cell) -> dict[str, float | None]:
    """Median duration of each phase (from the phase before it) over the cell's failures."""
    out: dict[str, list[float]] = defaultdict(list)
    for t in cell.result.trials if cell.result else []:
        for f in t.failures:
            times = f.phases.model_dump()
            previous = 0.0
            for phase in SHOWN_PHASES:
                v = times.get(f"{phase}_s")
                if v is None:
                    continue
                out[phase].append(max(0.0, v - previous))
                previous = v
    return {p: _median(out[p]) for p in SHOWN_PHASES}


def time_to_loss(run: Run, target: float) -> float | None:
    """Wall seconds from the run's start until its loss (mean of 5 steps) reaches `target`."""
    loss = run.curve.loss
    for i in range(len(loss)):
        window = loss[max(0, i - 4) : i + 1]
        if float(window.mean()) <= target:
            return float(run.curve.wall_s[i])
    return None


def cell_row(cell: Cell) -> dict[str, Any]:
    res = cell.result
    trials = res.trials if res else []
    done = [t for t in trials if t.status == "completed"]
    overhead, ci = mean_ci([t.overhead_pct for t in done if t.overhead_pct is not None])
    extras = [t.model_extra or {} for t in done]
    failures = [f for t in done for f in t.failures]
    resumed = [f.phases.resumed_s for f in failures if f.phases.resumed_s is not None]
    matches = [t.matches_baseline for t in done]
    expected = any(t.match_expected for t in done)
    if not done:
        oracle = "-"
    elif not expected:
        oracle = "not expected"
    else:
        oracle = "exact" if all(m is True for m in matches) else "DIVERGED"
    progress = by_samples = None
    if cell.trials and cell.baseline is not None:
        curves, base = [r.curve for r in cell.trials], [cell.baseline.curve]
        by_wall = stats.progress(curves, base, "wall_s")
        progress = by_wall[-1] if by_wall else None
        # The same samples seen: did the failure cost learning, not only time?
        at_samples = stats.progress(curves, base, "samples")
        by_samples = at_samples[-1] if at_samples else None
    base_final = res.baseline.final_loss if res and res.baseline else None
    to_base = [time_to_loss(r, base_final) for r in cell.trials if base_final is not None]
    return {
        "cell": cell.name,
        "architecture": cell.architecture,
        "mechanism": cell.mechanism,
        "trace": cell.trace,
        "status": cell.status,
        "trials": len(done),
        "overhead_pct": overhead,
        "overhead_ci95": ci,
        "phases_s": phase_durations(cell),
        "resumed_s": _median(resumed),
        "lost_steps": _median([f.lost_steps for f in failures if f.lost_steps is not None]),
        "samples_per_s_before": _median(
            [
                e["samples_per_s_before_failure"]
                for e in extras
                if e.get("samples_per_s_before_failure")
            ]
        ),
        "samples_per_s_after": _median(
            [
                e["samples_per_s_after_recovery"]
                for e in extras
                if e.get("samples_per_s_after_recovery")
            ]
        ),
        "loss_vs_baseline": progress,
        "loss_vs_baseline_samples": by_samples,
        "time_to_baseline_loss_s": _median([t for t in to_base if t is not None]),
        "oracle": oracle,
        "state_bytes_per_rank": _median(
            [e["state_bytes_per_rank"] for e in extras if e.get("state_bytes_per_rank")]
        ),
    }


# -- findings -------------------------------------------------------------------------------
def findings(rows: list[dict[str, Any]]) -> list[str]:
    """Statements computed from the rows (mechanisms other than `none`, completed cells)."""
    ft = [r for r in rows if r["mechanism"] != "none" and r["trials"]]
    out = _best_findings(ft) + _overhead_ranges(ft)
    for r in ft:
        found = _throughput_finding(r)
        if found is not None:
            out.append(found)
    return out


def _best(rs: list[dict[str, Any]], key: str) -> tuple[str, float] | None:
    """The mechanism with the lowest median `key` over `rs`, and that median."""
    per_mech: dict[str, list[float]] = defaultdict(list)
    for r in rs:
        if r[key] is not None:
            per_mech[r["mechanism"]].append(r[key])
    if not per_mech:
        return None
    name = min(per_mech, key=lambda m: statistics.median(per_mech[m]))
    return name, statistics.median(per_mech[name])


def _best_findings(ft: list[dict[str, Any]]) -> list[str]:
    """Per architecture, the best mechanism by each of three measures."""
    out: list[str] = []
    by_arch: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in ft:
        by_arch[r["architecture"]].append(r)
    for arch in sorted(by_arch):
        rs = by_arch[arch]
        parts = []
        for key, label, unit in (
            ("overhead_pct", "steady-state overhead", "%"),
            ("resumed_s", "time from the kill to training again", " s"),
            ("time_to_baseline_loss_s", "time to reach the baseline's final loss", " s"),
        ):
            b = _best(rs, key)
            if b is not None:
                parts.append(f"by {label}: **{b[0]}** ({b[1]:.3g}{unit})")
        if parts:
            out.append(f"{arch}: best " + "; ".join(parts) + ".")
    return out


def _overhead_ranges(ft: list[dict[str, Any]]) -> list[str]:
    """Per mechanism run on two architectures or more, how far its overhead ranges."""
    out: list[str] = []
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in ft:
        if r["overhead_pct"] is not None:
            samples[r["mechanism"]][r["architecture"]].append(r["overhead_pct"])
    for mech in sorted(samples):
        # the median over the traces, as in "best" above
        archs = {a: statistics.median(v) for a, v in samples[mech].items()}
        if len(archs) >= 2:
            lo, hi = min(archs, key=archs.__getitem__), max(archs, key=archs.__getitem__)
            out.append(
                f"{mech}'s overhead ranges from {archs[lo]:.3g}% ({lo}) to {archs[hi]:.3g}% "
                f"({hi}) across {len(archs)} architectures."
            )
    return out


def _throughput_finding(r: dict[str, Any]) -> str | None:
    """Where throughput rose after the failure: whether that became loss progress."""
    before, after, cmp = (
        r["samples_per_s_before"],
        r["samples_per_s_after"],
        r["loss_vs_baseline"],
    )
    if not (before and after and after > before * 1.05 and cmp and cmp.difference is not None):
        return None
    became = (
        "became loss progress (lower loss than the baseline at matched time)"
        if cmp.verdict == "lower"
        else f"did not become loss progress ({cmp.verdict} at matched time)"
    )
    at_samples = r["loss_vs_baseline_samples"]
    if at_samples is not None and at_samples.difference is not None:
        became += f"; at matched samples the loss is {at_samples.verdict}"
    return f"{r['cell']}: throughput rose {after / before:.2f}x after the failure and {became}."


# -- figures --------------------------------------------------------------------------------
def _figures(cells: list[Cell], rows: list[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")

    names: list[str] = []
    shown = [r for r in rows if r["trials"] and any(r["phases_s"].values())]
    if shown:
        names.append(_phases_figure(shown, out))
    archs = sorted({r["architecture"] for r in rows})
    names.append(_heatmap(rows, archs, out))
    for arch in archs:
        mine = [c for c in cells if c.architecture == arch and c.trials]
        if mine:
            names.append(_loss_throughput_figure(arch, mine, out))
    return names


def _phases_figure(shown: list[dict[str, Any]], out: Path) -> str:
    """Stacked bars of the median recovery phases of each cell in `shown`."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(shown)), 4))
    bottom = [0.0] * len(shown)
    for phase in SHOWN_PHASES:
        h = [r["phases_s"][phase] or 0.0 for r in shown]
        ax.bar(range(len(shown)), h, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, h, strict=True)]
    ax.set_xticks(range(len(shown)), [r["cell"] for r in shown], rotation=75, fontsize=7)
    ax.set_ylabel("seconds (median)")
    ax.set_title("Recovery phases")
    ax.legend(fontsize=7)
    return _save(fig, out / "recovery_phases.png")


def _heatmap(rows: list[dict[str, Any]], archs: list[str], out: Path) -> str:
    """The steady-state overhead of each architecture x mechanism (blank: none measured)."""
    import matplotlib.pyplot as plt

    mechs = sorted({r["mechanism"] for r in rows})
    grid = [[math.nan] * len(mechs) for _ in archs]
    for r in rows:
        if r["overhead_pct"] is not None:
            grid[archs.index(r["architecture"])][mechs.index(r["mechanism"])] = r["overhead_pct"]
    fig, ax = plt.subplots(figsize=(1.2 * len(mechs) + 2, 0.6 * len(archs) + 1.5))
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(mechs)), mechs, rotation=45, fontsize=8)
    ax.set_yticks(range(len(archs)), archs, fontsize=8)
    fig.colorbar(im, ax=ax, label="steady-state overhead %")
    ax.set_title("Overhead by architecture x mechanism")
    return _save(fig, out / "overhead_heatmap.png")


def _loss_throughput_figure(arch: str, mine: list[Cell], out: Path) -> str:
    """Per trace of `arch`: the loss over wall time (above), throughput around the failure."""
    import matplotlib.pyplot as plt

    traces = sorted({c.trace for c in mine})
    fig, axes = plt.subplots(2, len(traces), figsize=(4.5 * len(traces) + 2.5, 7), squeeze=False)
    for col, trace in enumerate(traces):
        loss_ax, tput_ax = axes[0][col], axes[1][col]
        _plot_trace(loss_ax, tput_ax, [c for c in mine if c.trace == trace])
        loss_ax.set_title(f"{arch}, {trace}: loss (5-step mean)")
        loss_ax.set_xlabel("wall clock since start, s (dotted: failures)")
        tput_ax.axvline(0, color="red", linestyle=":")
        tput_ax.set_title(f"{arch}, {trace}: samples/s (5-step mean)")
        tput_ax.set_xlabel("seconds from the first failure")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / (4.5 * len(traces) + 2.5), 1))
    return _save(fig, out / f"loss_throughput_{arch}.png", layout=False)


def _plot_trace(loss_ax: Any, tput_ax: Any, here: list[Cell]) -> None:
    """The baseline's and each cell's first trial's curves, on one trace's two axes."""
    base = next((c.baseline for c in here if c.baseline is not None), None)
    if base is not None:
        loss_ax.plot(
            base.curve.wall_s, _smooth(base.curve.loss), color="black", lw=2, label="baseline"
        )
    for c in here:
        run = c.trials[0]
        (line,) = loss_ax.plot(run.curve.wall_s, _smooth(run.curve.loss), label=c.mechanism)
        t0 = min(r.t_start for r in run.records)
        for t in run.t_injected:
            loss_ax.axvline(t - t0, color=line.get_color(), linestyle=":", alpha=0.6)
        if run.t_injected:
            x, y = _throughput(run, run.t_injected[0])
            tput_ax.plot(*_gaps(x, _smooth(y)), color=line.get_color())


def _throughput(run: Run, t_fail: float) -> tuple[list[float], list[float]]:
    """Samples/s of each step (all ranks), against its end time relative to `t_fail`."""
    per_step: dict[tuple[int, int], list[StepRecord]] = defaultdict(list)
    for r in run.records:
        per_step[(r.generation, r.step)].append(r)
    points = sorted(
        (
            max(r.t_end for r in rs) - t_fail,
            sum(r.samples for r in rs)
            / max(1e-9, max(r.t_end for r in rs) - min(r.t_start for r in rs)),
        )
        for rs in per_step.values()
    )
    return [p[0] for p in points], [p[1] for p in points]


def _gaps(x: list[float], y: list[float]) -> tuple[list[float], list[float]]:
    """Break the line where no step ran for a while (the downtime of a recovery)."""
    if len(x) < 3:
        return x, y
    gap = 5 * statistics.median(b - a for a, b in zip(x, x[1:], strict=False))
    xs, ys = [x[0]], [y[0]]
    for i in range(1, len(x)):
        if x[i] - x[i - 1] > gap:
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(x[i])
        ys.append(y[i])
    return xs, ys


def _smooth(values: Any, n: int = 5) -> list[float]:
    """Trailing mean of `n` points (one step's loss or throughput is noisy)."""
    v = [float(x) for x in values]
    return [statistics.fmean(v[max(0, i - n + 1) : i + 1]) for i in range(len(v))]


def _save(fig: Any, path: Path, layout: bool = True) -> str:
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


# -- writing --------------------------------------------------------------------------------
def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _effect(cmp: stats.Comparison | None) -> str:
    """A comparison as "verdict: difference (95% interval)"."""
    if cmp is None:
        return "-"
    if cmp.difference is None:
        return cmp.verdict
    text = f"{cmp.verdict}: {cmp.difference:+.3g}"
    if cmp.ci95:
        text += f" ({cmp.ci95[0]:+.3g}, {cmp.ci95[1]:+.3g})"
    return text


def _cells_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = [
        "cell", "trials", "overhead % (95% CI)", *[f"{p} s" for p in SHOWN_PHASES],
        "lost steps", "samples/s before -> after", "loss vs baseline (matched time)",
        "loss vs baseline (matched samples)",
        "to baseline loss s", "oracle", "state MB/rank",
    ]  # fmt: skip
    body = []
    for r in rows:
        ci = r["overhead_ci95"]
        ov = _fmt(r["overhead_pct"]) + (f" ({ci[0]:.3g}, {ci[1]:.3g})" if ci else "")
        loss, loss_samples = _effect(r["loss_vs_baseline"]), _effect(r["loss_vs_baseline_samples"])
        sb = r["state_bytes_per_rank"]
        body.append(
            [
                r["cell"], str(r["trials"]), ov, *[_fmt(r["phases_s"][p]) for p in SHOWN_PHASES],
                _fmt(r["lost_steps"]),
                f"{_fmt(r['samples_per_s_before'])} -> {_fmt(r['samples_per_s_after'])}",
                loss, loss_samples, _fmt(r["time_to_baseline_loss_s"]), r["oracle"],
                _fmt(sb / 1e6 if sb else None),
            ]
        )  # fmt: skip
    return head, body


def write(db: Database, out: Path, sweep_id: str | None = None) -> dict[str, Any]:
    """Write report.md, report.html and the figures into `out`; returns what it wrote."""
    sweep, cells = gather(db, sweep_id)
    out.mkdir(parents=True, exist_ok=True)
    ran = [c for c in cells if c.result is not None]
    skipped = [c for c in cells if c.status == "skipped"]
    rows = [cell_row(c) for c in ran]
    figures = _figures(ran, rows, out)
    found = findings(rows)
    head, body = _cells_table(rows)
    md = [
        f"# FailBench-Ray report: sweep {sweep.name} ({sweep.id})",
        "",
        f"{len(ran)} cells ran, {len(skipped)} skipped, "
        f"{sum(c.status == 'failed' for c in cells)} failed. Overhead is against the matched "
        "baseline's mean step time; phases are medians, each from the phase before it; loss vs "
        "baseline is Welch's t-test on the losses around the end of the shorter run at matched "
        "wall-clock time, and again at matched samples (difference of means, 95% interval).",
        "",
        "## Findings",
        *[f"- {f}" for f in found or ["(no completed cells with a fault-tolerance mechanism)"]],
        "",
        "## Cells",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *["| " + " | ".join(row) + " |" for row in body],
        "",
        "## Not applicable",
        *[f"- {c.name}: {c.reason}" for c in skipped],
        "",
        "## Figures",
        *[f"![{name}]({name})" for name in figures],
        "",
    ]
    (out / "report.md").write_text("\n".join(md))
    (out / "report.html").write_text(_html(sweep, found, head, body, skipped, figures))
    return {
        "sweep_id": sweep.id,
        "cells": rows,
        "findings": found,
        "figures": figures,
        "skipped": [{"cell": c.name, "reason": c.reason} for c in skipped],
    }


def _html(
    sweep: Sweep,
    found: list[str],
    head: list[str],
    body: list[list[str]],
    skipped: list[Cell],
    figures: list[str],
) -> str:
    e = html.escape

    def bold(text: str) -> str:
        parts = e(text).split("**")
        return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))

    rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in body)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>FailBench-Ray report: {e(sweep.name)}</title>"
        "<style>body{font-family:sans-serif}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px}</style></head><body>"
        f"<h1>FailBench-Ray report: sweep {e(sweep.name)}</h1>"
        "<h2>Findings</h2><ul>" + "".join(f"<li>{bold(f)}</li>" for f in found) + "</ul>"
        "<h2>Cells</h2><table><tr>"
        + "".join(f"<th>{e(h)}</th>" for h in head)
        + "</tr>"
        + rows
        + "</table><h2>Not applicable</h2><ul>"
        + "".join(f"<li>{e(c.name)}: {e(c.reason or '')}</li>" for c in skipped)
        + "</ul><h2>Figures</h2>"
        + "".join(f"<p><img src='{e(n)}' alt='{e(n)}'></p>" for n in figures)
        + "</body></html>"
    )
