"""`failbench report`: a sweep's results as `report.md`, `report.html` and PNG figures.

Everything in it is computed from the database: one row per architecture x mechanism x trace
cell (overhead with its 95% interval over trials, recovery phases, lost steps, throughput
around the failure, loss progress against the matched baseline with Welch's test, the oracle's
verdict, state bytes per rank), the cells that were skipped with their reasons, four kinds of
figure, and findings (`failbench_ray.findings`): only what the intervals support.
"""

from __future__ import annotations

import html
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select

from failbench_ray import (
    failure_curves,
    kinds_report,
    markdown,
    paper_section,
    reform_report,
    results,
    stats,
)
from failbench_ray import findings as findings_mod
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
    def reform(self) -> str:
        return reform_report.regime(self.result.spec) if self.result else "standard"

    @property
    def name(self) -> str:
        name = f"{self.architecture}/{self.mechanism}/{self.trace}"
        # a sweep may run the same cell in both re-formation regimes (a grid list of `reform`)
        return name if self.reform == "standard" else f"{name} [{self.reform}]"


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
def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _median_of(extras: list[dict[str, Any]], key: str) -> float | None:
    return _median([e[key] for e in extras if e.get(key)])


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
    done = [t for t in (res.trials if res else []) if t.status == "completed"]
    noise = _baseline_noise(cell, [t.overhead_pct for t in done if t.overhead_pct is not None])
    est = findings_mod.estimate(
        [t.overhead_pct for t in done if t.overhead_pct is not None], *noise
    )
    overhead, ci = (est.mean, est.ci95) if est else (None, None)
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
        **reform_report.reform_numbers(done, cell.reform),
        **findings_mod.samples(done, to_base),
        "resumed_s": _median(resumed),
        "lost_steps": _median([f.lost_steps for f in failures if f.lost_steps is not None]),
        "samples_per_s_before": _median_of(extras, "samples_per_s_before_failure"),
        "samples_per_s_after": _median_of(extras, "samples_per_s_after_recovery"),
        "loss_vs_baseline": progress,
        "loss_vs_baseline_samples": by_samples,
        "time_to_baseline_loss_s": _median([t for t in to_base if t is not None]),
        "oracle": oracle,
        "state_bytes_per_rank": _median(
            [e["state_bytes_per_rank"] for e in extras if e.get("state_bytes_per_rank")]
        ),
        **_save_costs(extras),
        "overhead_base_var": noise[0],
        "overhead_base_df": noise[1],
    }


def _baseline_noise(cell: Cell, overheads: list[float]) -> tuple[float, float]:
    """The variance the cell's one baseline run adds to its overhead (`findings.baseline_noise`)."""
    if cell.baseline is None or cell.result is None or not overheads:
        return 0.0, math.inf
    warmup = int(cell.result.spec.get("warmup_steps", 0))
    steps = results.steady_state_steps(cell.baseline.records, [], warmup)
    return findings_mod.baseline_noise(steps, statistics.fmean(overheads))


def _save_costs(extras: list[dict[str, Any]]) -> dict[str, float | None]:
    """How fast the cell's saves wrote state (MB/s) and how long each held its step."""
    costs = [e["checkpoint"] for e in extras if e.get("checkpoint")]
    rates = [
        c["bytes_saved"] / 1e6 / (c["saves"] * c["save_s_mean"])
        for c in costs
        if c.get("saves") and c.get("save_s_mean")
    ]
    stalls = [c["blocked_s_per_save"] for c in costs if c.get("blocked_s_per_save") is not None]
    return {"write_mb_s": _median(rates), "stall_s_per_save": _median(stalls)}


# -- findings -------------------------------------------------------------------------------
def findings(rows: list[dict[str, Any]]) -> list[str]:
    """What the rows support (`failbench_ray.findings`), then the paper's first claim per
    re-formation regime."""
    return findings_mod.findings(rows) + reform_report.first_claim(rows)


SMOKE_SWEEP = "paper_matrix"  # one trial of 20 steps per cell: it checks that cells run


def smoke_note(sweep_name: str) -> list[str]:
    if sweep_name != SMOKE_SWEEP:
        return []
    return [
        f"This is `{SMOKE_SWEEP}`, the quick smoke test: one trial per cell and a few KB of "
        "state, so its numbers are noise and it supports no finding. A finding needs a sweep "
        "with `trials: 3` or more and enough steps for the overhead to span checkpoints.",
        "",
    ]


