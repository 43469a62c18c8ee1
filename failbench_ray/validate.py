"""`failbench validate SPEC --mtbf-s S --duration-s D`: the decision framework against real runs.

For each mechanism:
1. calibration (never the validation runs): the spec trained with no failure, then with two
   failures at fixed steps (a seed of its own); from their ETTR breakdowns (`ettr`) come the
   mechanism's costs: the time of a step, what a save blocks, the steady overhead (gaps between
   steps, per-step copies), the downtime of a failure and the work it loses (`fit_profile`);
2. validation: the spec trained for D seconds of failure-free work, while failures arrive as a
   seeded Poisson process in wall time (exponential gaps of mean S; rank uniform, kind drawn from
   `--mix`): a `timed` trace. Its measured ETTR and breakdown are the truth;
3. prediction from the calibrated costs: the model (`reliability`, Daly with the mechanism's own
   interval), over the Poisson process and for the number of failures the run met; and the
   simulator (`simulator`), once playing the very failure times drawn for the run, once over
   `sim_runs` seeded Poisson draws (its mean, and where 95% of jobs fall).

The report: per mechanism, measured against predicted ETTR, the absolute error in percentage
points, and whether the mechanisms rank the same way. Pure parts (`poisson_events`,
`fit_profile`, `predict`, `ranking_agrees`) are tested without Ray.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from failbench_ray.errors import UsageError
from failbench_ray.reliability import Profile, expected_ratio, no_checkpoint_ratio
from failbench_ray.results import ExperimentResult
from failbench_ray.simulator import Failures, simulate, summarize
from failbench_ray.spec import ExperimentSpec

GOAL_PP = 3.0  # the goal: every error at most 3 percentage points
CALIBRATION_SEED_OFFSET = 1_000_003  # calibration runs train on other data than validation's
HORIZON = 4.0  # failures are drawn over this many times the failure-free duration


@dataclass(frozen=True)
class ValidateOptions:
    mtbf_s: float
    duration_s: float
    mechanisms: tuple[str, ...] = ()  # none: every one that applies to the architecture
    seed: int = 0
    mix: dict[str, float] = field(default_factory=lambda: {"sigkill": 1.0})
    calibration_steps: int = 40
    # The failing calibration run lasts at least this long (seconds of training), so that what a
    # failure sets off later (an elastic group growing back) happens inside it.
    calibration_s: float = 12.0
    sim_runs: int = 200


def parse_mix(text: str) -> dict[str, float]:
    """`sigkill=0.8,hang=0.2` -> {"sigkill": 0.8, "hang": 0.2}."""
    mix: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, weight = part.partition("=")
        try:
            mix[name.strip()] = float(weight) if sep else 1.0
        except ValueError:
            raise UsageError(
                f"--mix {text!r}: {part!r} is not kind=weight (e.g. sigkill=0.8,hang=0.2)"
            ) from None
    return mix


def check_options(spec: ExperimentSpec, opts: ValidateOptions) -> tuple[str, ...]:
    """The mechanisms to validate; UsageError (one line, what to change) on bad input."""
    from failbench_ray import catalog
    from injector.kill_kinds import KILL_KINDS
    from mechanisms import MECHANISMS

    if not opts.mtbf_s > 0 or math.isinf(opts.mtbf_s):
        raise UsageError(f"--mtbf-s {opts.mtbf_s:g}: give a positive number of seconds")
    if not opts.duration_s >= opts.mtbf_s or math.isinf(opts.duration_s):
        raise UsageError(
            f"--duration-s {opts.duration_s:g} is shorter than --mtbf-s {opts.mtbf_s:g}: a run "
            "must expect at least one failure; give a duration of at least the MTBF"
        )
    if not opts.mix:
        raise UsageError("--mix is empty: give kind=weight pairs, e.g. sigkill=0.8,hang=0.2")
    for name, weight in opts.mix.items():
        kind = KILL_KINDS.get(name)  # unknown: one line naming the valid ones
        if not weight > 0:
            raise UsageError(f"--mix: {name}={weight:g}; every weight must be positive")
        if kind.by_worker or kind.lasts_s is not None:
            raise UsageError(
                f"--mix: {name} is not a failure that strikes at a wall time and is recovered "
                "(it needs a failpoint in the step, or it ends by itself); use sigkill, "
                "ray_kill, hang, gil_hang, preempt or node"
            )
    total = sum(opts.mix.values())
    if abs(total - 1.0) > 1e-6:
        raise UsageError(f"--mix weights sum to {total:g}, not 1; scale them to sum to 1")
    applies = catalog.applicability(spec.architecture.name)
    names = opts.mechanisms or tuple(m for m, why in applies.items() if why is None)
    for name in names:
        MECHANISMS.get(name)  # unknown: one line naming the valid ones
        if applies.get(name) is not None:
            raise UsageError(
                f"mechanism {name} does not apply to {spec.architecture.name}: {applies[name]}"
            )
    if len(set(names)) != len(names):
        raise UsageError(f"--mechanisms {','.join(names)} names a mechanism twice")
    return tuple(names)


def poisson_events(
    mtbf_s: float, horizon_s: float, world: int, mix: dict[str, float], seed: int
) -> list[dict[str, Any]]:
    """A `timed` trace's events: exponential gaps of mean `mtbf_s` up to `horizon_s`, each on a
    uniformly drawn rank with a kind drawn from `mix`. The same seed, the same failures."""
    rng = random.Random(seed)
    kinds, weights = list(mix), list(mix.values())
    events: list[dict[str, Any]] = []
    t = rng.expovariate(1.0 / mtbf_s)
    while t < horizon_s:
        kind = rng.choices(kinds, weights)[0]
        events.append({"ranks": [rng.randrange(world)], "at_seconds": round(t, 3), "kill": kind})
        t += rng.expovariate(1.0 / mtbf_s)
    return events


@dataclass(frozen=True)
class Fitted:
    """A mechanism's costs for this job, from its calibration runs."""

    profile: Profile
    step_s: float  # useful seconds of one step
    failures: int  # failures the costs per failure are the mean of
    notes: tuple[str, ...] = ()


