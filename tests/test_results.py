"""The pure analysis that turns step and failure records into the result JSON.

Timestamps are sums of powers of two, so every expected duration is exact.
"""

from __future__ import annotations

import pytest

from failbench_ray.records import PHASES, FailureRecord, StepRecord
from failbench_ray.results import (
    failure_result,
    fill_resume_phases,
    final_loss,
    matches_baseline,
    mean_or_none,
    median_or_none,
    overhead_pct,
    sample_accounting,
    steady_state_steps,
    step_durations,
)


def rec(
    rank: int, step: int, gen: int, t_start: float, t_end: float, loss: float = 1.0
) -> StepRecord:
    return StepRecord(
        rank=rank, step=step, generation=gen, loss=loss, t_start=t_start, t_end=t_end, samples=8
    )


def failure(
    injected_at_step: int,
    restored_from_step: int | None,
    t_injected: float = 0.0,
    interrupted_by: int | None = None,
    index: int = 0,
) -> FailureRecord:
    return FailureRecord(
        index=index,
        ranks=[1],
        kill_kind="sigkill",
        trigger=f"step={injected_at_step}",
        injected_at_step=injected_at_step,
        t_injected=t_injected,
        restored_from_step=restored_from_step,
        interrupted_by=interrupted_by,
    )


def duration(gen: int, step: int) -> float:
    """A distinct, exactly representable duration per (generation, step)."""
    return gen + step / 16


def run_records(
    gen: int, steps: range, ranks: int = 2, t0: float = 0.0, slow_rank: int = 1
) -> list[StepRecord]:
    """Records of one generation: `slow_rank` takes duration(gen, step); the others half."""
    out = []
    t = t0
    for step in steps:
        d = duration(gen, step)
        for rank in range(ranks):
            out.append(rec(rank, step, gen, t, t + (d if rank == slow_rank else d / 2)))
        t += d
    return out


# ---------------------------------------------------------------------------------------------
# Step durations and steady state


def test_step_durations_take_the_slowest_rank() -> None:
    records = [
        rec(0, 1, 0, 1.0, 1.5),
        rec(1, 1, 0, 1.0, 1.75),
        rec(2, 1, 0, 1.0, 1.25),
        rec(0, 2, 0, 2.0, 2.25),
        rec(1, 2, 0, 2.0, 2.125),
        rec(0, 2, 1, 9.0, 9.5),  # same step number, another generation: its own entry
    ]
    assert step_durations(records) == {(0, 1): 0.75, (0, 2): 0.25, (1, 2): 0.5}


def test_steady_state_without_failures_drops_only_the_warmup() -> None:
    records = run_records(0, range(1, 9))
    assert steady_state_steps(records, [], warmup_steps=3) == [duration(0, s) for s in range(4, 9)]
    assert steady_state_steps(records, [], warmup_steps=0) == [duration(0, s) for s in range(1, 9)]
    assert steady_state_steps(records, [], warmup_steps=8) == []


def test_steady_state_drops_each_generations_warmup_and_the_replayed_steps() -> None:
    # Generation 0 runs steps 1..7; step 8 is in flight when rank 1 dies; recovery restores the
    # checkpoint of step 4 and generation 1 replays 5..8, then runs on to 12.
    records = run_records(0, range(1, 8)) + run_records(1, range(5, 13), t0=100.0)
    f = failure(injected_at_step=8, restored_from_step=4)
    got = steady_state_steps(records, [f], warmup_steps=2)
    # gen 0: warm-up 1, 2; replayed 5..8 -> 3, 4.  gen 1: warm-up 5, 6; replayed 5..8 -> 9..12.
    expected = [duration(0, s) for s in (3, 4)] + [duration(1, s) for s in (9, 10, 11, 12)]
    assert got == expected


def test_steady_state_after_a_restart_from_scratch() -> None:
    # `none`: restored from step 0, so steps 1..6 are all replays.
    records = run_records(0, range(1, 6)) + run_records(1, range(1, 11), t0=100.0)
    f = failure(injected_at_step=6, restored_from_step=0)
    got = steady_state_steps(records, [f], warmup_steps=1)
    assert got == [duration(1, s) for s in range(7, 11)]


def test_steady_state_with_a_failure_that_was_never_restored() -> None:
    # An interrupted recovery has no restore: only warm-up is dropped on its account.
    records = run_records(0, range(1, 6))
    f = failure(injected_at_step=6, restored_from_step=None, interrupted_by=1)
    assert steady_state_steps(records, [f], warmup_steps=1) == [duration(0, s) for s in range(2, 6)]


def test_median_and_mean() -> None:
    assert median_or_none([3.0, 1.0, 2.0, 100.0]) == 2.5
    assert mean_or_none([1.0, 2.0, 6.0]) == 3.0
    assert median_or_none([]) is None
    assert mean_or_none([]) is None


@pytest.mark.parametrize(
    ("mean", "baseline", "expected"),
    [
        (1.25, 1.0, 25.0),
        (0.5, 1.0, -50.0),
        (2.0, 2.0, 0.0),
        (None, 1.0, None),
        (1.0, None, None),
        (1.0, 0.0, None),
    ],
)
def test_overhead_pct(mean: float | None, baseline: float | None, expected: float | None) -> None:
    assert overhead_pct(mean, baseline) == expected