# -- figures --------------------------------------------------------------------------------
def _figures(cells: list[Cell], rows: list[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")

    names: list[str] = []
    shown = [r for r in rows if r["trials"] and any(r["phases_s"].values())]
    if shown:
        names.append(_phases_figure(shown, out))
    archs = sorted({r["architecture"] for r in rows})
    names.append(_heatmap(rows, out))
    for arch in archs:
        mine = [c for c in cells if c.architecture == arch and c.trials]
        if mine:
            names.append(_loss_throughput_figure(arch, mine, out))
    return names


def _phases_figure(shown: list[dict[str, Any]], out: Path) -> str:
    """Stacked bars of the median recovery phases of each cell in `shown`: one panel per
    architecture (small multiples, at most two across, so the full matrix stays ~1,800 px
    wide), one shared phase scale."""
    import matplotlib.pyplot as plt

    archs = sorted({r["architecture"] for r in shown})
    cols = min(2, len(archs))
    rows_n = math.ceil(len(archs) / cols)
    most = max(sum(r["architecture"] == a for r in shown) for a in archs)
    width = min(16.0, max(6.0, 0.32 * most + 1.5) * cols)
    fig, axes = plt.subplots(
        rows_n, cols, figsize=(width, 3.8 * rows_n), squeeze=False, sharey=True
    )
    for ax, arch in zip(axes.flat, archs, strict=False):
        mine = [r for r in shown if r["architecture"] == arch]
        bottom = [0.0] * len(mine)
        for i, phase in enumerate(SHOWN_PHASES):
            h = [r["phases_s"][phase] or 0.0 for r in mine]
            ax.bar(range(len(mine)), h, bottom=bottom, label=phase, color=f"C{i}")
            bottom = [b + v for b, v in zip(bottom, h, strict=True)]
        names = [r["cell"].removeprefix(f"{arch}/") for r in mine]
        ax.set_xticks(range(len(mine)), names, rotation=70, ha="right", fontsize=7)
        ax.set_title(arch, fontsize=10)
        ax.set_ylabel("seconds (median)")
    for ax in list(axes.flat)[len(archs) :]:
        ax.set_visible(False)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8, ncol=len(SHOWN_PHASES))
    fig.suptitle("Recovery phases by architecture (mechanism/trace)", x=0.02, ha="left")
    return _save(fig, out / "recovery_phases.png")


def _regime_label(name: str, reform: str) -> str:
    """A row's architecture (or a line's mechanism) with its re-formation regime, if not the
    standard one: the two regimes of one cell are two rows, never one."""
    return name if reform == "standard" else f"{name} [{reform}]"


def _heatmap(rows: list[dict[str, Any]], out: Path) -> str:
    """The steady-state overhead of each architecture x mechanism (blank: none measured)."""
    import matplotlib.pyplot as plt

    mechs = sorted({r["mechanism"] for r in rows})
    archs = sorted({_regime_label(r["architecture"], r["reform"]) for r in rows})
    grid = [[math.nan] * len(mechs) for _ in archs]
    for r in rows:
        if r["overhead_pct"] is not None:
            row = archs.index(_regime_label(r["architecture"], r["reform"]))
            grid[row][mechs.index(r["mechanism"])] = r["overhead_pct"]
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
    import matplotlib.pyplot as plt

    base = next((c.baseline for c in here if c.baseline is not None), None)
    if base is not None:
        loss_ax.plot(
            base.curve.wall_s, _smooth(base.curve.loss), color="black", lw=2, label="baseline"
        )
    mechs = sorted({c.mechanism for c in here})
    colors = plt.get_cmap("tab10")
    for c in here:
        run = c.trials[0]
        # one color per mechanism; a regime other than the standard one is dashed
        (line,) = loss_ax.plot(
            run.curve.wall_s,
            _smooth(run.curve.loss),
            label=_regime_label(c.mechanism, c.reform),
            color=colors(mechs.index(c.mechanism) % 10),
            linestyle="-" if c.reform == "standard" else "--",
        )
        t0 = min(r.t_start for r in run.records)
        for t in run.t_injected:
            loss_ax.axvline(t - t0, color=line.get_color(), linestyle=":", alpha=0.6)
        if run.t_injected:
            x, y = _throughput(run, run.t_injected[0])
            tput_ax.plot(
                *_gaps(x, _smooth(y)), color=line.get_color(), linestyle=line.get_linestyle()
            )


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


def _trials(n: int) -> str:
    return f"{n}{findings_mod.ONE_TRIAL_MARK}" if 0 < n < findings_mod.MIN_TRIALS else str(n)


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
                r["cell"], _trials(r["trials"]), ov,
                *[_fmt(r["phases_s"][p]) for p in SHOWN_PHASES],
                _fmt(r["lost_steps"]),
                f"{_fmt(r['samples_per_s_before'])} -> {_fmt(r['samples_per_s_after'])}",
                loss, loss_samples, _fmt(r["time_to_baseline_loss_s"]), r["oracle"],
                _fmt(sb / 1e6 if sb else None),
            ]
        )  # fmt: skip
    return head, body