def _breakdown(result: ExperimentResult) -> tuple[dict[str, Any], dict[str, Any], int]:
    trial = result.trials[0] if result.trials else None
    extra = (trial.model_extra or {}) if trial is not None else {}
    if trial is None or trial.status != "completed" or not extra.get("ettr_breakdown"):
        why = trial.error if trial is not None else result.status
        raise RuntimeError(f"calibration run {result.experiment_id} did not complete: {why}")
    return dict(extra["ettr_breakdown"]), dict(extra["ettr_steady"]), len(trial.failures)


def fit_profile(
    mechanism: str,
    interval: int | None,
    steady: ExperimentResult,
    failing: ExperimentResult,
    steps_steady: int,
    steps_failing: int,
) -> Fitted:
    """Costs from the two calibration runs: `steady` (no failure) gives the step time and the
    steady overhead; `failing` gives each failure's downtime and lost work (its extra
    unexplained time, e.g. a slow first step after a recovery, is downtime too), and, being the
    longer run, what a save blocks (the median: a run's first saves are slower)."""
    ff, calm, _ = _breakdown(steady)
    fb, long_calm, k = _breakdown(failing)
    step_s, gap_s = calm["step_s"], calm["gap_s"]
    periodic = interval is not None and mechanism != "none"
    if periodic:
        assert interval is not None
        saves = max(1, steps_steady // interval)
        save_s = (
            long_calm.get("stall_s_median")
            or calm.get("stall_s_median")
            or ff["checkpoint_stall_s"] / saves
        )
        overhead = gap_s / step_s
    else:
        save_s = 0.0
        overhead = (gap_s + calm["stall_s_per_step"]) / step_s
    down = sum(v for key, v in fb.items() if key.startswith("down_"))
    # what the failing run lost beyond its downtime, its warm-up (the steady run's unexplained
    # time beyond its gaps) and its own gaps: catching up after a recovery, a smaller group
    warm_up = ff["other_s"] - gap_s * steps_steady
    extra = fb["other_s"] - warm_up - gap_s * steps_failing
    k = max(k, 1)
    restart_s = (down + max(0.0, extra)) / k
    lost_s = (fb["replayed_s"] + fb["lost_in_flight_s"]) / k
    notes = [f"{k} calibration failure(s)"]
    if periodic:
        assert interval is not None
        profile = Profile(
            mechanism, save_s=max(save_s, 1e-9), overhead=overhead, restart_s=restart_s,
            interval_s=interval * step_s,
        )  # fmt: skip
    elif mechanism == "none":
        profile = Profile(mechanism, overhead=overhead, restart_s=restart_s)
        notes.append("no saved state: a failure restarts the job")
    else:
        profile = Profile(mechanism, overhead=overhead, restart_s=restart_s, lost_s=lost_s)
    return Fitted(profile, step_s, k, tuple(notes))


def predict(
    fitted: Fitted,
    mtbf_s: float,
    work_s: float,
    world: int,
    times: tuple[float, ...],
    struck: int,
    runs: int,
    seed: int,
) -> dict[str, Any]:
    """ETTR predicted for `work_s` of failure-free work: the model over Poisson failures of
    mean `mtbf_s` and with the `struck` failures the measured run had; the simulator once with
    the failure `times` drawn for the run, once over `runs` draws (its mean and where 95% of
    jobs fall). Both already slow the work by the profile's overhead."""
    p = fitted.profile
    if p.mechanism == "none":
        model = no_checkpoint_ratio(work_s, p.restart_s, mtbf_s) / (1 + p.overhead)
    else:
        model = expected_ratio(p, mtbf_s)
    same = simulate(p, Failures(mtbf_s, schedule=times), work_s, world, seed)
    drawn = summarize(p, Failures(mtbf_s), work_s, world, runs=runs, seed=seed)
    return {
        "model": model,
        "model_same_failures": ratio_with_failures(p, work_s, struck),
        "simulator_same_failures": same.ratio,
        "simulator_same_failures_struck": same.failures,
        "simulator": drawn.ratio,
        "simulator_interval95": [drawn.job_low, drawn.job_high],
    }


def ratio_with_failures(p: Profile, work_s: float, failures: int) -> float | None:
    """The model's ETTR for a run that met exactly `failures` failures (first order, as
    `reliability.failure_cost`: a periodic mechanism loses half an interval of wall time on
    average). None for `none`, whose loss depends on where each failure falls."""
    if p.mechanism == "none":
        return None
    slow = 1.0 + p.overhead
    wall = work_s * slow
    if p.periodic and p.interval_s:
        wall += work_s / p.interval_s * p.save_s
        per_failure = p.restart_s + p.durable_s + (p.interval_s * slow + p.save_s) / 2
    else:
        per_failure = p.restart_s + (p.lost_s or 0.0)
    return work_s / (wall + failures * per_failure)


def ranking_agrees(
    measured: dict[str, float], predicted: dict[str, float | None], apart: float = GOAL_PP / 100
) -> tuple[bool, list[tuple[str, str]]]:
    """Whether the prediction orders every pair of mechanisms the way the measurement does,
    counting only pairs whose measured ETTRs are more than `apart` apart; and the pairs this
    run cannot tell apart (one run each: closer than that, their order is not known)."""
    names = sorted(measured)
    agrees, close = True, []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if abs(measured[a] - measured[b]) <= apart:
                close.append((a, b))
                continue
            pa, pb = predicted.get(a), predicted.get(b)
            if pa is None or pb is None or (measured[a] > measured[b]) != (pa > pb):
                agrees = False
    return agrees, close


PREDICTIONS = ("model", "model_same_failures", "simulator_same_failures", "simulator")


@dataclass
class MechanismValidation:
    mechanism: str
    measured_ettr: float | None
    failures_struck: int
    breakdown: dict[str, float]
    predicted: dict[str, Any]
    costs: dict[str, Any]
    experiments: dict[str, str]  # calibration / validation experiment ids
    error: str | None = None

    def error_pp(self, key: str) -> float | None:
        got = self.predicted.get(key)
        if self.measured_ettr is None or got is None:
            return None
        return abs(self.measured_ettr - got) * 100


@dataclass
class ValidationReport:
    architecture: str
    mtbf_s: float
    duration_s: float
    seed: int
    mix: dict[str, float]
    mechanisms: list[MechanismValidation] = field(default_factory=list)

    def agreement(self) -> dict[str, Any]:
        done = [m for m in self.mechanisms if m.measured_ettr is not None and m.predicted]
        measured = {m.mechanism: float(m.measured_ettr or 0.0) for m in done}
        out: dict[str, Any] = {}
        for key in PREDICTIONS:
            errors = [m.error_pp(key) for m in done]
            worst = max((e for e in errors if e is not None), default=None)
            same, close = ranking_agrees(
                measured, {m.mechanism: m.predicted.get(key) for m in done}
            )
            out[key] = {
                "max_error_pp": worst,
                "within_goal": worst is not None and worst <= GOAL_PP,
                "same_ranking": same,
                "not_told_apart": close,
            }
        return out

    def as_dict(self) -> dict[str, Any]:
        rows = []
        for m in self.mechanisms:
            row = asdict(m)
            row["ettr"] = row.pop("measured_ettr")
            row["error_pp"] = {k: m.error_pp(k) for k in PREDICTIONS}
            rows.append(row)
        return {
            "architecture": self.architecture,
            "mtbf_s": self.mtbf_s,
            "duration_s": self.duration_s,
            "seed": self.seed,
            "mix": self.mix,
            "goal_pp": GOAL_PP,
            "mechanisms": rows,
            "agreement": self.agreement(),
        }


def _interval(spec: ExperimentSpec) -> int | None:
    from failbench_ray.checks import resolve

    value = getattr(resolve(spec).mech.params, "interval", None)
    return int(value) if isinstance(value, int) else None


def _with(spec: ExperimentSpec, **changes: Any) -> dict[str, Any]:
    data = spec.model_dump(mode="json", exclude_defaults=True)
    data.update(trials=1, baseline=False, **changes)
    return data


def calibrate(
    base: ExperimentSpec,
    steps: int,
    least_s: float,
    run: Callable[[dict[str, Any]], ExperimentResult],
) -> tuple[Fitted, dict[str, str]]:
    """The two calibration runs of `base`'s mechanism (a seed of their own: never the
    validation's data) and the costs fitted on them: `steps` with no failure, then two
    failures in a run of at least `least_s` seconds of training. CalibrationFailed if one did
    not complete."""
    name, world = base.mechanism.name, base.world_size
    seed = base.seed + CALIBRATION_SEED_OFFSET
    steady = run(_with(base, name=f"calibrate {name}: steady", steps=steps, seed=seed))
    ids = {"steady": steady.experiment_id}
    try:
        wall = _breakdown(steady)[0]["wall_s"]
        long = max(steps, math.ceil(least_s / (wall / steps)))
        two = [
            {"ranks": [world - 1], "at_step": long // 3},
            {"ranks": [min(1, world - 1)], "at_step": 2 * long // 3 + 1},
        ]
        failing = run(
            _with(
                base, name=f"calibrate {name}: failures", steps=long, seed=seed,
                failures={"kind": "cascading", "events": two},
            )
        )  # fmt: skip
        ids["failures"] = failing.experiment_id
        return fit_profile(name, _interval(base), steady, failing, steps, long), ids
    except RuntimeError as err:
        raise CalibrationFailed(str(err), ids) from None


class CalibrationFailed(RuntimeError):
    def __init__(self, message: str, ids: dict[str, str]) -> None:
        super().__init__(message)
        self.ids = ids


def run_validate(
    spec: ExperimentSpec,
    opts: ValidateOptions,
    *,
    run: Callable[[dict[str, Any]], ExperimentResult],
    say: Callable[[str], None] = lambda line: None,
) -> ValidationReport:
    """Calibrate, validate and predict each mechanism (module docstring). `run(data)` runs one
    experiment spec (as data) and returns its result."""
    from failbench_ray.spec import parse_spec

    names = check_options(spec, opts)
    report = ValidationReport(
        spec.architecture.name, opts.mtbf_s, opts.duration_s, opts.seed, dict(opts.mix)
    )
    events = poisson_events(
        opts.mtbf_s, HORIZON * opts.duration_s, spec.world_size, opts.mix, opts.seed
    )
    for name in names:
        mech = spec.mechanism.model_dump(mode="json") if name == spec.mechanism.name else name
        base = parse_spec(_with(spec, mechanism=mech, failures={"kind": "none"}))
        try:
            fitted, ids = calibrate(base, opts.calibration_steps, opts.calibration_s, run)
        except CalibrationFailed as err:
            report.mechanisms.append(
                MechanismValidation(name, None, 0, {}, {}, {}, err.ids, str(err))
            )
            say(f"{name}: {err}")
            continue
        m = _validate_one(base, fitted, ids, events, opts, run)
        report.mechanisms.append(m)
        say(_said(m))
    return report


def _validate_one(
    base: ExperimentSpec,
    fitted: Fitted,
    ids: dict[str, str],
    events: list[dict[str, Any]],
    opts: ValidateOptions,
    run: Callable[[dict[str, Any]], ExperimentResult],
) -> MechanismValidation:
    """The validation run of one calibrated mechanism, measured, and its predictions."""
    name = base.mechanism.name
    slow = 1.0 + fitted.profile.overhead
    steps = max(opts.calibration_steps, round(opts.duration_s / (fitted.step_s * slow)))
    timed = {"kind": "timed", "events": events}
    valid = run(_with(base, name=f"validate {name}", steps=steps, failures=timed))
    ids = {**ids, "validation": valid.experiment_id}
    trial = valid.trials[0] if valid.trials else None
    extra = (trial.model_extra or {}) if trial is not None else {}
    costs = {**asdict(fitted.profile), "step_s": fitted.step_s, "notes": list(fitted.notes)}
    costs.pop("fallback", None)
    if trial is None or trial.status != "completed" or extra.get("ettr") is None:
        why = trial.error if trial is not None else valid.status
        return MechanismValidation(name, None, 0, {}, {}, costs, ids, f"validation run: {why}")
    # the simulator meets the same draws: those the run ended before are its too, if its run
    # lasts longer
    times = tuple(float(e["at_seconds"]) for e in events)
    work_s = steps * fitted.step_s
    predicted = predict(
        fitted, opts.mtbf_s, work_s, base.world_size, times, len(trial.failures), opts.sim_runs,
        opts.seed,
    )  # fmt: skip
    return MechanismValidation(
        name, float(extra["ettr"]), len(trial.failures), dict(extra["ettr_breakdown"]),
        predicted, costs, ids,
    )  # fmt: skip


def _said(m: MechanismValidation) -> str:
    if m.measured_ettr is None:
        return f"{m.mechanism}: {m.error}"
    p = m.predicted
    return (
        f"{m.mechanism}: measured ETTR {100 * m.measured_ettr:.1f}% ({m.failures_struck} "
        f"failures); model {100 * p['model']:.1f}%, simulator with the same failures "
        f"{100 * p['simulator_same_failures']:.1f}%"
    )


LABELS = {
    "model": "model, Poisson",
    "model_same_failures": "model, the run's failures",
    "simulator_same_failures": "simulator, the run's failure times",
    "simulator": "simulator, Poisson",
}


def markdown_report(report: ValidationReport, figure: str | None) -> list[str]:
    """validation.md: the table, then how each prediction agrees with the measurement."""
    from failbench_ray import markdown

    head = ["mechanism", "failures", "measured ETTR"]
    head += [f"{LABELS[k]} (error pp)" for k in PREDICTIONS]
    body = []
    for m in report.mechanisms:
        if m.measured_ettr is None:
            body.append([m.mechanism, "-", f"failed: {m.error}", *["-"] * len(PREDICTIONS)])
            continue
        row = [m.mechanism, str(m.failures_struck), _pct(m.measured_ettr)]
        for key in PREDICTIONS:
            cell = f"{_pct(m.predicted.get(key))} ({_pp(m.error_pp(key))})"
            if key == "simulator":
                low, high = m.predicted["simulator_interval95"]
                cell += f"; 95% of jobs {_pct(low)}-{_pct(high)}"
            row.append(cell)
        body.append(row)
    agree = report.agreement()
    lines = [
        f"# Measured versus predicted ETTR: {report.architecture}",
        "",
        f"Failures: a Poisson process of mean {report.mtbf_s:g} s (seed {report.seed}, kinds "
        f"{report.mix}); {report.duration_s:g} s of failure-free work per mechanism. Costs "
        "fitted on separate calibration runs (no failure; two failures at fixed steps), never "
        "on the validation run. ETTR as the README defines it. The Poisson predictions are "
        "expectations over the failure process; one run meets one draw of it, so they are "
        "also given for the failures this run met.",
        "",
        *markdown.table(head, body),
    ]
    for key in PREDICTIONS:
        a = agree[key]
        worst = a["max_error_pp"]
        lines.append(
            f"- {LABELS[key]}: largest error "
            + (f"{worst:.2f} pp" if worst is not None else "-")
            + f" (goal {GOAL_PP:g} pp: {'met' if a['within_goal'] else 'not met'}); ranking "
            + ("agrees with the measured" if a["same_ranking"] else "differs from the measured")
        )
    close = agree[PREDICTIONS[0]]["not_told_apart"]
    if close:
        pairs = ", ".join(f"{a} and {b}" for a, b in close)
        lines.append(
            f"- Not told apart by this run (measured within {GOAL_PP:g} pp of each other, one "
            f"run each): {pairs}; the ranking checks leave their order out."
        )
    if figure:
        lines += ["", f"![measured versus predicted ETTR]({figure})"]
    return [*lines, ""]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _pp(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


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
    fig, ax = plt.subplots(figsize=(max(7.0, 2.0 * len(names) + 2), 5.0))
    width = 0.8 / len(series)
    for i, (label, values, color) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [100 * v for v in values], width, label=label, color=color)
        if label == LABELS["simulator"]:
            bands = [m.predicted["simulator_interval95"] for m in done]
            low = [100 * (v - b[0]) for v, b in zip(values, bands, strict=True)]
            high = [100 * (b[1] - v) for v, b in zip(values, bands, strict=True)]
            ax.errorbar(xs, [100 * v for v in values], yerr=[low, high], fmt="none", color="k",
                        capsize=3, linewidth=0.8)  # fmt: skip
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ETTR (%)")
    lows = [m.predicted["simulator_interval95"][0] for m in done]
    floor = min((100 * v for _, vals, _ in series for v in [*vals, *lows]), default=0.0)
    ax.set_ylim(max(0.0, floor - 10), 100)
    ax.set_title(
        f"{report.architecture}: measured vs predicted ETTR "
        f"(MTBF {report.mtbf_s:g} s, {report.duration_s:g} s of work)"
    )
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
