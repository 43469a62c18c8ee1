"""ETTR from step and failure records (issue 20, item 1): pure, no Ray."""

from __future__ import annotations

import pytest

from failbench_ray.ettr import measure
from failbench_ray.records import FailureRecord, StepRecord


def step(
    rank: int, n: int, gen: int, start: float, took: float, blocked: float = 0.0
) -> StepRecord:
    return StepRecord(rank, n, gen, 1.0, start, start + took, 4, blocked)


def test_a_run_without_failures_loses_only_its_checkpoint_stalls() -> None:
    # 2 ranks, 10 steps of 1 s, a 0.5 s save blocking every 5th step
    records = []
    t = 0.0
    for n in range(1, 11):
        took = 1.5 if n % 5 == 0 else 1.0
        records += [step(0, n, 0, t, took, 0.5 if n % 5 == 0 else 0.0), step(1, n, 0, t, took)]
        t += took
    got = measure(records, [])
    assert got["wall_s"] == pytest.approx(11.0)
    assert got["ettr"] == pytest.approx(10 / 11)
    assert got["breakdown"]["checkpoint_stall_s"] == pytest.approx(1.0)
    assert got["breakdown"]["other_s"] == pytest.approx(0.0)


def test_a_failure_costs_its_phases_the_work_in_flight_and_the_replay() -> None:
    # steps 1-4 at t=0..4; rank 1 dies at 4.6 (step 5 in flight); recovery 2 s, back to step 2;
    # steps 3-4 replayed, then 5-6: generation 1 from t=6.6
    records = [step(r, n, 0, n - 1.0, 1.0) for n in range(1, 5) for r in (0, 1)]
    records += [step(r, n, 1, 6.6 + (n - 3), 1.0) for n in range(3, 7) for r in (0, 1)]
    failure = FailureRecord(0, [1], "sigkill", "t=4.6s", 5, 4.6)
    failure.phases.update(detected=0.1, quiesced=0.3, reformed=1.5, restored=1.8, resumed=2.0)
    got = measure(records, [failure])
    b = got["breakdown"]
    assert got["wall_s"] == pytest.approx(10.6)
    assert got["useful_s"] == pytest.approx(6.0)  # steps 1-6 once each
    assert b["replayed_s"] == pytest.approx(2.0)  # steps 3-4 of generation 0
    assert b["lost_in_flight_s"] == pytest.approx(0.6)
    assert b["down_detect_s"] == pytest.approx(0.1) and b["down_reform_s"] == pytest.approx(1.2)
    assert sum(v for k, v in b.items() if k.startswith("down_")) == pytest.approx(2.0)
    assert b["other_s"] == pytest.approx(0.0)
    assert got["ettr"] == pytest.approx(6.0 / 10.6)


def test_a_failure_during_a_recovery_is_not_counted_as_work_in_flight() -> None:
    records = [step(0, 1, 0, 0.0, 1.0), step(0, 2, 1, 6.0, 1.0)]
    first = FailureRecord(0, [0], "sigkill", "t=1s", 2, 1.0, interrupted_by=1)
    first.phases.update(detected=0.1, quiesced=0.2)  # cut short by the second
    second = FailureRecord(1, [0], "sigkill", "t=2s", 2, 2.0)
    second.phases.update(detected=0.1, quiesced=0.2, reformed=3.0, restored=3.5, resumed=4.0)
    b = measure(records, [first, second])["breakdown"]
    assert b["lost_in_flight_s"] == pytest.approx(0.0)
    assert b["down_reform_s"] == pytest.approx(0.8 + 2.8)  # the first cut short while re-forming
    assert b["other_s"] == pytest.approx(0.0)


def test_a_recovery_that_takes_a_later_failure_along_counts_its_downtime_once() -> None:
    # rank 3 dies at t=1; rank 1 at t=1.6, while the group re-forms; the recovery goes on
    # and takes both: training resumes at t=7 (as seen on 2 cores)
    records = [step(0, 1, 0, 0.0, 1.0), step(0, 2, 1, 7.0, 1.0)]
    first = FailureRecord(0, [3], "sigkill", "t=1s", 2, 1.0, interrupted_by=1)
    first.phases.update(detected=0.1, quiesced=0.2, reformed=5.0, restored=5.5)
    second = FailureRecord(1, [1], "sigkill", "t=1.6s", 2, 1.6)
    second.phases.update(detected=1.4, quiesced=1.5, reformed=4.5, restored=4.9, resumed=5.4)
    b = measure(records, [first, second])["breakdown"]
    assert sum(v for k, v in b.items() if k.startswith("down_")) == pytest.approx(6.0)
    assert b["down_reform_s"] == pytest.approx(4.8)  # the first's, which the second's is in
    assert b["down_restore_s"] == pytest.approx(0.5) and b["down_resume_s"] == pytest.approx(0.5)
    assert b["other_s"] == pytest.approx(0.0)