_HOW = (
    "Overhead is against the matched baseline's mean step time; phases are medians, each from "
    "the phase before it; loss vs baseline is Welch's t-test on the losses around the end of "
    "the shorter run at matched wall-clock time, and again at matched samples (difference of "
    "means, 95% interval)."
)


_REFORM_INTRO = (
    "## Re-formation",
    "Median seconds of each part, from `quiesced` to `reformed`: the replacements up, every "
    "member at the store, every group connected, the first collective, the trainers built; "
    "then the restore (to `restored`).",
    "",
)


def write(db: Database, out: Path, sweep_id: str | None = None) -> dict[str, Any]:
    """Write report.md, report.html and the figures into `out`; returns what it wrote."""
    sweep, cells = gather(db, sweep_id)
    out.mkdir(parents=True, exist_ok=True)
    ran = [c for c in cells if c.result is not None]
    skipped = [c for c in cells if c.status == "skipped"]
    rows = [cell_row(c) for c in ran]
    figures = _figures(ran, rows, out)
    found = findings(rows)
    vs = paper_section.section(rows, out)
    head, body = _cells_table(rows)
    parts_head, parts_body = reform_report.parts_table(rows)
    kinds_md, kinds_head, kinds_body = kinds_report.section(
        (c.mechanism, c.result) for c in ran if c.result is not None
    )
    curves_md, curves_head, curves_body = failure_curves.section()
    md = [
        f"# FailBench-Ray report: sweep {sweep.name} ({sweep.id})",
        "",
        f"{len(ran)} cells ran, {len(skipped)} skipped, "
        f"{sum(c.status == 'failed' for c in cells)} failed. {_HOW}",
        "",
        *smoke_note(sweep.name),
        "## Findings",
        *[f"- {f}" for f in found or ["(no completed cells with a fault-tolerance mechanism)"]],
        "",
        "## Paper vs this run",
        *vs.markdown(),
        "## Cells",
        *markdown.table(head, body),
        *_REFORM_INTRO,
        *markdown.table(parts_head, parts_body),
        *kinds_md,
        *curves_md,
        "## Not applicable",
        *[f"- {c.name}: {c.reason}" for c in skipped],
        "",
        "## Figures",
        *[f"![{name}]({name})" for name in figures],
        "",
    ]
    (out / "report.md").write_text("\n".join(md))
    tables = [
        ("Paper vs this run", vs.head, vs.body),
        ("Cells", head, body),
        ("Re-formation", parts_head, parts_body),
        ("Fault kinds", kinds_head, kinds_body),
        ("Failure curves", curves_head, curves_body),
    ]
    figures = [*vs.figures, *figures]
    (out / "report.html").write_text(_html(sweep, found, tables, skipped, figures, vs.notes))
    return {
        "sweep_id": sweep.id,
        "cells": rows,
        "findings": found,
        "paper": vs.json(),
        "figures": figures,
        "skipped": [{"cell": c.name, "reason": c.reason} for c in skipped],
    }


def _html(
    sweep: Sweep,
    found: list[str],
    tables: list[tuple[str, list[str], list[list[str]]]],
    skipped: list[Cell],
    figures: list[str],
    notes: list[str],
) -> str:
    e = html.escape

    def bold(text: str) -> str:
        parts = e(text).split("**")
        return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))

    def table(title: str, head: list[str], body: list[list[str]]) -> str:
        cells = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in body)
        return (
            f"<h2>{e(title)}</h2><table><tr>"
            + "".join(f"<th>{e(h)}</th>" for h in head)
            + f"</tr>{cells}</table>"
        )

    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>FailBench-Ray report: {e(sweep.name)}</title>"
        "<style>body{font-family:sans-serif}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px}</style></head><body>"
        f"<h1>FailBench-Ray report: sweep {e(sweep.name)}</h1>"
        + "".join(f"<p>{e(n)}</p>" for n in smoke_note(sweep.name) if n)
        + "<h2>Findings</h2><ul>"
        + "".join(f"<li>{bold(f)}</li>" for f in found)
        + "</ul>"
        + "".join(table(*t) for t in tables[:1])
        + "".join(f"<p>{e(n.removeprefix('- '))}</p>" for n in notes if n)
        + "".join(table(*t) for t in tables[1:])
        + "<h2>Not applicable</h2><ul>"
        + "".join(f"<li>{e(c.name)}: {e(c.reason or '')}</li>" for c in skipped)
        + "</ul><h2>Figures</h2>"
        + "".join(f"<p><img src='{e(n)}' alt='{e(n)}'></p>" for n in figures)
        + "</body></html>"
    )
