"""What `failbench validate` writes: validation.md (the table, and how each prediction agrees
with the measurement) and validation.png (measured against predicted ETTR per mechanism)."""

from __future__ import annotations

from pathlib import Path

from failbench_ray.validate import GOAL_PP, PREDICTIONS, MechanismValidation, ValidationReport

LABELS = {
    "model": "model, Poisson",
    "model_same_failures": "model, the run's failures",
    "simulator_same_failures": "simulator, the run's failure times",
    "simulator": "simulator, Poisson",
}


def markdown_report(report: ValidationReport, figure: str | None) -> list[str]:
    from failbench_ray import markdown

    many = report.runs > 1
    head = ["mechanism", "failures", "measured ETTR" + (" (mean, 95% interval)" if many else "")]
    head += [f"{LABELS[k]} (error pp)" for k in PREDICTIONS]
    body = [_row(m) for m in report.mechanisms]
    runs = (
        f"{report.runs} validation runs per mechanism, each its own draw (seeds {report.seed} to "
        f"{report.seed + report.runs - 1}); the measured ETTR is their mean, and the predictions "
        "for the runs' failures the mean of each run's."
        if many
        else f"one validation run per mechanism (seed {report.seed})."
    )
    lines = [
        f"# Measured versus predicted ETTR: {report.architecture}",
        "",
        f"Failures: a Poisson process of mean {report.mtbf_s:g} s (kinds {report.mix}); "
        f"{report.duration_s:g} s of failure-free work per run; {runs} Costs fitted on separate "
        f"calibration runs (after a discarded warm-up run: no failure; "
        f"{report.calibration_failures} failure(s) spread evenly), never on a validation run. "
        "ETTR as the README defines it. The Poisson predictions are expectations over the "
        "failure process, which one run meets one draw of; so they are also given for the "
        "failures each run met.",
        "",
        *markdown.table(head, body),
        *_agreement_lines(report),
    ]
    if many:
        lines += ["", "Each run:", ""]
        lines += markdown.table(
            ["mechanism", "seed", "failures", "measured ETTR", *(LABELS[k] for k in _PER_RUN)],
            [
                [m.mechanism, str(r.seed), str(r.failures_struck), _pct(r.ettr)]
                + [_pct(r.predicted.get(k)) for k in _PER_RUN]
                if r.ettr is not None
                else [m.mechanism, str(r.seed), "-", f"failed: {r.error}", "-", "-"]
                for m in report.mechanisms
                for r in m.runs
            ],
        )
    if figure:
        lines += ["", f"![measured versus predicted ETTR]({figure})"]
    return [*lines, ""]


_PER_RUN = ("model_same_failures", "simulator_same_failures")


def _row(m: MechanismValidation) -> list[str]:
    if m.measured_ettr is None:
        return [m.mechanism, "-", f"failed: {m.failed}", *["-"] * len(PREDICTIONS)]
    measured = _pct(m.measured_ettr)
    band = m.measured_interval95
    if band is not None:
        measured += f" ({_pct(band[0])}-{_pct(band[1])})"
    struck = "+".join(str(r.failures_struck) for r in m.runs)
    row = [m.mechanism, struck, measured]
    for key in PREDICTIONS:
        cell = f"{_pct(m.predicted.get(key))} ({_pp(m.error_pp(key))})"
        if key == "simulator":
            low, high = m.predicted["simulator_interval95"]
            cell += f"; 95% of jobs {_pct(low)}-{_pct(high)}"
        row.append(cell)
    return row


def _agreement_lines(report: ValidationReport) -> list[str]:
    agree = report.agreement()
    lines = [""]
    for key in PREDICTIONS:
        a = agree[key]
        worst = a["max_error_pp"]
        line = (
            f"- {LABELS[key]}: largest error "
            + (f"{worst:.2f} pp" if worst is not None else "-")
            + f" (goal {GOAL_PP:g} pp: {'met' if a['within_goal'] else 'not met'}); ranking "
            + ("agrees with the measured" if a["same_ranking"] else "differs from the measured")
        )
        inside = a["within_measured_interval95"]
        if inside is not None:
            line += (
                "; inside every measured 95% interval"
                if inside
                else "; outside a measured 95% interval"
            )
        lines.append(line)
    close = agree[PREDICTIONS[0]]["not_told_apart"]
    if close:
        pairs = ", ".join(f"{a} and {b}" for a, b in close)
        lines.append(
            f"- Not told apart (measured within {GOAL_PP:g} pp of each other): {pairs}; the "
            "ranking checks leave their order out."
        )
    return lines


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _pp(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _band(value: object) -> tuple[float, float] | None:
    if isinstance(value, list | tuple) and len(value) == 2:
        return float(value[0]), float(value[1])
    return None


def figure(report: ValidationReport, path: Path) -> str:
    """Measured against predicted ETTR per mechanism, as bars; the PNG's file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [m for m in report.mechanisms if m.measured_ettr is not None]
    names = [m.mechanism for m in done]
    colors = ("tab:blue", "tab:cyan", "tab:orange", "tab:green")
    series = [("measured", [float(m.measured_ettr or 0) for m in done], "black")]
    series += [
        (LABELS[k], [m.predicted.get(k) or 0.0 for m in done], c)
        for k, c in zip(PREDICTIONS, colors, strict=True)
    ]
    bands: dict[str, list[tuple[float, float] | None]] = {
        "measured": [m.measured_interval95 for m in done],
        LABELS["simulator"]: [_band(m.predicted.get("simulator_interval95")) for m in done],
    }
    fig, ax = plt.subplots(figsize=(max(7.0, 2.0 * len(names) + 2), 5.0))
    width = 0.8 / len(series)
    for i, (label, values, color) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [100 * v for v in values], width, label=label, color=color)
        for x, v, band in zip(xs, values, bands.get(label, []), strict=False):
            if band is not None:
                below, above = max(0.0, v - band[0]), max(0.0, band[1] - v)
                ax.errorbar([x], [100 * v], yerr=[[100 * below], [100 * above]],
                            fmt="none", color="grey" if label == "measured" else "k", capsize=3,
                            linewidth=0.8)  # fmt: skip
        if label == "measured" and report.runs > 1:  # each run, on its mean's bar
            for x, m in zip(xs, done, strict=True):
                each = [100 * (r.ettr or 0.0) for r in m.done]
                ax.scatter([x] * len(each), each, s=26, color="white", edgecolor="grey",
                           zorder=3, label="one run" if x == xs[0] else None)  # fmt: skip
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ETTR (%)")
    lows = [b[0] for bs in bands.values() for b in bs if b is not None]
    floor = min((100 * v for _, vals, _ in series for v in [*vals, *lows]), default=0.0)
    ax.set_ylim(max(0.0, floor - 10), 100)
    runs = f", mean of {report.runs} runs" if report.runs > 1 else ""
    ax.set_title(
        f"{report.architecture}: measured vs predicted ETTR "
        f"(MTBF {report.mtbf_s:g} s, {report.duration_s:g} s of work{runs})"
    )
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
