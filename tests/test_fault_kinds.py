"""Faults beyond the clean kill (issue 19): segfault, abort, an exception, a hang (SIGSTOP), a
held GIL and a preemption with notice, each injected for real and recovered; the heartbeat that
finds the hangs; their parameters' checks."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from failbench_ray import kinds_report
from failbench_ray.catalog import catalog
from failbench_ray.checks import resolve
from failbench_ray.controller.heartbeat import Heartbeat
from failbench_ray.controller.notice import next_save_step
from failbench_ray.errors import SpecError
from failbench_ray.results import ExperimentResult, FailureResult, PhaseTimes, TrialResult
from failbench_ray.runner import run_experiment
from failbench_ray.spec import parse_spec
from failbench_ray.storage import repo
from failbench_ray.storage.db import Database
from injector.chaos import Chaos
from injector.kill_kinds import KILL_KINDS
from tests.test_engine import small as engine_small

# -- pure parts --------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_heartbeat_finds_the_rank_that_stopped_answering() -> None:
    clock = Clock()
    hb = Heartbeat(1.5, clock)
    for r in (0, 1, 2):
        hb.sent(r)
    clock.now += 0.2
    hb.answered(0)
    hb.answered(2)
    assert hb.hung({0, 1, 2}) == set()
    for _ in range(8):  # pings go out every beat; rank 1 answers none of them
        clock.now += 0.2
        for r in (0, 1, 2):
            hb.sent(r)
        hb.answered(0)
        hb.answered(2)
    assert hb.silent_s(1) == pytest.approx(1.8)  # since its oldest unanswered ping
    assert hb.hung({0, 1, 2}) == {1}
    hb.restart()
    assert hb.hung({0, 1, 2}) == set()


def test_the_heartbeat_blames_no_rank_when_every_rank_is_silent_or_it_is_off() -> None:
    clock = Clock()
    hb = Heartbeat(1.0, clock)
    hb.sent(0)
    hb.sent(1)
    clock.now += 5
    assert hb.hung({0, 1}) == set()  # the driver itself stalled: nobody to blame
    off = Heartbeat(None, clock)
    off.sent(0)
    clock.now += 1000
    assert off.hung({0, 1}) == set()


def test_the_save_on_notice_step_is_ahead_of_every_rank_and_within_the_trial() -> None:
    assert next_save_step({0: 7, 1: 6}, end=100) == 9
    assert next_save_step({}, end=100) == 2
    assert next_save_step({0: 99}, end=100) is None


def test_a_notice_comes_first_and_the_kill_strikes_notice_s_later() -> None:
    """The chaos actor's logic without Ray, on a real process: SIGTERM after the notice, then
    SIGKILL after the grace period if it is still alive."""
    victim = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60"])  # ignores SIGTERM
    try:
        chaos = Chaos(
            [
                {
                    "ranks": [0],
                    "at_seconds": 0,
                    "kill": "preempt",
                    "kill_params": {"notice_s": 0.3, "grace_s": 0.3},
                }
            ]
        )
        chaos.set_targets({0: (victim.pid, None, "")})
        t0 = time.time()
        chaos._fire(0, None)
        assert chaos.fired() == [0]
        assert list(chaos.noticed()) == [0] and chaos.injections() == []
        assert victim.wait(timeout=10) == -signal.SIGKILL  # the grace ran out
        (inj,) = chaos.injections()
        assert chaos.noticed() == {}
        assert inj.t_injected - t0 >= 0.3  # recorded when it struck, not at the notice
    finally:
        victim.kill()
        victim.wait()


def one_event(**event: Any) -> dict[str, Any]:
    return {"failures": {"kind": "single", "rank": 1, "at_step": 3, **event}}


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (
            one_event(kill="preempt", kill_params={"notice_s": -1}),
            "failures.events[0].kill_params.notice_s: Input should be greater than or equal to 0"
            " (preempt's parameters: notice_s, grace_s)",
        ),
        (
            one_event(kill="preempt", kill_params={"notise_s": 1}),
            "failures.events[0].kill_params.notise_s: Extra inputs are not permitted",
        ),
        (one_event(kill="gil_hang", kill_params={"hold_s": 0}), "hold_s: Input should be greater"),
        (one_event(kill="hang", kill_params={"hold_s": 5}), "(hang's parameters: none)"),
        (one_event(kill="sigstop"), "unknown kill kind 'sigstop'; valid: abort, exception"),
        (
            {**one_event(kill="hang"), "detectors": {"heartbeat_timeout_s": None}},
            "kill=hang leaves the process alive and only the heartbeat finds it",
        ),
        (
            {"failures": {"kind": "single", "rank": 1, "at_seconds": 2, "kill": "segfault"}},
            "kill=segfault needs a trigger inside the worker",
        ),
    ],
)
def test_bad_fault_parameters_get_one_line_that_says_what_to_change(
    data: dict[str, Any], says: str
) -> None:
    with pytest.raises(SpecError) as err:
        resolve(parse_spec(data))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_heartbeat_timeout_of_zero_is_refused() -> None:
    with pytest.raises(SpecError, match=r"detectors.heartbeat_timeout_s: Input should be greater"):
        parse_spec({"detectors": {"heartbeat_timeout_s": 0}})


def test_the_catalog_says_which_detector_finds_each_kind() -> None:
    data = catalog()
    kinds = {k["name"]: k for k in data["kill_kinds"]}
    assert set(kinds) == set(KILL_KINDS.names())
    assert {n for n, k in kinds.items() if k["detector"] == "heartbeat"} == {"hang", "gil_hang"}
    assert kinds["preempt"]["params"]["notice_s"]["default"] == 2.0
    assert {d["name"] for d in data["detectors"]} == {"death", "heartbeat"}


def _trial(status: str, exact: bool | None, *failures: tuple[str, str, float]) -> TrialResult:
    return TrialResult(
        trial=0,
        status=status,
        step_time_s=None,
        overhead_pct=None,
        final_loss=None,
        params_digest=None,
        matches_baseline=exact,
        match_expected=exact is not None,
        failures=[
            FailureResult(
                ranks=[1],
                kill_kind=kind,
                trigger="step=3",
                injected_at_step=3,
                restored_from_step=0,
                lost_steps=3,
                quiesce="abort",
                restore_source="checkpoint",
                detector=detector,
                phases=PhaseTimes(detected_s=detected),
            )
            for kind, detector, detected in failures
        ],
    )


def test_the_report_says_which_mechanism_recovered_from_which_kind() -> None:
    a = ExperimentResult(
        experiment_id="a",
        status="completed",
        spec={},
        baseline=None,
        trials=[
            _trial("completed", True, ("hang", "heartbeat", 1.6)),
            _trial("completed", False, ("hang", "heartbeat", 1.8)),
            _trial("failed", None, ("hang", "heartbeat", 2.0), ("sigkill", "death", 0.01)),
        ],
    )
    rows = kinds_report.kind_rows([("disk_ckpt", a)])
    assert [(r.mechanism, r.kind, r.trials, r.completed) for r in rows] == [
        ("disk_ckpt", "hang", 3, 2),
        ("disk_ckpt", "sigkill", 1, 0),
    ]
    head, body = kinds_report.table(rows)
    assert body[0] == ["disk_ckpt", "hang", "heartbeat", "1.800", "2/3", "1/2"]
    assert body[1][-1] == "not expected"


# -- end to end: real faults on real Ray actors -------------------------------------------------


def small(**over: Any) -> dict[str, Any]:
    """test_engine's small ddp job, on 2 ranks, with a group timeout a hang cannot hide behind
    (the heartbeat must find it, not this)."""
    base = {"world_size": 2, "steps": 40, "batch_size": 16, "pg_timeout_s": 300}
    return engine_small(**{**base, **over})


@pytest.fixture(scope="module")
def shared(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Database, dict[str, str]]]:
    """One database for the module, and the first experiment of each baseline key: the cells
    differ only in their failure, so they share one matched no-fault run."""
    path = tmp_path_factory.mktemp("faults") / "faults.db"
    db = Database(f"sqlite:///{path}")
    yield db, {}
    db.dispose()


def run(
    shared: tuple[Database, dict[str, str]], spec_data: dict[str, Any], tmp_path: Path
) -> ExperimentResult:
    from failbench_ray.runner import baseline_key

    db, baselines = shared
    spec = parse_spec(spec_data)
    key = baseline_key(spec)
    result = run_experiment(spec, db=db, out_dir=tmp_path / "runs", baseline_of=baselines.get(key))
    baselines.setdefault(key, result.experiment_id)
    with db.session() as s:
        assert repo.load_result(s, result.experiment_id) == result
    return result


def recovered_from(result: ExperimentResult, kind: str, detector: str) -> Any:
    trial = result.trials[0]
    assert trial.status == "completed", trial.error
    (f,) = trial.failures
    assert (f.kill_kind, f.ranks, f.detector) == (kind, [1], detector)
    assert f.phases.detected_s is not None and f.phases.restored_s is not None
    assert f.restore_source.startswith("checkpoint")
    # The oracle: rolled back to a checkpoint and replayed, bit for bit the baseline.
    assert trial.matches_baseline is True
    return f


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("kind", ["segfault", "abort", "exception"])
def test_a_fault_inside_the_worker_is_a_death_and_is_recovered(
    shared: tuple[Database, dict[str, str]], tmp_path: Path, kind: str
) -> None:
    f = recovered_from(
        run(shared, small(**one_event(kill=kind, at_step=12)), tmp_path), kind, "death"
    )
    assert (f.injected_at_step, f.restored_from_step) == (12, 10)


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("kind", ["hang", "gil_hang"])
def test_a_hang_is_found_by_the_heartbeat_ended_and_recovered(
    shared: tuple[Database, dict[str, str]], tmp_path: Path, kind: str
) -> None:
    """The rank lives and holds its sockets; its peer waits in the all-reduce (for 300 s, the
    process group's timeout). The heartbeat finds it, the driver ends it, disk_ckpt recovers."""
    f = recovered_from(
        run(shared, small(**one_event(kill=kind, at_step=12)), tmp_path), kind, "heartbeat"
    )
    assert f.restored_from_step == 10
    # Found after the heartbeat's timeout (1.5 s by default), not the group's 300 s.
    assert 1.5 <= f.phases.detected_s < 60


@pytest.mark.usefixtures("no_leaks")
def test_a_preemption_notice_is_saved_on_and_the_kill_rolls_back_only_to_it(
    shared: tuple[Database, dict[str, str]], tmp_path: Path
) -> None:
    """disk_ckpt with no checkpoint on its schedule in the whole trial: the only checkpoint is
    the one every rank saves on the notice, before the SIGTERM lands."""
    spec = small(
        steps=2000,  # ~3 ms a step: the trial outlasts the notice by seconds
        mechanism={"name": "disk_ckpt", "params": {"interval": 10_000}},
        **one_event(kill="preempt", at_step=5, kill_params={"notice_s": 0.5, "grace_s": 1.0}),
    )
    f = recovered_from(run(shared, spec, tmp_path), "preempt", "death")
    assert f.restored_from_step is not None and f.restored_from_step > 5
    assert f.injected_at_step > f.restored_from_step  # struck after the save, not at the notice


@pytest.mark.usefixtures("no_leaks")
def test_a_hung_pipeline_stage_is_found_and_recovered(
    shared: tuple[Database, dict[str, str]], tmp_path: Path
) -> None:
    spec = small(
        architecture={"name": "pipeline", "params": {"schedule": "1f1b", "microbatches": 4}},
        **one_event(kill="hang", at_step=12),
    )
    recovered_from(run(shared, spec, tmp_path), "hang", "heartbeat")