def test_overhead_pct_inexact_ratio() -> None:
    assert overhead_pct(0.11, 0.1) == pytest.approx(10.0)


# ---------------------------------------------------------------------------------------------
# Final loss


def test_final_loss_is_the_mean_over_ranks_at_the_last_step_of_the_last_generation() -> None:
    records = [
        rec(0, 5, 0, 0.0, 1.0, loss=9.0),
        rec(1, 5, 0, 0.0, 1.0, loss=9.0),
        # generation 0 also had a record at the last step (a rank that finished it before
        # the failure): the last generation's records win
        rec(0, 6, 0, 1.0, 2.0, loss=100.0),
        rec(0, 5, 1, 10.0, 11.0, loss=7.0),
        rec(0, 6, 1, 11.0, 12.0, loss=1.0),
        rec(1, 6, 1, 11.0, 12.0, loss=2.0),
        rec(2, 6, 1, 11.0, 12.0, loss=6.0),
    ]
    assert final_loss(records) == 3.0


def test_final_loss_without_records() -> None:
    assert final_loss([]) is None


# ---------------------------------------------------------------------------------------------
# Resume phases


def test_fill_resume_phases() -> None:
    f = failure(injected_at_step=8, restored_from_step=4, t_injected=100.0)
    f.phases["detected"] = 0.5
    f.phases["restored"] = 3.0
    records = [
        # generation 0: steps 1..7 before the kill (step 5 done at 40: before the injection)
        *(rec(r, s, 0, 10.0 * s - 10, 10.0 * s) for r in (0, 1) for s in range(1, 8)),
        # generation 1: restored from 4, replays 5..8 and goes on
        rec(0, 5, 1, 103.0, 103.5),
        rec(1, 5, 1, 103.0, 104.0),  # every rank done with step 5 at 104
        rec(0, 6, 1, 104.0, 104.5),
        rec(1, 6, 1, 104.0, 104.75),
        rec(0, 7, 1, 105.0, 105.5),
        rec(1, 7, 1, 105.0, 105.25),
        rec(0, 8, 1, 106.0, 106.25),
        rec(1, 8, 1, 106.0, 106.5),  # every rank done with step 8 at 106.5
        rec(0, 9, 1, 107.0, 107.5),
        rec(1, 9, 1, 107.0, 107.5),
    ]
    fill_resume_phases([f], records)
    assert f.phases["resumed"] == 4.0
    assert f.phases["caught_up"] == 6.5
    # the phases the controller measured are left as they were
    assert f.phases["detected"] == 0.5
    assert f.phases["restored"] == 3.0
    assert f.phases["quiesced"] is None


def test_fill_resume_phases_of_two_failures_in_a_row() -> None:
    f0 = failure(injected_at_step=6, restored_from_step=3, t_injected=50.0, index=0)
    f1 = failure(injected_at_step=9, restored_from_step=6, t_injected=80.0, index=1)
    records = [
        *(rec(r, s, 0, 10.0 * s - 10, 10.0 * s) for r in (0, 1) for s in range(1, 6)),
        # generation 1: 4..8, the kill during step 9
        *(rec(r, s, 1, 50.0 + s, 51.0 + s + r / 4) for r in (0, 1) for s in range(4, 9)),
        # generation 2: restored from 6, 7..10
        *(rec(r, s, 2, 80.0 + s, 81.0 + s + r / 2) for r in (0, 1) for s in range(7, 11)),
    ]
    fill_resume_phases([f0, f1], records)
    # f0: step 4 of gen 1 done at 55.25, step 6 at 57.25
    assert f0.phases["resumed"] == 5.25
    assert f0.phases["caught_up"] == 7.25
    # f1: step 7 was done in gen 1 (at 58.25) before the kill at 80: gen 2's step 7 counts
    assert f1.phases["resumed"] == 8.5
    assert f1.phases["caught_up"] == 10.5


def test_fill_resume_phases_for_a_kill_during_recovery() -> None:
    # A kill during recovery is "at" the committed step: caught up as soon as resumed.
    f = failure(injected_at_step=4, restored_from_step=4, t_injected=10.0)
    records = [rec(0, 5, 1, 12.0, 12.5), rec(1, 5, 1, 12.0, 13.0), rec(0, 6, 1, 13.0, 14.0)]
    fill_resume_phases([f], records)
    assert f.phases["resumed"] == 3.0
    assert f.phases["caught_up"] == 3.0


def test_fill_resume_phases_leaves_interrupted_and_unrestored_failures_alone() -> None:
    interrupted = failure(injected_at_step=8, restored_from_step=4, t_injected=10.0, index=0)
    interrupted.interrupted_by = 1
    unrestored = failure(injected_at_step=8, restored_from_step=None, t_injected=10.0, index=1)
    records = [rec(r, s, 1, 10.0 + s, 11.0 + s) for r in (0, 1) for s in range(5, 10)]
    fill_resume_phases([interrupted, unrestored], records)
    assert interrupted.phases == dict.fromkeys(PHASES)
    assert unrestored.phases == dict.fromkeys(PHASES)


