"""`failbench validate` (issue 20): Poisson failures, costs fitted on calibration runs, the
model and the simulator against the measured ETTR. Pure parts without Ray; one end-to-end run
on a real Ray cluster with real SIGKILLs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from failbench_ray import cli
from failbench_ray.results import ExperimentResult
from failbench_ray.runner import run_experiment
from failbench_ray.spec import parse_spec
from failbench_ray.storage.db import Database
from failbench_ray.validate import (
    Fitted,
    ValidateOptions,
    calibration_events,
    check_options,
    fit_profile,
    parse_mix,
    poisson_events,
    predict_poisson,
    predict_run,
    ranking_agrees,
    ratio_with_failures,
    run_validate,
)

SPEC: dict[str, Any] = {
    "architecture": "ddp",
    "world_size": 3,
    "model": {"kind": "mlp", "input_dim": 16, "hidden_dim": 32, "depth": 2},
    "steps": 30,
    "batch_size": 24,
    "mechanism": {"name": "disk_ckpt", "params": {"interval": 5}},
}


def test_failures_arrive_as_a_seeded_poisson_process() -> None:
    events = poisson_events(10.0, 100_000.0, 4, {"sigkill": 0.75, "hang": 0.25}, seed=3)
    assert events == poisson_events(10.0, 100_000.0, 4, {"sigkill": 0.75, "hang": 0.25}, seed=3)
    times = [e["at_seconds"] for e in events]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(events) == pytest.approx(10_000, rel=0.05)
    assert sum(gaps) / len(gaps) == pytest.approx(10.0, rel=0.05)
    # exponential: the gaps' standard deviation equals their mean
    mean = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert sd == pytest.approx(mean, rel=0.05)
    hangs = sum(e["kill"] == "hang" for e in events) / len(events)
    assert hangs == pytest.approx(0.25, abs=0.02)
    assert {r for e in events for r in e["ranks"]} == {0, 1, 2, 3}
    assert poisson_events(10.0, 100.0, 4, {"sigkill": 1.0}, seed=4) != events[:10]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"mtbf_s": 0}, "--mtbf-s 0: give a positive number of seconds"),
        ({"mtbf_s": -5}, "--mtbf-s -5: give a positive"),
        ({"duration_s": 5}, "--duration-s 5 is shorter than --mtbf-s 10: a run must expect"),
        ({"mechanisms": ("disk_ckpt", "zap")}, "unknown mechanism 'zap'"),
        ({"mechanisms": ("live_recovery",)}, "mechanism live_recovery does not apply to"),
        ({"mix": {"sigkill": 0.5, "hang": 0.3}}, "--mix weights sum to 0.8, not 1"),
        ({"mix": {"zap": 1.0}}, "unknown kill kind 'zap'"),
        ({"mix": {"bitflip": 1.0}}, "--mix: bitflip is not a failure that strikes at a wall"),
        ({"mix": {"sigkill": 1.5, "hang": -0.5}}, "--mix: hang=-0.5; every weight must be"),
        ({"runs": 0}, "--runs 0: give 1 or more validation runs per mechanism"),
        ({"calibration_failures": 0}, "--calibration-failures 0: give 1 to 8 failures"),
        (
            {"calibration_failures": 5, "calibration_steps": 12},
            "--calibration-steps 12 is too few for 5 calibration failures 3 steps apart: give "
            "at least 18, or fewer --calibration-failures",
        ),
    ],
)
def test_bad_input_gets_one_line_saying_what_to_change(change: dict[str, Any], says: str) -> None:
    opts = ValidateOptions(**{"mtbf_s": 10.0, "duration_s": 60.0, **change})
    spec = parse_spec({**SPEC, "architecture": "fsdp"} if "live_recovery" in str(change) else SPEC)
    with pytest.raises(Exception) as caught:  # noqa: PT011 (UsageError or SpecError: its text)
        check_options(spec, opts)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_the_command_refuses_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    for args, says in (
        (["--mtbf-s", "0", "--duration-s", "10"], "--mtbf-s 0: give a positive"),
        (["--mtbf-s", "10", "--duration-s", "60", "--mix", "sigkill"], None),
        (["--mtbf-s", "10", "--duration-s", "60", "--mix", "sigkill=x"], "is not kind=weight"),
        (["--mtbf-s", "10", "--duration-s", "60", "--mix", "sigkill=.4"], "sum to 0.4, not 1"),
    ):
        if says is None:
            assert parse_mix("sigkill") == {"sigkill": 1.0}
            continue
        assert cli.main(["validate", str(spec), *args, "--db", f"sqlite:///{tmp_path}/v.db"]) == 2
        err = capsys.readouterr().err
        assert says in err and err.strip().count("\n") == 0, err


def test_calibration_failures_are_spread_evenly_over_the_failing_run() -> None:
    # two, as the costs were always fitted: at a third and two thirds, on two ranks
    assert calibration_events(100, 4, 2) == [
        {"ranks": [3], "at_step": 33},
        {"ranks": [1], "at_step": 67},
    ]
    for steps, world, n in ((100, 4, 5), (27, 2, 8), (40, 8, 1)):
        events = calibration_events(steps, world, n)
        at = [e["at_step"] for e in events]
        assert len(at) == n and at[0] > 0 and at[-1] < steps
        assert all(b - a >= 2 for a, b in zip(at, at[1:], strict=False)), at
        assert all(0 <= e["ranks"][0] < world for e in events)


def result(breakdown: dict[str, float], steady: dict[str, float], failures: int) -> Any:
    trial = {
        "trial": 0, "status": "completed", "step_time_s": 0.01, "overhead_pct": None,
        "final_loss": 1.0, "params_digest": "x", "matches_baseline": None,
        "failures": [
            {"ranks": [1], "kill_kind": "sigkill", "trigger": "step=5", "injected_at_step": 5,
             "restored_from_step": 5, "lost_steps": 0, "quiesce": "abort", "restore_source": "x",
             "phases": {}}
        ] * failures,
        "ettr": 0.5, "ettr_breakdown": breakdown, "ettr_steady": steady,
    }  # fmt: skip
    return ExperimentResult.model_validate(
        {"experiment_id": "e", "status": "completed", "spec": {}, "baseline": None,
         "trials": [trial]}
    )  # fmt: skip


ZERO = dict.fromkeys(
    ("checkpoint_stall_s", "replayed_s", "lost_in_flight_s", "down_detect_s", "down_quiesce_s",
     "down_reform_s", "down_restore_s", "down_resume_s", "other_s"), 0.0
)  # fmt: skip


def test_costs_come_from_the_calibration_runs() -> None:
    # 100 steps of 10 ms, a 5 ms gap between steps, a 20 ms save every 10 steps
    steady = result(
        {**ZERO, "useful_s": 1.0, "checkpoint_stall_s": 0.2, "other_s": 0.6},
        {"step_s": 0.01, "gap_s": 0.005, "stall_s_per_step": 0.002},
        0,
    )
    # two failures: 3 s down each, 0.1 s of work in flight, 0.2 s replayed, 0.4 s catching up
    failing = result(
        {**ZERO, "useful_s": 1.0, "checkpoint_stall_s": 0.2, "down_reform_s": 5.0,
         "down_detect_s": 1.0, "lost_in_flight_s": 0.1, "replayed_s": 0.2, "other_s": 1.0},
        {"step_s": 0.01, "gap_s": 0.005, "stall_s_per_step": 0.002},
        2,
    )  # fmt: skip
    fit = fit_profile("disk_ckpt", 10, steady, failing, 100, 100)
    p = fit.profile
    assert fit.step_s == 0.01 and fit.failures == 2
    assert p.save_s == pytest.approx(0.02) and p.interval_s == pytest.approx(0.1)
    assert p.overhead == pytest.approx(0.5) and p.restart_s == pytest.approx(3.2)
    # where a run says what a save blocks at the median, that is its cost: the longer
    # (failing) run's first
    steady.trials[0].model_extra["ettr_steady"]["stall_s_median"] = 0.015  # type: ignore[index]
    assert fit_profile("disk_ckpt", 10, steady, failing, 100, 100).profile.save_s == 0.015
    failing.trials[0].model_extra["ettr_steady"]["stall_s_median"] = 0.012  # type: ignore[index]
    assert fit_profile("disk_ckpt", 10, steady, failing, 100, 100).profile.save_s == 0.012
    # where saves settled, the interval times their mean stall per step: the steady run's,
    # else the failing run's
    failing.trials[0].model_extra["ettr_steady"]["stall_s_per_step_settled"] = 0.0011  # type: ignore[index]
    got = fit_profile("disk_ckpt", 10, steady, failing, 100, 100).profile.save_s
    assert got == pytest.approx(0.011)
    steady.trials[0].model_extra["ettr_steady"]["stall_s_per_step_settled"] = 0.0009  # type: ignore[index]
    got = fit_profile("disk_ckpt", 10, steady, failing, 100, 100).profile.save_s
    assert got == pytest.approx(0.009)
    # without an interval, a mechanism's per-step stall is overhead and its loss is measured
    fit = fit_profile("redundant", None, steady, failing, 100, 100)
    assert fit.profile.overhead == pytest.approx(0.7) and fit.profile.lost_s == pytest.approx(0.15)
    assert fit.profile.slowed_s == 0.0
    # the same 100 steps took 0.6 s longer in the failing run: 0.3 s slowed after each failure
    failing.trials[0].model_extra["ettr_breakdown"]["useful_s"] = 1.6  # type: ignore[index]
    got = fit_profile("elastic", None, steady, failing, 100, 100).profile.slowed_s
    assert got == pytest.approx(0.3)
    with pytest.raises(RuntimeError, match="did not complete"):
        bad = steady.model_copy(deep=True)
        bad.trials[0].status = "failed"
        fit_profile("disk_ckpt", 10, bad, failing, 100, 100)


def test_predictions_of_the_model_and_of_the_simulator_with_the_same_failures() -> None:
    from failbench_ray.reliability import Profile

    def predict(fitted: Fitted, times: tuple[float, ...], struck: int, runs: int) -> dict[str, Any]:
        return {
            **predict_poisson(fitted, 50.0, 300.0, 4, runs, seed=1),
            **predict_run(fitted, 50.0, 300.0, 4, times, struck, seed=1),
        }

    fitted = Fitted(Profile("disk_ckpt", save_s=0.5, restart_s=3, interval_s=10), 0.01, 2)
    got = predict(fitted, (), 0, runs=50)
    # no failure struck: the simulator plays only the saves, and so does the model
    assert got["simulator_same_failures"] == pytest.approx(300 / (300 + 29 * 0.5))
    assert got["model_same_failures"] == pytest.approx(300 / (300 + 30 * 0.5))
    assert 0.7 < got["model"] < got["simulator_same_failures"]
    low, high = got["simulator_interval95"]
    assert low <= got["simulator"] <= high
    # two failures: each 3 s down and half an interval (10 s of work and a 0.5 s save) lost,
    # unless it strikes while the job is down (a share d of the wall time): then half a recovery
    two = predict(fitted, (100.0, 200.0), 2, runs=50)
    wall = 300 / two["model_same_failures"]
    d = 6 / (wall + 3)  # solves d = 2 * 3 * (1 - d / 2) / wall
    assert wall == pytest.approx(315 + 2 * ((1 - d) * 5.25 + 3 * (1 - d / 2)))
    assert wall < 315 + 2 * (3 + 5.25)
    assert two["simulator_same_failures_struck"] == 2
    assert abs(two["simulator_same_failures"] - two["model_same_failures"]) < 0.01
    # a failure late in a measured run whose recoveries took longer than the simulated ones:
    # the simulated job of 300 s of work ends at 328.5 s and escapes it, unless it plays the
    # run's own wall time (360 s), as `failbench validate` has it do
    late = (100.0, 200.0, 340.0)
    escaped = predict_run(fitted, 50.0, 300.0, 4, late, 3, seed=1)
    assert escaped["simulator_same_failures_struck"] == 2
    met = predict_run(fitted, 50.0, 300.0, 4, late, 3, seed=1, wall_s=360.0)
    assert met["simulator_same_failures_struck"] == 3
    assert met["simulator_same_failures"] < escaped["simulator_same_failures"]
    assert abs(met["simulator_same_failures"] - met["model_same_failures"]) < 0.03
    # slowed steps: both already count the overhead (once)
    slow = Fitted(Profile("redundant", overhead=0.25, restart_s=3, lost_s=0.5), 0.01, 2)
    got = predict(slow, (), 0, runs=10)
    assert got["simulator_same_failures"] == pytest.approx(0.8)
    assert got["model_same_failures"] == pytest.approx(0.8)


def test_the_model_for_a_runs_failures_is_the_simulators_mean_over_runs_that_met_as_many() -> None:
    # Frequent failures (recoveries a quarter of the wall time): many strike a recovery, and
    # lose no work there. Over Poisson runs, those that met k failures average what the
    # model predicts for k (the first-order charge, a full recovery and half an interval
    # each, is 3-4 pp low at 8 failures).
    from collections import defaultdict

    from failbench_ray.reliability import Profile, expected_ratio
    from failbench_ray.simulator import Failures, simulate, summarize

    disk = Profile("disk_ckpt", save_s=0.05, restart_s=4.0, interval_s=3.0, overhead=0.15)
    # and an elastic group whose steps run 1.5 s slower after each recovery, which counts
    elastic = Profile("elastic", restart_s=2.0, lost_s=0.01, overhead=0.2, slowed_s=1.5)
    for p in (disk, elastic):
        by_count: dict[int, list[float]] = defaultdict(list)
        for seed in range(1500):
            run = simulate(p, Failures(15.0), 60.0, 4, seed)
            by_count[run.failures].append(run.ratio)
        for k in range(3, 9):
            mean = sum(by_count[k]) / len(by_count[k])
            assert len(by_count[k]) >= 80
            assert ratio_with_failures(p, 60.0, k) == pytest.approx(mean, abs=0.01), (p, k)
        # and Poisson's expectation is the simulator's mean over all of them
        runs = [r for ratios in by_count.values() for r in ratios]
        assert expected_ratio(p, 15.0) == pytest.approx(sum(runs) / len(runs), abs=0.015), p
        drawn = summarize(p, Failures(15.0), 60.0, 4, runs=400, seed=0)
        assert drawn.job_low < drawn.ratio < drawn.job_high
        assert drawn.ratio == pytest.approx(expected_ratio(p, 15.0), abs=0.015), p


def test_a_ranking_is_judged_only_where_the_run_tells_mechanisms_apart() -> None:
    assert ranking_agrees({"a": 0.9, "b": 0.8}, {"a": 0.7, "b": 0.6}) == (True, [])
    assert ranking_agrees({"a": 0.9, "b": 0.8}, {"a": 0.6, "b": 0.7}) == (False, [])
    # within 3 pp: their order is not known, so a prediction that swaps them still agrees
    assert ranking_agrees({"a": 0.9, "b": 0.89, "c": 0.5}, {"a": 0.6, "b": 0.7, "c": 0.4}) == (
        True,
        [("a", "b")],
    )


def test_several_runs_are_held_against_the_poisson_predictions_by_their_mean(
    tmp_path: Path,
) -> None:
    from failbench_ray.validate import MechanismValidation, RunValidation, ValidationReport
    from failbench_ray.validate_report import figure, markdown_report

    def runs(*ettrs: float) -> list[RunValidation]:
        return [
            RunValidation(seed, f"e{seed}", e, 2 + seed, {"wall_s": 10.0, "useful_s": 10 * e},
                          {"model_same_failures": e + 0.01, "simulator_same_failures": e - 0.02})
            for seed, e in enumerate(ettrs)
        ]  # fmt: skip

    poisson = {"model": 0.75, "simulator": 0.70, "simulator_interval95": [0.6, 0.8]}
    a = MechanismValidation("disk_ckpt", {}, {}, runs(0.70, 0.74, 0.78), dict(poisson))
    b = MechanismValidation("elastic", {}, {}, runs(0.90, 0.91, 0.92), {**poisson, "model": 0.8})
    assert a.measured_ettr == pytest.approx(0.74) and a.failures_struck == 2 + 3 + 4
    low, high = a.measured_interval95 or (0, 0)
    # Student's t with 2 degrees of freedom: 4.303 x sd (0.04) / sqrt(3)
    assert (low, high) == (
        pytest.approx(0.74 - 0.0994, abs=1e-4),
        pytest.approx(0.74 + 0.0994, abs=1e-4),
    )
    assert a.predicted["model_same_failures"] == pytest.approx(0.75)
    assert a.error_pp("model") == pytest.approx(1.0) and a.within_interval("model") is True
    assert b.within_interval("model") is False  # 0.80 against 0.90 +- 0.025
    # runs far apart: the interval stops where ETTRs do
    wide = MechanismValidation("none", {}, {}, runs(0.2, 0.9, 0.95), dict(poisson))
    assert wide.measured_interval95 == (0.0, 1.0)
    assert a.breakdown == {"wall_s": 30.0, "useful_s": pytest.approx(22.2)}
    report = ValidationReport(
        "ddp", 15.0, 60.0, 0, {"sigkill": 1.0}, 3, [a, b], calibration_failures=4
    )
    agree = report.agreement()
    assert agree["model"]["within_measured_interval95"] is False
    assert agree["model"]["max_error_pp"] == pytest.approx(11.0)
    # a failed run leaves its mechanism without a measured ETTR: no mean of the rest
    a.runs[1] = RunValidation(1, "e1", None, error="validation run: boom")
    assert a.measured_ettr is None and a.failed == "seed 1: validation run: boom"
    md = "\n".join(markdown_report(report, figure(report, tmp_path / "v.png")))
    assert "3 validation runs per mechanism" in md and "failed: seed 1: validation run" in md
    assert "no failure; 4 failure(s) spread evenly" in md
    assert report.as_dict()["calibration_failures"] == 4
    assert "| elastic | 2+3+4 | 91.0% (88.5%-93.5%) |" in md
    assert (tmp_path / "v.png").stat().st_size > 10_000


@pytest.mark.usefixtures("no_leaks")
def test_validate_measures_ettr_under_poisson_failures_and_predicts_it(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Real runs: calibration (no failure, two failures), then 6 s of work with SIGKILLs every
    4 s on average (seed 5: the first at 3.9 s, the next at 15.3 s, after the run); the report
    has the measured ETTR with its breakdown and the predictions."""
    db = Database(f"sqlite:///{tmp_path}/validate.db")
    spec = parse_spec(SPEC)
    lines: list[str] = []
    opts = ValidateOptions(
        mtbf_s=4.0, duration_s=6.0, mechanisms=("disk_ckpt",), seed=5, calibration_steps=30,
        calibration_s=1.0,
        sim_runs=20,
    )  # fmt: skip

    given: list[dict[str, Any]] = []

    def run(data: dict[str, Any]) -> ExperimentResult:
        given.append(data)
        return run_experiment(parse_spec(data), db=db, out_dir=tmp_path / "runs")

    try:
        report = run_validate(spec, opts, run=run, say=lines.append)
    finally:
        db.dispose()
    (m,) = report.mechanisms
    assert m.error is None and m.measured_ettr is not None, m
    assert 0 < m.measured_ettr < 1 and m.failures_struck == 1
    b = m.breakdown
    parts = sum(v for k, v in b.items() if k not in ("wall_s", "useful_s"))
    assert b["useful_s"] + parts == pytest.approx(b["wall_s"])
    assert b["down_reform_s"] > 0  # a replacement was started for every death
    assert m.measured_ettr == pytest.approx(b["useful_s"] / b["wall_s"])
    for key in ("model", "simulator_same_failures", "simulator"):
        assert 0 < m.predicted[key] < 1
    assert set(m.experiments) == {"warm_up", "steady", "failures"}
    (one,) = m.runs
    assert one.experiment not in m.experiments.values()  # calibration is not the validation
    assert (one.seed, one.ettr) == (5, m.measured_ettr) and m.measured_interval95 is None
    data = report.as_dict()
    assert data["mechanisms"][0]["ettr"] == m.measured_ettr
    assert data["mechanisms"][0]["runs"][0]["experiment"] == one.experiment
    assert lines[-1].startswith("disk_ckpt: measured ETTR ")
    # however many of its failures a run lives to meet, it recovers from them all
    drawn = given[-1]["failures"]["events"]
    assert given[-1]["max_recoveries"] >= len(drawn) > 1