def test_no_records_no_ettr() -> None:
    assert measure([], [])["ettr"] is None


def test_an_elastic_regrow_is_downtime_once_however_many_failures_it_takes_back() -> None:
    records = [step(0, n, 0, n - 1.0, 1.0) for n in range(1, 4)]
    records += [step(0, n, 1, n + 1.0, 1.0) for n in range(4, 7)]  # a 1 s regrow at t=3..4
    first = FailureRecord(0, [1], "sigkill", "t=0.5s", 1, 0.5)
    second = FailureRecord(1, [2], "sigkill", "t=1.5s", 2, 1.5)
    for f in (first, second):
        f.phases.update(regrowing=3.0 - f.t_injected, grown=4.0 - f.t_injected)
    b = measure(records, [first, second])["breakdown"]
    assert b["down_regrow_s"] == pytest.approx(1.0)


def test_a_failure_during_a_regrow_pause_is_not_counted_twice() -> None:
    # a regrow pause at t=3..5; another failure at 3.5 recovers at 3.5..4.5, inside it
    records = [step(0, n, 0, n - 1.0, 1.0) for n in range(1, 4)]
    records += [step(0, n, 2, n + 1.0, 1.0) for n in range(4, 7)]
    first = FailureRecord(0, [1], "sigkill", "t=0.5s", 1, 0.5)
    first.phases.update(regrowing=2.5, grown=4.5)
    second = FailureRecord(1, [2], "sigkill", "t=3.5s", 3, 3.5)
    second.phases.update(detected=0.1, quiesced=0.2, reformed=0.8, restored=0.9, resumed=1.0)
    b = measure(records, [first, second])["breakdown"]
    assert sum(v for k, v in b.items() if k.startswith("down_")) == pytest.approx(2.0)
    assert b["down_regrow_s"] == pytest.approx(1.0)
    assert b["lost_in_flight_s"] == pytest.approx(0.0)  # it struck while training was paused
    assert b["other_s"] == pytest.approx(0.0)


def test_a_saves_cost_is_the_median_of_the_steps_that_saved() -> None:
    # every 5th step saves (the first save 0.5 s, the others 0.1 s); the rest block 0.1 ms
    records = []
    t = 0.0
    for n in range(1, 21):
        blocked = (0.5 if n == 5 else 0.1) if n % 5 == 0 else 1e-4
        records.append(step(0, n, 0, t, 1.0 + blocked, blocked))
        t += 1.0 + blocked
    steady = measure(records, [])["steady"]
    assert steady["stall_s_median"] == pytest.approx(0.1)
    assert steady["step_s"] == pytest.approx(1.0)


def test_settled_saves_cost_their_mean_per_step_every_kind_of_save_counted() -> None:
    # a copy every 5 steps (0.1 s) and also a disk save every 20 (0.3 s more); the first
    # third of the run is cold (everything 0.5 s): the settled window leaves it out
    records = []
    t = 0.0
    for n in range(1, 121):
        blocked = 1e-4
        if n % 5 == 0:
            blocked = 0.5 if n <= 40 else 0.1 + (0.3 if n % 20 == 0 else 0.0)
        records.append(step(0, n, 0, t, 1.0 + blocked, blocked))
        t += 1.0 + blocked
    steady = measure(records, [])["steady"]
    # per 20 steps: 4 copies and one disk save, 0.7 s, and 15 steps of 0.1 ms; the window
    # (45, 120] holds whole copy periods, and the disk saves to within one (4, not 3.75)
    per_step = (0.7 + 15 * 1e-4) / 20
    assert steady["stall_s_per_step_settled"] == pytest.approx(per_step, rel=0.03)
    assert steady["stall_s_per_step_settled"] == pytest.approx((15 * 0.1 + 4 * 0.3 + 60e-4) / 75)
    # too few saves after the first third: no settled estimate
    assert measure(records[:8], [])["steady"]["stall_s_per_step_settled"] is None
