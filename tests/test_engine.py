"""The engine end to end: real Ray actors, real kills, real SQL. Small cells keep it fast."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from failbench_ray.results import ExperimentResult
from failbench_ray.runner import run_experiment
from failbench_ray.spec import parse_spec
from failbench_ray.storage import repo
from failbench_ray.storage.db import Database

PHASE_ORDER = ["detected_s", "quiesced_s", "reformed_s", "restored_s", "resumed_s", "caught_up_s"]


def small(**over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "architecture": "ddp",
        "world_size": 4,
        "model": {"kind": "mlp", "input_dim": 16, "hidden_dim": 32, "depth": 2},
        "steps": 20,
        "batch_size": 32,
        "mechanism": {"name": "disk_ckpt", "params": {"interval": 5}},
        "pg_timeout_s": 60,
        "warmup_steps": 2,
    }
    spec.update(over)
    return spec


def run(spec: dict[str, Any], db_url: str, tmp_path: Path, **kw: Any) -> ExperimentResult:
    db = Database(db_url)
    try:
        result = run_experiment(parse_spec(spec), db=db, out_dir=tmp_path / "runs", **kw)
        with db.session() as s:
            assert repo.load_result(s, result.experiment_id) == result
        return result
    finally:
        db.dispose()


def assert_recovered(result: ExperimentResult, n_failures: int) -> None:
    assert result.status == "completed"
    assert result.baseline is not None and result.baseline.status == "completed"
    trial = result.trials[0]
    assert trial.status == "completed", trial.error
    assert len(trial.failures) == n_failures
    last = trial.failures[-1]
    times = [getattr(last.phases, p) for p in PHASE_ORDER]
    assert all(t is not None for t in times), times
    assert times == sorted(times), f"phases out of order: {times}"
    # The oracle: rolled back and replayed, so the final parameters equal the baseline's.
    assert trial.match_expected
    assert trial.matches_baseline is True
    assert trial.params_digest == result.baseline.params_digest


@pytest.mark.usefixtures("no_leaks")
def test_disk_ckpt_single_sigkill_rolls_back_and_matches(sqlite_url: str, tmp_path: Path) -> None:
    spec = small(failures={"kind": "single", "rank": 1, "at_step": 12})
    result = run(spec, sqlite_url, tmp_path)
    assert_recovered(result, 1)
    f = result.trials[0].failures[0]
    assert (f.ranks, f.kill_kind, f.injected_at_step) == ([1], "sigkill", 12)
    assert (f.restored_from_step, f.lost_steps) == (10, 2)
    assert f.restore_source.startswith("checkpoint")
    trial = result.trials[0]
    assert trial.overhead_pct is not None and trial.step_time_s is not None
    assert trial.model_extra is not None and trial.model_extra["checkpoint"]["saves"] == 4


@pytest.mark.usefixtures("no_leaks")
def test_none_restarts_from_step_zero_after_ray_kill(sqlite_url: str, tmp_path: Path) -> None:
    spec = small(
        mechanism="none", failures={"kind": "single", "rank": 2, "at_step": 8, "kill": "ray_kill"}
    )
    result = run(spec, sqlite_url, tmp_path)
    assert_recovered(result, 1)
    f = result.trials[0].failures[0]
    assert (f.kill_kind, f.restored_from_step, f.lost_steps) == ("ray_kill", 0, 8)


@pytest.mark.usefixtures("no_leaks")
def test_concurrent_kill_of_two_ranks_by_exit(sqlite_url: str, tmp_path: Path) -> None:
    spec = small(failures={"kind": "concurrent", "ranks": [0, 3], "at_step": 13, "kill": "exit"})
    result = run(spec, sqlite_url, tmp_path)
    assert_recovered(result, 1)
    f = result.trials[0].failures[0]
    assert (sorted(f.ranks), f.kill_kind, f.restored_from_step) == ([0, 3], "exit", 10)


@pytest.mark.usefixtures("no_leaks")
def test_cascading_kill_while_restoring(sqlite_url: str, tmp_path: Path) -> None:
    spec = small(
        failures={
            "kind": "cascading",
            "events": [{"rank": 1, "at_step": 12}, {"rank": 2, "during": "restoring"}],
        }
    )
    result = run(spec, sqlite_url, tmp_path)
    assert_recovered(result, 2)
    first, second = result.trials[0].failures
    assert first.interrupted_by == 1 and second.trigger == "during=restoring"
    assert first.phases.reformed_s is not None and second.phases.detected_s is not None
    # The second kill landed after the first recovery re-formed the group, before it restored.
    assert second.restored_from_step == first.restored_from_step == 10


@pytest.mark.usefixtures("no_leaks")
def test_kill_in_the_middle_of_a_checkpoint_write(sqlite_url: str, tmp_path: Path) -> None:
    spec = small(
        failures={"kind": "single", "rank": 0, "at_step": 10, "during": "checkpoint_write"}
    )
    result = run(spec, sqlite_url, tmp_path, keep_checkpoints=True)
    assert_recovered(result, 1)
    f = result.trials[0].failures[0]
    # The torn write of step 10 never became a checkpoint: recovery used step 5.
    assert f.restored_from_step == 5
    ckpt = tmp_path / "runs" / result.experiment_id / "trial0" / "ckpt"
    assert list(ckpt.glob("step_00000010/.shard_00000.pt.tmp.*")), "the torn temp file is left"
    assert (ckpt / "step_00000010" / "shard_00000.pt").is_file()  # written again on replay


@pytest.mark.usefixtures("no_leaks")
def test_wait_timeout_quiesce_waits_for_the_process_group_timeout(
    sqlite_url: str, tmp_path: Path
) -> None:
    spec = small(
        quiesce="wait_timeout",
        pg_timeout_s=3,
        failures={"kind": "single", "rank": 1, "at_step": 12},
    )
    result = run(spec, sqlite_url, tmp_path)
    assert_recovered(result, 1)
    ph = result.trials[0].failures[0].phases
    assert ph.quiesced_s is not None and ph.detected_s is not None
    # Rank 3 is not a ring neighbour of rank 1: it sits in the collective until the timeout.
    assert ph.quiesced_s - ph.detected_s > 1.5


@pytest.mark.usefixtures("no_leaks")
def test_kill_survivors_quiesce_replaces_every_rank(sqlite_url: str, tmp_path: Path) -> None:
    spec = small(quiesce="kill_survivors", failures={"kind": "single", "rank": 1, "at_step": 12})
    result = run(spec, sqlite_url, tmp_path)
    assert_recovered(result, 1)
    assert result.trials[0].failures[0].quiesce == "kill_survivors"


@pytest.mark.usefixtures("no_leaks")
def test_time_triggered_kill_on_postgres(pg_url: str, tmp_path: Path) -> None:
    spec = small(steps=400, failures={"kind": "single", "rank": 3, "at_seconds": 2.0})
    result = run(spec, pg_url, tmp_path)
    assert_recovered(result, 1)
    f = result.trials[0].failures[0]
    assert f.trigger == "t=2s" and 1 <= f.injected_at_step <= 400
    # A timer knows no step: the step in flight is the slowest survivor's next one. DDP keeps
    # one shard, written by one rank, which may have finished (and saved) that step while a
    # slower survivor was still in its collective: then nothing of it was lost.
    latest = {(f.injected_at_step - 1) // 5 * 5, f.injected_at_step // 5 * 5}
    assert f.restored_from_step in latest