def test_fill_resume_phases_when_the_run_never_resumed() -> None:
    f = failure(injected_at_step=8, restored_from_step=4, t_injected=100.0)
    records = [rec(r, s, 0, float(s), s + 0.5) for r in (0, 1) for s in range(1, 8)]
    fill_resume_phases([f], records)
    assert f.phases["resumed"] is None
    assert f.phases["caught_up"] is None


# ---------------------------------------------------------------------------------------------
# The oracle, lost steps, the failure's JSON


@pytest.mark.parametrize(
    ("digest", "baseline", "expected_match", "result"),
    [
        ("abc", "abc", True, True),
        ("abc", "abd", True, False),
        ("abc", "abc", False, None),
        ("abc", "abd", False, None),
        (None, "abc", True, None),
        ("abc", None, True, None),
    ],
)
def test_matches_baseline(
    digest: str | None, baseline: str | None, expected_match: bool, result: bool | None
) -> None:
    assert matches_baseline(digest, baseline, expected_match) is result


@pytest.mark.parametrize(
    ("injected", "restored", "lost"),
    [(25, 20, 5), (25, 0, 25), (20, 20, 0), (25, 30, 0), (25, None, None)],
)
def test_lost_steps(injected: int, restored: int | None, lost: int | None) -> None:
    assert failure(injected_at_step=injected, restored_from_step=restored).lost_steps == lost


def test_failure_result_maps_every_phase() -> None:
    f = failure(injected_at_step=25, restored_from_step=20, t_injected=1.0)
    f.quiesce = "abort"
    f.restore_source = "checkpoint"
    f.phases.update(
        detected=0.25, quiesced=0.5, reformed=1.0, restored=2.0, resumed=2.5, caught_up=4.0
    )
    r = failure_result(f)
    assert r.ranks == [1]
    assert r.injected_at_step == 25
    assert r.restored_from_step == 20
    assert r.lost_steps == 5
    assert r.quiesce == "abort"
    assert r.restore_source == "checkpoint"
    assert r.phases.model_dump() == {
        "detected_s": 0.25,
        "quiesced_s": 0.5,
        "reformed_s": 1.0,
        "restored_s": 2.0,
        "resumed_s": 2.5,
        "caught_up_s": 4.0,
    }


def shares(gen: int, step: int, ranks: list[int], samples: int = 5) -> list[StepRecord]:
    return [StepRecord(r, step, gen, 1.0, 0.0, 1.0, samples) for r in ranks]


def test_a_rollback_counts_the_rolled_back_steps_samples_as_replayed() -> None:
    # ddp, 3 ranks of 5 samples: gen 0 ran steps 1-2, the restore went back to step 0
    records = [*shares(0, 1, [0, 1, 2]), *shares(0, 2, [0, 1, 2])]
    records += [*shares(1, 1, [0, 1, 2]), *shares(1, 2, [0, 1, 2])]
    got = sample_accounting(records, 15)
    assert got == {"samples_replayed": 30, "samples_skipped": 0, "samples_duplicated": 0}


def test_a_server_that_published_a_step_its_workers_never_recorded_still_trained_it() -> None:
    # ps, server rank 0 (no samples) published step 2 and died before workers 1-3 pulled it:
    # only the server recorded it, yet the workers' 15 samples were trained and rolled back
    records = [*shares(0, 1, [0], 0), *shares(0, 1, [1, 2, 3]), *shares(0, 2, [0], 0)]
    records += [*shares(1, 2, [0], 0), *shares(1, 2, [1, 2, 3])]
    assert sample_accounting(records, 15)["samples_replayed"] == 15
    # where each rank updates on its own (gossip, async ps), only what was recorded counts
    assert sample_accounting(records, 15, whole_batch=False)["samples_replayed"] == 0


def test_going_on_without_a_rank_skips_its_share() -> None:
    records = [*shares(0, 1, [0, 1, 2]), *shares(1, 2, [0, 1])]
    got = sample_accounting(records, 15)
    assert got == {"samples_replayed": 0, "samples_skipped": 5, "samples_duplicated": 0}


def test_a_worker_that_died_after_its_step_was_applied_trained_its_share() -> None:
    """Found by `failbench search` (ps/redundant, a kill during the replica transfer of step
    2): worker 3 pushed, the server applied step 2, and worker 3 died in its after-step hook
    before recording it; the survivors went on without a rollback."""
    records = [*shares(0, 1, [0], 0), *shares(0, 1, [1, 2, 3]), *shares(0, 2, [0], 0)]
    records += [*shares(0, 2, [1, 2]), *shares(1, 3, [0], 0), *shares(1, 3, [1, 2, 3])]
    got = sample_accounting(records, 15)
    assert got == {"samples_replayed": 0, "samples_skipped": 0, "samples_duplicated": 0}
    # where each rank updates on its own, the share it never recorded counts as skipped
    assert sample_accounting(records, 15, whole_batch=False)["samples_skipped"] == 5
