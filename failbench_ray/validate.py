"""`failbench validate SPEC --mtbf-s S --duration-s D`: the decision framework against real runs.

For each mechanism:
1. calibration (never the validation runs): the spec trained once to warm up (discarded), then
   with no failure and with `calibration_failures` kills spread evenly, each at least
   `calibration_s` long (a seed of its own); from the last two runs' ETTR breakdowns (`ettr`)
   come the mechanism's costs: the time of a step, what a save blocks, the steady overhead
   (gaps between steps, per-step copies), the downtime of a failure and the work it loses
   (`fit_profile`);
2. validation: the spec trained for D seconds of failure-free work, while failures arrive as a
   seeded Poisson process in wall time (exponential gaps of mean S; rank uniform, kind drawn from
   `--mix`): a `timed` trace. Its measured ETTR and breakdown are the truth; with `runs` > 1,
   each run draws its own failures (seeds seed, seed+1, ...) and their mean, with its 95%
   interval, is held against the Poisson predictions;
3. prediction from the calibrated costs: the model (`reliability`, Daly with the mechanism's own
   interval), over the Poisson process and for the number of failures the run met (those that
   strike a recovery lose no work: `ratio_with_failures`); and the
   simulator (`simulator`), once playing the very failure times drawn for the run, once over
   `sim_runs` seeded Poisson draws (its mean, and where 95% of jobs fall).

The report: per mechanism, measured against predicted ETTR, the absolute error in percentage
points, and whether the mechanisms rank the same way. Pure parts (`poisson_events`,
`fit_profile`, `predict_poisson`, `predict_run`, `ranking_agrees`) are tested without Ray.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from failbench_ray.errors import UsageError
from failbench_ray.reliability import Profile, expected_ratio, no_checkpoint_ratio
from failbench_ray.results import ExperimentResult
from failbench_ray.simulator import Failures, simulate, summarize
from failbench_ray.spec import ExperimentSpec

GOAL_PP = 3.0  # the goal: every error at most 3 percentage points
CALIBRATION_SEED_OFFSET = 1_000_003  # calibration runs train on other data than validation's
HORIZON = 4.0  # failures are drawn over this many times the failure-free duration
MAX_CALIBRATION_FAILURES = 8
CALIBRATION_GAP_STEPS = 3  # steps between calibration failures, at the least


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
    # Failures of the failing calibration run: the costs per failure are their mean, so more
    # of them average out a recovery that ran slow on a loaded machine (at more run time).
    calibration_failures: int = 2
    sim_runs: int = 200
    # validation runs per mechanism, each its own Poisson draw (seeds seed, seed+1, ...): the
    # mean of several can be held against the expectation over the failure process
    runs: int = 1


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
    from mechanisms import MECHANISMS

    _check_numbers(opts)
    _check_mix(opts.mix)
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


def _check_numbers(opts: ValidateOptions) -> None:
    if not opts.mtbf_s > 0 or math.isinf(opts.mtbf_s):
        raise UsageError(f"--mtbf-s {opts.mtbf_s:g}: give a positive number of seconds")
    if not opts.duration_s >= opts.mtbf_s or math.isinf(opts.duration_s):
        raise UsageError(
            f"--duration-s {opts.duration_s:g} is shorter than --mtbf-s {opts.mtbf_s:g}: a run "
            "must expect at least one failure; give a duration of at least the MTBF"
        )
    if opts.runs < 1:
        raise UsageError(f"--runs {opts.runs}: give 1 or more validation runs per mechanism")
    n = opts.calibration_failures
    if not 1 <= n <= MAX_CALIBRATION_FAILURES:
        raise UsageError(
            f"--calibration-failures {n}: give 1 to {MAX_CALIBRATION_FAILURES} failures"
        )
    if opts.calibration_steps < CALIBRATION_GAP_STEPS * (n + 1):
        raise UsageError(
            f"--calibration-steps {opts.calibration_steps} is too few for {n} calibration "
            f"failures {CALIBRATION_GAP_STEPS} steps apart: give at least "
            f"{CALIBRATION_GAP_STEPS * (n + 1)}, or fewer --calibration-failures"
        )


def _check_mix(mix: dict[str, float]) -> None:
    from injector.kill_kinds import KILL_KINDS

    if not mix:
        raise UsageError("--mix is empty: give kind=weight pairs, e.g. sigkill=0.8,hang=0.2")
    for name, weight in mix.items():
        kind = KILL_KINDS.get(name)  # unknown: one line naming the valid ones
        if not weight > 0:
            raise UsageError(f"--mix: {name}={weight:g}; every weight must be positive")
        if kind.by_worker or kind.lasts_s is not None:
            raise UsageError(
                f"--mix: {name} is not a failure that strikes at a wall time and is recovered "
                "(it needs a failpoint in the step, or it ends by itself); use sigkill, "
                "ray_kill, hang, gil_hang, preempt or node"
            )
    total = sum(mix.values())
    if abs(total - 1.0) > 1e-6:
        raise UsageError(f"--mix weights sum to {total:g}, not 1; scale them to sum to 1")


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
    unexplained time, e.g. a slow first step after a recovery, is downtime too) and how much
    longer the steps that count took after it (its useful time beyond the steady run's,
    e.g. an elastic group on fewer ranks that keeps the batch). What saves
    block: the interval times the mean stall per step over the steady run's settled save
    periods (every kind of save the mechanism makes in its share; the failing run's, or the
    median of a save, where too few saves settled)."""
    ff, calm, _ = _breakdown(steady)
    fb, long_calm, k = _breakdown(failing)
    step_s, gap_s = calm["step_s"], calm["gap_s"]
    periodic = interval is not None and mechanism != "none"
    if periodic:
        assert interval is not None
        save_s = _save_cost(interval, steps_steady, ff, calm, long_calm)
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
    # the same steps took longer to train in the failing run: slowed steps after its recoveries
    slowed_s = (
        max(0.0, fb["useful_s"] - ff["useful_s"]) / k if steps_failing == steps_steady else 0.0
    )
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
    return Fitted(replace(profile, slowed_s=slowed_s), step_s, k, tuple(notes))


