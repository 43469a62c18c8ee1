"""Issue 17: the report's view of re-formation (its parts per cell, and the paper's first claim
stated once per re-formation regime), from results alone, without Ray."""

from __future__ import annotations

from typing import Any

import pytest

from failbench_ray.reform_report import (
    PART_SPANS,
    first_claim,
    part_spans,
    parts_table,
    reform_numbers,
    regime,
)
from failbench_ray.results import FailureResult, PhaseTimes, ReformParts, TrialResult


def _failure(quiesced: float, parts: tuple[float, ...], reformed: float, restored: float) -> Any:
    return FailureResult(
        ranks=[1], kill_kind="sigkill", trigger="step=5", injected_at_step=5,
        restored_from_step=4, lost_steps=1, quiesce="abort", restore_source="replica",
        phases=PhaseTimes(
            detected_s=0.01, quiesced_s=quiesced, reformed_s=reformed, restored_s=restored
        ),
        reform=ReformParts(**dict(zip(
            ("replaced_s", "rendezvous_s", "connected_s", "collective_s"), parts, strict=True
        ))),
    )  # fmt: skip


def _trial(*failures: FailureResult, status: str = "completed") -> TrialResult:
    return TrialResult(
        trial=0, status=status, step_time_s=0.1, overhead_pct=1.0, final_loss=1.0,
        params_digest="d", matches_baseline=True, failures=list(failures),
    )  # fmt: skip


def test_part_spans_run_from_quiesced_to_reformed() -> None:
    spans = part_spans(_failure(0.05, (1.0, 1.1, 1.15, 1.2), 2.0, 2.1))
    assert list(spans) == list(PART_SPANS)
    assert [round(v or 0, 6) for v in spans.values()] == [0.95, 0.1, 0.05, 0.05, 0.8]
    unmeasured = FailureResult.model_validate(
        {**_failure(0.05, (1.0, 1.1, 1.15, 1.2), 2.0, 2.1).model_dump(), "reform": {}}
    )  # a result stored before the parts were measured
    assert part_spans(unmeasured)["replacement"] is None


def test_a_cells_numbers_are_medians_over_its_completed_failures() -> None:
    fast = _failure(0.04, (0.05, 0.09, 0.1, 0.12), 0.15, 0.2)
    slow = _failure(0.04, (0.05, 0.09, 0.1, 0.12), 1.05, 1.1)
    numbers = reform_numbers([_trial(fast), _trial(fast), _trial(slow, status="failed")], "fast")
    assert numbers["reform"] == "fast"
    assert numbers["reform_s"] == pytest.approx(0.11)
    assert numbers["restore_s"] == pytest.approx(0.05)
    assert numbers["reform_parts_s"]["trainer"] == pytest.approx(0.03)
    assert numbers["startup_s"] is None and numbers["beyond_startup_s"] is None  # warm: none


def test_a_cold_replacements_start_up_is_taken_out_of_re_formation() -> None:
    # asked for at 0.25 s, up at 2.75 s: 2.5 s of start-up; re-formation 2.9 - 0.05 = 2.85 s
    cold = _failure(0.05, (2.75, 2.8, 2.82, 2.85), 2.9, 2.95)
    cold.reform.spawned_s = 0.25
    numbers = reform_numbers([_trial(cold)], "fast")
    assert numbers["startup_s"] == pytest.approx(2.5)
    assert numbers["beyond_startup_s"] == pytest.approx(0.35)


def _row(mech: str, reform: str, reform_s: float, restore_s: float, trials: int = 3) -> Any:
    return {
        "cell": f"ddp/{mech}/single", "architecture": "ddp", "mechanism": mech,
        "trials": trials, "reform": reform, "reform_s": reform_s, "restore_s": restore_s,
        "overhead_pct": {"disk_ckpt": 2.0, "hot_spare": 30.0}.get(mech, 5.0),
        "reform_parts_s": dict.fromkeys(PART_SPANS, 0.01),
    }  # fmt: skip


def test_the_first_claim_is_stated_per_regime_and_says_when_the_conclusion_depends_on_it() -> None:
    rows = [
        _row("disk_ckpt", "standard", 2.4, 0.05),
        _row("hot_spare", "standard", 1.0, 0.04),
        _row("disk_ckpt", "fast", 0.1, 0.3),
        _row("hot_spare", "fast", 0.1, 0.04),
        _row("none", "fast", 0.1, 0.0),  # no mechanism: left out
    ]
    standard, fast, verdict = first_claim(rows)
    assert standard.startswith("The paper's first claim, re-formation `standard` (2 cells)")
    assert "median 1.7 s" in standard and "spread of 0.01 s, smaller than re-formation" in standard
    assert "`fast` (2 cells)" in fast and "not smaller than re-formation" in fast
    assert "overheads range from 2% (disk_ckpt) to 30% (hot_spare)" in fast
    assert "only in `standard`" in verdict and "depends on how fast the group re-forms" in verdict


def test_one_trial_per_cell_is_said_and_one_regime_gives_no_verdict() -> None:
    (only,) = first_claim([_row("disk_ckpt", "standard", 2.4, 0.05, trials=1),
                           _row("hot_spare", "standard", 1.0, 0.04, trials=1)])  # fmt: skip
    assert only.endswith("one trial per cell, so single mechanisms cannot be told apart.")


def test_the_parts_table_and_the_regime_of_old_results() -> None:
    head, body = parts_table([_row("disk_ckpt", "standard", 2.4, 0.05)])
    assert head[:2] == ["cell", "re-formation s"] and head[-1] == "restore s"
    assert body == [["ddp/disk_ckpt/single", "2.4", *["0.01"] * len(PART_SPANS), "-", "0.05"]]
    assert regime({}) == "standard" and regime({"reform": "fast"}) == "fast"
