"""The decision framework: the analytic model (Young/Daly), the seeded simulator that plays the
same costs through drawn failures, and `failbench recommend` (CLI and GET /v1/recommend)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from failbench_ray import reliability as rel
from failbench_ray.errors import UsageError
from failbench_ray.recommend import PRESETS, Question, measured_costs, recommend, spares_needed
from failbench_ray.results import ExperimentResult
from failbench_ray.simulator import Failures, simulate, simulate_many

HOUR = 3600.0
MONTH = 30 * 86400.0
DISK = rel.Profile("disk_ckpt", save_s=60, restart_s=300)


# -- the analytic model -------------------------------------------------------------------
def test_daly_interval_is_the_optimum_of_the_exact_formula() -> None:
    m = HOUR
    tau = rel.daly_interval(60, m)
    best = max((rel.periodic_ratio(t, 60, 300, m), t) for t in range(100, 3000, 5))
    assert abs(best[1] - tau) / tau < 0.05
    assert rel.periodic_ratio(tau, 60, 300, m) >= best[0] - 1e-4
    # Young's first-order interval is close when the save is short next to the MTBF
    assert abs(rel.young_interval(1, 1e6) - rel.daly_interval(1, 1e6)) / 1e3 < 0.01


@pytest.mark.parametrize(
    "profile",
    [
        DISK,
        rel.Profile("async_ckpt", save_s=5, durable_s=60, restart_s=300),
        rel.Profile("live_recovery", lost_s=2, restart_s=60),
        rel.Profile("inmem_replica", save_s=2, restart_s=60, p_replica_loss=0.1, fallback=DISK),
        rel.Profile("elastic", lost_s=2, restart_s=20, degraded_s=600, degraded_share=1 / 64),
    ],
    ids=lambda p: p.mechanism,
)
def test_simulator_agrees_with_the_formula_where_it_holds(profile: rel.Profile) -> None:
    """Exponential failures, one failure per event: the simulated useful / wall time over a
    month-long job matches the analytic expectation within 1% (and within its interval)."""
    expected = rel.expected_ratio(profile, HOUR)
    got, half = simulate_many(profile, Failures(HOUR), MONTH, world=64, runs=30)
    assert abs(got - expected) / expected < 0.01, (got, half, expected)


def test_simulator_agrees_with_restart_from_scratch() -> None:
    job = 3 * HOUR
    expected = rel.no_checkpoint_ratio(job, 60, HOUR)
    got, half = simulate_many(rel.Profile("none", restart_s=60), Failures(HOUR), job, 8, 600)
    assert abs(got - expected) < max(2 * half, 0.02), (got, half, expected)


def test_simulator_covers_what_the_formula_cannot() -> None:
    inmem = rel.Profile("inmem_replica", save_s=2, restart_s=60, p_replica_loss=0.2, fallback=DISK)
    exp = simulate(inmem, Failures(HOUR), MONTH, world=64, seed=1)
    assert exp.fallbacks > 0.1 * exp.failures  # failures that took the copies too
    assert exp.cascades > 0  # failures during a recovery
    # Weibull with shape < 1 (bursts) changes the answer at the same mean time between failures
    bursty = simulate_many(DISK, Failures(HOUR, "weibull", shape=0.5), MONTH, 64, runs=20)[0]
    assert abs(bursty - simulate_many(DISK, Failures(HOUR), MONTH, 64, runs=20)[0]) > 0.01
    # whole-node failures take 8 workers: an elastic job runs with 8 fewer for a while
    elastic = rel.Profile("elastic", lost_s=1, restart_s=5, degraded_s=1800, degraded_share=1 / 16)
    one = simulate_many(elastic, Failures(HOUR), MONTH, 16, runs=10)[0]
    nodes = simulate_many(elastic, Failures(HOUR, node_share=1.0), MONTH, 16, runs=10)[0]
    assert nodes < one - 0.05
    # seeded: the same seed, the same run
    assert simulate(inmem, Failures(HOUR), MONTH, 64, seed=3) == simulate(
        inmem, Failures(HOUR), MONTH, 64, seed=3
    )


def test_simulator_scales_to_131072_workers() -> None:
    job_mtbf = PRESETS["llama3"].job_mtbf_hours(131_072) * HOUR
    r = simulate(DISK, Failures(job_mtbf), MONTH, world=131_072)
    assert r.failures > 1000 and 0 < r.ratio < 1


# -- recommend ----------------------------------------------------------------------------
def test_recommend_ranks_mechanisms_and_says_why() -> None:
    answer = recommend(Question(architecture="ddp", state_gb=100, world=16384, preset="llama3"))
    ranking = answer["ranking"]
    ratios = [r["ettr"] for r in ranking]
    assert ratios == sorted(ratios, reverse=True)
    names = [r["mechanism"] for r in ranking]
    # with a failure every 3 h, no checkpoint at all never finishes a month-long job
    assert names[-1] == "none" and ranking[-1]["ettr"] < 0.01
    assert names.index("async_ckpt") < names.index("disk_ckpt")
    for r in ranking:
        assert r["why"].startswith(f"{100 * r['ettr']:.1f}% useful")
        if r["simulated"]:
            assert abs(r["simulated"]["ettr"] - r["ettr"]) < 0.02
    assert abs(answer["job_mtbf_hours"] - 54 * 24 / 419) < 0.01
    assert "Llama 3" in answer["preset"]


def test_recommend_lists_what_does_not_apply_with_reasons() -> None:
    answer = recommend(Question(architecture="fsdp", state_gb=10, world=64, mtbf_hours=5e4))
    refused = {r["mechanism"]: r["reason"] for r in answer["not_applicable"]}
    assert "live_recovery" in refused and refused["live_recovery"]
    assert "live_recovery" not in {r["mechanism"] for r in answer["ranking"]}
    assert answer["state_gb_per_rank"] == pytest.approx(10 / 64)  # fsdp shards the state


def test_measured_costs_come_from_stored_runs_and_scale_with_world_size() -> None:
    def result(mech: str, world: int, detected: float, blocked: float) -> ExperimentResult:
        failure = {
            "index": 0,
            "ranks": [1],
            "kill_kind": "sigkill",
            "trigger": "step=5",
            "injected_at_step": 5,
            "restored_from_step": 4,
            "lost_steps": 1,
            "quiesce": "abort",
            "restore_source": "disk",
            "phases": {"detected_s": detected, "quiesced_s": detected + 0.1, "reformed_s": 4.0},
        }
        trial = {
            "trial": 0,
            "status": "completed",
            "step_time_s": 0.1,
            "overhead_pct": 5.0,
            "final_loss": 1.0,
            "params_digest": "x",
            "matches_baseline": True,
            "state_bytes_per_rank": 1 << 29,  # 0.5 GB
            "checkpoint": {"blocked_s_per_save": blocked, "restore_s_max": 0.25},
            "failures": [failure],
        }
        spec = {"mechanism": {"name": mech}, "world_size": world}
        return ExperimentResult.model_validate(
            {
                "experiment_id": "e",
                "status": "completed",
                "spec": spec,
                "baseline": None,
                "trials": [trial],
            }
        )

    runs = [result("disk_ckpt", 4, 0.1, 0.5), result("disk_ckpt", 16, 0.3, 0.7)]
    costs = measured_costs(runs, world=64)
    assert costs.save_s_per_gb == pytest.approx(1.2)  # median of 1.0 and 1.4 s per GB
    assert costs.read_s_per_gb == pytest.approx(0.5)
    # detection grew by 0.2 s from 4 to 16 ranks: at 64 ranks, 0.2 s more again
    assert costs.detect_s == pytest.approx(0.5)
    assert "2 trials" in costs.note("save_s_per_gb") and "[4, 16]" in costs.note("detect_s")
    assert costs.note("copy_s_per_gb") == "default"


ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "failbench_ray.cli", "recommend", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--architecture", "resnet", "--world", "8", "--mtbf-hours", "1000"],
            "unknown architecture 'resnet'; choose one of ddp, fsdp",
        ),
        (
            ["--architecture", "ddp", "--world", "8", "--mtbf-hours", "0"],
            "--mtbf-hours must be at least 0.001 (3.6 s) (got 0)",
        ),
        (
            ["--architecture", "ddp", "--world", "8", "--mtbf-hours", "-3"],
            "--mtbf-hours must be at least 0.001 (3.6 s) (got -3)",
        ),
        (
            ["--architecture", "ddp", "--world", "1", "--mtbf-hours", "1000"],
            "--world must be at least 2 (got 1)",
        ),
        (
            ["--architecture", "ddp", "--world", "8", "--preset", "frontier"],
            "unknown preset 'frontier'; choose one of llama3",
        ),
    ],
)
def test_recommend_refuses_bad_questions_with_clear_messages(
    tmp_path: Path, args: list[str], message: str
) -> None:
    r = _cli(*args, "--state-gb", "10", "--db", f"sqlite:///{tmp_path / 'fb.db'}")
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and message in r.stderr, r.stderr


def test_recommend_cli_json(tmp_path: Path) -> None:
    r = _cli(
        "--architecture",
        "pipeline",
        "--state-gb",
        "40",
        "--world",
        "1024",
        "--preset",
        "kokolis-1k",
        "--json",
        "--db",
        f"sqlite:///{tmp_path / 'fb.db'}",
    )
    assert r.returncode == 0, r.stderr
    answer = json.loads(r.stdout)
    assert answer["ranking"] and math.isclose(answer["job_mtbf_hours"], 7.9, rel_tol=1e-6)


def test_a_question_whose_failures_outrun_every_recovery_ends_and_says_so() -> None:
    """Issue 16: job failures every 0.45 s and recoveries of seconds once looped forever (the
    simulator waited for a job that never finishes). Each run now stops after its share of the
    failure budget, and the answer says how many were cut short."""
    answer = recommend(Question(architecture="ddp", state_gb=1, world=8, mtbf_hours=0.001))
    sims = [r["simulated"] for r in answer["ranking"] if r["simulated"]]
    assert sims and all(s["cut_short"] == s["runs"] == 20 for s in sims), sims
    assert all("before the job was done" in s["note"] and 0 <= s["ettr"] < 1 for s in sims)
    # the largest question allowed is bounded too, formulas included (exp() overflowed)
    worst = Question(
        architecture="ddp", state_gb=1e6, world=1_048_576, mtbf_hours=1e-3, simulate_runs=200
    )
    assert all(r["ettr"] == 0.0 for r in recommend(worst)["ranking"])


def test_a_short_run_of_the_simulator_is_cut_short_not_endless() -> None:
    slow = rel.Profile("disk_ckpt", save_s=60, restart_s=600)
    r = simulate(slow, Failures(60.0), MONTH, world=8, max_failures=500)
    assert (r.finished, r.failures) == (False, 500) and r.work_s < MONTH and 0 <= r.ratio < 0.01
    done = simulate(DISK, Failures(HOUR), MONTH, world=64, seed=1)
    assert done.finished and done.work_s == MONTH
    # failures bounded is not enough: a long job with rare failures steps through every save
    steps = simulate(DISK, Failures(HOUR), MONTH, world=64, seed=1, max_steps=10)
    assert (steps.finished, steps.out_of_steps) == (False, True) and steps.work_s < MONTH


def test_an_mtbf_below_the_floor_is_refused_with_what_to_change() -> None:
    q = Question(architecture="ddp", state_gb=1, world=8, mtbf_hours=5e-324)
    with pytest.raises(UsageError, match=r"--mtbf-hours must be at least 0.001"):
        recommend(q)


def test_a_job_of_many_saves_and_few_failures_is_bounded_and_says_so() -> None:
    """Found by the API fuzz with the registered names: a million workers rarely failing
    over ten years ran for over a minute (a step per fallback save); now the step budget."""
    q = Question(
        architecture="hybrid", state_gb=1, world=1_048_576, mtbf_hours=1e7, job_days=3650,
        simulate_runs=200,
    )  # fmt: skip
    sims = [r["simulated"] for r in recommend(q)["ranking"] if r["simulated"]]
    assert sims and all(0 <= s["ettr"] <= 1 for s in sims)
    cut = [s for s in sims if s["cut_short"]]
    assert all("before the job was done" in s["note"] for s in cut)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("world", 1_048_577),
        ("state_gb", float("inf")),
        ("job_days", 1e9),
        ("step_s", float("nan")),
        # denormals divided by zero, and overflowed, in the model (the API fuzz)
        ("state_gb", 5e-324),
        ("job_days", 5e-324),
        ("step_s", 1.1e-308),
    ],
)
def test_every_number_that_sizes_the_work_is_bounded(field: str, value: float) -> None:
    base = {"architecture": "ddp", "state_gb": 1, "world": 8, "mtbf_hours": 1.0}
    with pytest.raises(ValidationError):
        Question(**{**base, field: value})


def test_recommend_answers_with_a_policy_for_its_first_choice() -> None:
    """Issue 20, item 5: the mechanism, its checkpoint interval, the spares, the hang timeout
    and the ETTR to expect with the range one job's falls in."""
    q = Question(architecture="tensor", state_gb=400, world=1024, mtbf_hours=2000)
    answer = recommend(q)
    pol, first = answer["policy"], answer["ranking"][0]
    assert pol["mechanism"] == first["mechanism"] and pol["ettr"] == first["ettr"]
    assert pol["checkpoint_interval_s"] == first["interval_s"]
    low, high = pol["ettr_interval95"]
    assert low <= first["simulated"]["ettr"] <= high
    assert abs(pol["ettr"] - first["simulated"]["ettr"]) < 0.02
    # 1024 / 2000 = 0.51 failures an hour, 2.05 in a 4 h repair window: 99% need 6 spares
    assert pol["spares"] == 6
    assert pol["hang_timeout_s"] >= 1.5 and "spare(s) cover 99%" in pol["why"]
    assert spares_needed(0.0, 4, 0.99) == 0 and spares_needed(1.0, 1.0, 0.5) == 1