def _save_cost(
    interval: int, steps: int, ff: dict[str, Any], calm: dict[str, Any], long_calm: dict[str, Any]
) -> float:
    """What a save blocks: the interval times the settled stall per step (the steady run's,
    else the failing run's), else the median of a save, else the steady run's mean."""
    settled = calm.get("stall_s_per_step_settled") or long_calm.get("stall_s_per_step_settled")
    if settled:
        return float(settled * interval)
    median = long_calm.get("stall_s_median") or calm.get("stall_s_median")
    return float(median or ff["checkpoint_stall_s"] / max(1, steps // interval))


def predict_poisson(
    fitted: Fitted, mtbf_s: float, work_s: float, world: int, runs: int, seed: int
) -> dict[str, Any]:
    """The model's expectation over Poisson failures of mean `mtbf_s` (Daly with the
    mechanism's interval), and the simulator's over `runs` draws (its mean, and where 95% of
    jobs fall). Both already slow the work by the profile's overhead."""
    p = fitted.profile
    if p.mechanism == "none":
        model = no_checkpoint_ratio(work_s, p.restart_s, mtbf_s) / (1 + p.overhead)
    else:
        model = expected_ratio(p, mtbf_s)
    drawn = summarize(p, Failures(mtbf_s), work_s, world, runs=runs, seed=seed)
    return {
        "model": model,
        "simulator": drawn.ratio,
        "simulator_interval95": [drawn.job_low, drawn.job_high],
    }


def predict_run(
    fitted: Fitted,
    mtbf_s: float,
    work_s: float,
    world: int,
    times: tuple[float, ...],
    struck: int,
    seed: int,
    wall_s: float | None = None,
) -> dict[str, Any]:
    """For the failures one run met: the model with its `struck` failures, the simulator
    playing the very failure `times` drawn for it. Given the run's measured `wall_s`, the
    simulator plays that wall time (useful / wall over the same window, meeting the same
    failures: a simulated job that recovers faster would otherwise finish its `work_s` first
    and escape the run's late failures); without it, `work_s` of work."""
    p = fitted.profile
    failures = Failures(mtbf_s, schedule=times)
    same = simulate(p, failures, work_s, world, seed, wall_s=wall_s)
    return {
        "model_same_failures": ratio_with_failures(p, work_s, struck),
        "simulator_same_failures": same.ratio,
        "simulator_same_failures_struck": same.failures,
    }


def ratio_with_failures(p: Profile, work_s: float, failures: int) -> float | None:
    """The model's ETTR for a run that met exactly `failures` failures, each at a uniform
    point of its wall time. One that strikes while the job trains costs a recovery and the
    work since the newest restorable state (half an interval of wall time on average, as
    `reliability.failure_cost`). One that strikes while the job is down recovering from
    another loses no work (nothing trained since the restore) and costs the part of that
    recovery already spent (half of it on average), which starts over: the rule of Daly's
    formula and of the simulator. After each recovery the steps run `slowed_s` slower, which
    counts as useful time and as wall time. The share of wall time spent down is solved for
    (a fixed point). None for `none`, whose loss depends on where each failure falls."""
    if p.mechanism == "none":
        return None
    slow = 1.0 + p.overhead
    wall_0 = work_s * slow
    if p.periodic and p.interval_s:
        wall_0 += work_s / p.interval_s * p.save_s
        restart = p.restart_s + p.durable_s
        lost = (p.interval_s * slow + p.save_s) / 2
    else:
        restart, lost = p.restart_s, p.lost_s or 0.0
    down_share, wall, slowed = 0.0, wall_0, 0.0
    for _ in range(100):  # a contraction: converges to 1e-9 in tens of rounds at most
        down = failures * restart * (1.0 - down_share / 2)
        slowed = failures * (1.0 - down_share) * p.slowed_s  # one slowed stretch a recovery
        wall = wall_0 + failures * (1.0 - down_share) * lost + down + slowed
        if abs(down / wall - down_share) < 1e-9:
            break
        down_share = down / wall
    return (work_s + slowed) / wall


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
# the predictions for the failures one run met: each run has its own, the mechanism their mean
PER_RUN = ("model_same_failures", "simulator_same_failures")


@dataclass
class RunValidation:
    """One validation run: its own Poisson draw (seed), what it measured, and the predictions
    for the failures it met."""

    seed: int
    experiment: str
    ettr: float | None
    failures_struck: int = 0
    breakdown: dict[str, float] = field(default_factory=dict)
    predicted: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class MechanismValidation:
    mechanism: str
    costs: dict[str, Any]
    experiments: dict[str, str]  # the calibration runs' experiment ids
    runs: list[RunValidation] = field(default_factory=list)
    poisson: dict[str, Any] = field(default_factory=dict)  # model, simulator (+ interval95)
    error: str | None = None  # calibration failed: no run

    @property
    def done(self) -> list[RunValidation]:
        return [r for r in self.runs if r.ettr is not None]

    @property
    def measured_ettr(self) -> float | None:
        """The mean over the completed runs; None while one failed (no partial answer)."""
        if not self.runs or len(self.done) < len(self.runs):
            return None
        return sum(float(r.ettr or 0.0) for r in self.done) / len(self.done)

    @property
    def measured_interval95(self) -> tuple[float, float] | None:
        """Student's t interval of the mean ETTR over the runs (two or more)."""
        values = [float(r.ettr or 0.0) for r in self.done]
        if self.measured_ettr is None or len(values) < 2:
            return None
        return mean_interval95(values)

    @property
    def failures_struck(self) -> int:
        return sum(r.failures_struck for r in self.done)

    @property
    def breakdown(self) -> dict[str, float]:
        """Seconds summed over the runs."""
        total: dict[str, float] = {}
        for r in self.done:
            for key, value in r.breakdown.items():
                total[key] = total.get(key, 0.0) + value
        return total

    @property
    def predicted(self) -> dict[str, Any]:
        """The Poisson predictions and the mean of each run's for the failures it met."""
        if not self.poisson:
            return {}
        out = dict(self.poisson)
        for key in PER_RUN:
            values = [r.predicted.get(key) for r in self.done]
            known = [float(v) for v in values if v is not None]
            out[key] = sum(known) / len(known) if known and len(known) == len(values) else None
        return out

    def error_pp(self, key: str) -> float | None:
        got, measured = self.predicted.get(key), self.measured_ettr
        if measured is None or got is None:
            return None
        return abs(measured - got) * 100

    def within_interval(self, key: str) -> bool | None:
        """Whether the prediction lies in the measured mean's 95% interval (two runs or more)."""
        band, got = self.measured_interval95, self.predicted.get(key)
        if band is None or got is None:
            return None
        return band[0] <= got <= band[1]

    @property
    def failed(self) -> str | None:
        """Why this mechanism has no measured ETTR (None: it has one)."""
        if self.error is not None:
            return self.error
        failed = [r for r in self.runs if r.ettr is None]
        return f"seed {failed[0].seed}: {failed[0].error}" if failed else None


def mean_interval95(values: list[float]) -> tuple[float, float]:
    """Student's t interval of the mean ETTR, within [0, 1] where ETTRs lie (a few runs that
    differ much reach past them)."""
    from scipy import stats as sps

    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(sps.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return max(0.0, mean - half), min(1.0, mean + half)


@dataclass
class ValidationReport:
    architecture: str
    mtbf_s: float
    duration_s: float
    seed: int
    mix: dict[str, float]
    runs: int = 1
    mechanisms: list[MechanismValidation] = field(default_factory=list)
    calibration_failures: int = 2

    def agreement(self) -> dict[str, Any]:
        done = [m for m in self.mechanisms if m.measured_ettr is not None and m.poisson]
        measured = {m.mechanism: float(m.measured_ettr or 0.0) for m in done}
        out: dict[str, Any] = {}
        for key in PREDICTIONS:
            errors = [m.error_pp(key) for m in done]
            worst = max((e for e in errors if e is not None), default=None)
            same, close = ranking_agrees(
                measured, {m.mechanism: m.predicted.get(key) for m in done}
            )
            inside = [m.within_interval(key) for m in done]
            out[key] = {
                "max_error_pp": worst,
                "within_goal": worst is not None and worst <= GOAL_PP,
                "same_ranking": same,
                "not_told_apart": close,
                # None with one run a mechanism: no interval to be inside
                "within_measured_interval95": None
                if not done or any(i is None for i in inside)
                else all(inside),
            }
        return out

    def as_dict(self) -> dict[str, Any]:
        rows = []
        for m in self.mechanisms:
            band = m.measured_interval95
            rows.append(
                {
                    "mechanism": m.mechanism,
                    "ettr": m.measured_ettr,
                    "ettr_interval95": list(band) if band else None,
                    "failures_struck": m.failures_struck,
                    "breakdown": m.breakdown,
                    "predicted": m.predicted,
                    "error_pp": {k: m.error_pp(k) for k in PREDICTIONS},
                    "costs": m.costs,
                    "experiments": m.experiments,
                    "runs": [asdict(r) for r in m.runs],
                    "error": m.failed,
                }
            )
        return {
            "architecture": self.architecture,
            "mtbf_s": self.mtbf_s,
            "duration_s": self.duration_s,
            "seed": self.seed,
            "runs": self.runs,
            "calibration_failures": self.calibration_failures,
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


def calibration_events(steps: int, world: int, n: int) -> list[dict[str, Any]]:
    """`n` kills spread evenly over a run of `steps`, alternating between the last rank and
    rank 1 (a cascading trace: each after the previous one's recovery). Every kill after the
    first is one step later: for n=2, the steps the calibration always killed at."""
    return [
        {"ranks": [world - 1 if i % 2 == 0 else min(1, world - 1)], "at_step": at}
        for i, at in enumerate((i + 1) * steps // (n + 1) + min(i, 1) for i in range(n))
    ]


def calibrate(
    base: ExperimentSpec,
    steps: int,
    least_s: float,
    run: Callable[[dict[str, Any]], ExperimentResult],
    failures: int = 2,
) -> tuple[Fitted, dict[str, str]]:
    """The calibration runs of `base`'s mechanism (a seed of their own: never the validation's
    data) and the costs fitted on them. First a warm-up run of `steps` that nothing is fitted
    on (the first runs of a mechanism in a cluster are slower than the long validation runs
    that follow) and that sets the pace; then, each at least `steps` and `least_s` seconds
    long, a run with no failure and a run with `failures` failures (a save's stall varies
    twofold from one short run to the next on a shared machine; a longer run averages it).
    CalibrationFailed if one did not complete."""
    name, world = base.mechanism.name, base.world_size
    seed = base.seed + CALIBRATION_SEED_OFFSET
    warm = run(_with(base, name=f"calibrate {name}: warm-up", steps=steps, seed=seed))
    ids = {"warm_up": warm.experiment_id}
    try:
        wall = _breakdown(warm)[0]["wall_s"]
        long = max(steps, math.ceil(least_s / (wall / steps)))
        steady = run(_with(base, name=f"calibrate {name}: steady", steps=long, seed=seed))
        ids["steady"] = steady.experiment_id
        _breakdown(steady)
        events = calibration_events(long, world, failures)
        failing = run(
            _with(
                base, name=f"calibrate {name}: failures", steps=long, seed=seed,
                failures={"kind": "cascading", "events": events},
            )
        )  # fmt: skip
        ids["failures"] = failing.experiment_id
        return fit_profile(name, _interval(base), steady, failing, long, long), ids
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
        spec.architecture.name, opts.mtbf_s, opts.duration_s, opts.seed, dict(opts.mix),
        opts.runs, calibration_failures=opts.calibration_failures,
    )  # fmt: skip
    for name in names:
        mech = spec.mechanism.model_dump(mode="json") if name == spec.mechanism.name else name
        base = parse_spec(_with(spec, mechanism=mech, failures={"kind": "none"}))
        try:
            fitted, ids = calibrate(
                base, opts.calibration_steps, opts.calibration_s, run, opts.calibration_failures
            )
        except CalibrationFailed as err:
            report.mechanisms.append(MechanismValidation(name, {}, err.ids, error=str(err)))
            say(f"{name}: {err}")
            continue
        costs = {**asdict(fitted.profile), "step_s": fitted.step_s, "notes": list(fitted.notes)}
        costs.pop("fallback", None)
        m = MechanismValidation(name, costs, ids)
        steps = validation_steps(fitted, opts)
        work_s = steps * fitted.step_s
        m.poisson = predict_poisson(
            fitted, opts.mtbf_s, work_s, base.world_size, opts.sim_runs, opts.seed
        )
        for seed in range(opts.seed, opts.seed + opts.runs):
            m.runs.append(_validate_one(base, fitted, steps, seed, opts, run))
            say(_said(m, m.runs[-1]))
        report.mechanisms.append(m)
    return report


def validation_steps(fitted: Fitted, opts: ValidateOptions) -> int:
    """The steps of `opts.duration_s` of failure-free work at the calibrated pace."""
    slow = 1.0 + fitted.profile.overhead
    return max(opts.calibration_steps, round(opts.duration_s / (fitted.step_s * slow)))


def _validate_one(
    base: ExperimentSpec,
    fitted: Fitted,
    steps: int,
    seed: int,
    opts: ValidateOptions,
    run: Callable[[dict[str, Any]], ExperimentResult],
) -> RunValidation:
    """One validation run of a calibrated mechanism under the Poisson draw `seed`, measured,
    and the predictions for the failures it met."""
    name = base.mechanism.name
    events = poisson_events(opts.mtbf_s, HORIZON * opts.duration_s, base.world_size, opts.mix, seed)
    timed = {"kind": "timed", "events": events}
    label = f"validate {name}" + (f" (failures seed {seed})" if opts.runs > 1 else "")
    # every drawn failure that strikes is recovered from: the spec's cap on recoveries would
    # end a run that lives long enough to meet more
    cap = max(base.max_recoveries, len(events))
    valid = run(_with(base, name=label, steps=steps, failures=timed, max_recoveries=cap))
    trial = valid.trials[0] if valid.trials else None
    extra = (trial.model_extra or {}) if trial is not None else {}
    if trial is None or trial.status != "completed" or extra.get("ettr") is None:
        why = trial.error if trial is not None else valid.status
        return RunValidation(seed, valid.experiment_id, None, error=f"validation run: {why}")
    times = tuple(float(e["at_seconds"]) for e in events)
    predicted = predict_run(
        fitted, opts.mtbf_s, steps * fitted.step_s, base.world_size, times,
        len(trial.failures), seed, wall_s=extra["ettr_breakdown"].get("wall_s"),
    )  # fmt: skip
    return RunValidation(
        seed, valid.experiment_id, float(extra["ettr"]), len(trial.failures),
        dict(extra["ettr_breakdown"]), predicted,
    )  # fmt: skip


def _said(m: MechanismValidation, r: RunValidation) -> str:
    if r.ettr is None:
        return f"{m.mechanism} (failures seed {r.seed}): {r.error}"
    return (
        f"{m.mechanism}: measured ETTR {100 * r.ettr:.1f}% ({r.failures_struck} failures, "
        f"seed {r.seed}); model {100 * m.poisson['model']:.1f}% over Poisson failures, "
        f"{100 * (r.predicted['model_same_failures'] or 0):.1f}% for these; simulator with "
        f"the same failures {100 * r.predicted['simulator_same_failures']:.1f}%"
    )
