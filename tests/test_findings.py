"""The report states only what its intervals support (`failbench_ray.findings`), on made-up
rows: "best" where intervals separate, "not distinguishable" where they overlap, "no
detectable overhead" where an interval holds zero, throughput changes only where significant,
and nothing from one-trial cells."""

from __future__ import annotations

from typing import Any

from failbench_ray import findings, report
from failbench_ray.stats import Comparison


def row(
    mechanism: str,
    overhead: list[float],
    *,
    arch: str = "ddp",
    trace: str = "single",
    resumed: list[float] | None = None,
    ratios: list[float] | None = None,
    loss: Comparison | None = None,
    reform: str = "standard",
) -> dict[str, Any]:
    return {
        "cell": f"{arch}/{mechanism}/{trace}",
        "architecture": arch,
        "mechanism": mechanism,
        "trace": trace,
        "reform": reform,
        "trials": len(overhead),
        "overhead_samples": overhead,
        "resumed_samples": resumed or [],
        "to_base_samples": [],
        "throughput_ratios": ratios or [],
        "loss_vs_baseline": loss,
    }


def _about(found: list[str], needle: str) -> list[str]:
    return [f for f in found if needle in f]


def test_best_only_where_the_intervals_separate() -> None:
    found = findings.findings(
        [row("disk_ckpt", [1.0, 1.2, 0.9, 1.1]), row("inmem_replica", [9.0, 10.0, 11.0, 10.5])]
    )
    (line,) = _about(found, "steady-state overhead")
    assert line.startswith("ddp: best by steady-state overhead: **disk_ckpt** (1.05% [")
    assert "n=4" in line


def test_overlapping_intervals_name_the_candidates_not_a_winner() -> None:
    rows = [
        row("disk_ckpt", [1.0, 5.0, -2.0]),
        row("inmem_replica", [2.0, 6.0, -1.0]),
        row("jit_ckpt", [40.0, 41.0, 42.0]),
    ]
    (line,) = _about(findings.findings(rows), "steady-state overhead,")
    assert line.startswith("ddp: by steady-state overhead, not distinguishable: disk_ckpt (")
    assert "inmem_replica (" in line and "jit_ckpt" not in line and "best" not in line


def test_recovery_times_are_compared_within_one_trace() -> None:
    rows = [
        row("disk_ckpt", [1.0, 2.0], resumed=[2.0, 2.1, 2.2]),
        row("hot_spare", [1.0, 2.0], resumed=[0.30, 0.31, 0.29]),
        row("disk_ckpt", [1.0, 2.0], trace="concurrent", resumed=[2.5, 2.4]),
    ]
    found = _about(findings.findings(rows), "time from the kill")
    assert found == [
        "ddp/single: best by time from the kill to training again: **hot_spare** "
        "(0.3 s [0.275, 0.325], n=3)."
    ]


def test_an_overhead_interval_holding_zero_is_no_detectable_overhead() -> None:
    rows = [
        row("disk_ckpt", [-3.0, 2.0, 4.0]),
        row("disk_ckpt", [30.0, 31.0, 29.0], arch="fsdp"),
    ]
    found = findings.findings(rows)
    assert "disk_ckpt: no detectable overhead on ddp (interval holds 0)." in found
    (spread,) = _about(found, "disk_ckpt's overhead ranges")
    assert "(ddp) to 30% [" in spread and "(fsdp) across 2 architectures" in spread


def test_an_overhead_range_whose_ends_overlap_is_not_stated() -> None:
    rows = [row("disk_ckpt", [1.0, 9.0, 5.0]), row("disk_ckpt", [3.0, 11.0, 7.0], arch="ps")]
    (line,) = _about(findings.findings(rows), "disk_ckpt's overhead")
    assert "cannot be told apart across 2 architectures" in line and "ranges" not in line


def test_a_throughput_change_is_a_finding_only_where_significant() -> None:
    lower = Comparison("wall_s", 1.0, 30, 30, -0.2, (-0.3, -0.1), 0.001, "lower")
    rose = row("elastic", [1.0, 2.0, 1.5], arch="gossip", ratios=[1.18, 1.17, 1.19], loss=lower)
    noise = row("elastic", [1.0, 2.0, 1.5], arch="ps", ratios=[0.8, 1.3, 1.2])
    found = _about(findings.findings([rose, noise]), "throughput")
    assert found == [
        "gossip/elastic/single: throughput rose 1.18x [1.16, 1.2], n=3 after the failure and "
        "became loss progress (lower loss than the baseline at matched time)."
    ]


def test_one_trial_cells_are_marked_and_give_no_finding() -> None:
    rows = [
        row("disk_ckpt", [-16.8], ratios=[1.21]),
        row("jit_ckpt", [34.7], ratios=[1.3]),
        row("none", [0.0]),  # the no-mechanism cell is not a candidate
    ]
    assert findings.findings(rows) == [
        "2 of 2 cells ran one trial (marked † in the table): they have no interval and give no "
        "finding; run them with `trials: 3` or more."
    ]
    assert report._trials(1) == "1†" and report._trials(3) == "3" and report._trials(0) == "0"


def test_the_paper_matrix_reads_as_a_smoke_test() -> None:
    (note, _) = report.smoke_note("paper_matrix")
    assert "quick smoke test" in note and "no finding" in note
    assert report.smoke_note("findings") == []


def test_estimate() -> None:
    assert findings.estimate([]) is None
    one = findings.estimate([2.0])
    assert one is not None and one.ci95 is None and one.text(" s") == "2 s, n=1"
    two = findings.estimate([1.0, 3.0])
    assert two is not None and two.ci95 is not None and two.holds(2.0) and not two.holds(50.0)


def test_a_regime_is_not_an_architecture() -> None:
    """The same cell in both re-formation regimes: two regimes of one architecture, never a
    range "across 2 architectures"."""
    rows = [row("disk_ckpt", [10.0, 11.0, 12.0]), row("disk_ckpt", [1.0, 2.0, 1.5], reform="fast")]
    found = findings.findings(rows)
    assert not _about(found, "across")
    assert not _about(found, "no detectable")


def test_the_baselines_noise_widens_an_overheads_interval() -> None:
    # trials agree closely (5.0-5.2%) but the one baseline's steps are noisy: its mean is
    # uncertain, and every trial's overhead moves with it
    base = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0]
    var, df = findings.baseline_noise(base, 5.1)
    se = 0.1414213562 / 6**0.5  # the baseline mean's standard error, seconds (mean 1.0 s)
    assert df == 5 and abs(var - (105.1 * se) ** 2) < 1e-6
    narrow = findings.estimate([5.0, 5.1, 5.2])
    wide = findings.estimate([5.0, 5.1, 5.2], var, df)
    assert narrow is not None and wide is not None and narrow.ci95 and wide.ci95
    assert not narrow.holds(0.0) and wide.holds(0.0)  # no longer "significantly" above zero
    noisy = row("disk_ckpt", [5.0, 5.1, 5.2]) | {"overhead_base_var": var, "overhead_base_df": df}
    found = findings.findings([noisy, row("disk_ckpt", [30.0, 31.0, 29.0], arch="fsdp")])
    assert "disk_ckpt: no detectable overhead on ddp (interval holds 0)." in found
    # a steady baseline adds next to nothing
    assert findings.baseline_noise([1.0, 1.0, 1.0], 5.0) == (0.0, 2.0)
    assert findings.baseline_noise([1.0], 5.0)[0] == 0.0
