"""Issue 18: the paper's claims against made-up report rows, each verdict with its reason."""

from __future__ import annotations

from typing import Any

from failbench_ray.paper import FAILS, HOLDS, NOT_COMPARABLE, compare, explain, pick_a2
from failbench_ray.stats import Comparison

BIG = 400e6  # bytes of state per rank: the paper's range


def row(arch: str, mech: str, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "cell": f"{arch}/{mech}/single", "architecture": arch, "mechanism": mech, "trials": 3,
        "reform": "standard", "overhead_samples": [5.0, 5.5, 6.0],
        "restore_samples": [0.5, 0.52, 0.54], "reform_samples": [2.4, 2.5, 2.6],
        "throughput_ratios": [], "loss_vs_baseline": None, "state_bytes_per_rank": BIG,
        "phases_s": {"detected": 0.03, "quiesced": 0.01, "reformed": 2.5, "restored": 0.5,
                     "resumed": 0.1},
        "write_mb_s": 350.0, "stall_s_per_save": 1.1,
    }  # fmt: skip
    return base | over


def loss(verdict: str) -> Comparison:
    return Comparison("wall_s", 10.0, 30, 30, 0.0, (-0.1, 0.1), 0.9, verdict)


def paper_rows(**over: dict[str, Any]) -> list[dict[str, Any]]:
    """A2 (ddp) as the paper found it: disk cheapest, inmem restores fastest, jit free but
    slow on failure; gossip faster after a loss with no better loss; inmem far apart."""
    rows = [
        row("ddp", "disk_ckpt", overhead_samples=[0.4, 0.5, 0.6]),
        row("ddp", "inmem_replica", restore_samples=[0.016, 0.017, 0.018]),
        row("ddp", "jit_ckpt", overhead_samples=[1.8, 2.0, 2.2], restore_samples=[0.9, 0.95, 1.0]),
        row("gossip", "none", throughput_ratios=[1.17, 1.18, 1.19], loss_vs_baseline=loss(
            "no detectable difference")),
        row("ps", "inmem_replica", overhead_samples=[170.0, 176.0, 182.0]),
    ]  # fmt: skip
    return [r | over.get(r["cell"], {}) for r in rows]


def verdicts(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(v.verdict, v.reason) for v in compare(rows)[1]]


def test_every_claim_holds_where_the_intervals_say_so() -> None:
    why, got = compare(paper_rows())
    assert "compared on ddp" in why
    assert [v.verdict for v in got] == [HOLDS] * 6, verdicts(paper_rows())
    disk = got[0]
    assert disk.paper == "disk_ckpt 0.5%" and disk.ours.startswith("disk_ckpt 0.5% [")
    assert "n=3" in disk.ours and disk.cells == [
        "ddp/disk_ckpt/single", "ddp/inmem_replica/single", "ddp/jit_ckpt/single"
    ]  # fmt: skip
    assert got[5].ours.startswith("5.5% [") and "(ddp) to 176% [" in got[5].ours


def test_a_claim_does_not_hold_where_an_interval_lies_on_the_other_side() -> None:
    rows = paper_rows(
        **{
            "ddp/disk_ckpt/single": {"overhead_samples": [9.0, 10.0, 11.0]},
            "ddp/jit_ckpt/single": {"restore_samples": [0.01, 0.011, 0.012]},
            "gossip/none/single": {"loss_vs_baseline": loss("lower")},
        }
    )
    got = verdicts(rows)
    assert got[0] == (
        FAILS,
        "inmem_replica, jit_ckpt lower, with intervals wholly below disk_ckpt's",
    )
    assert got[1][0] == FAILS and got[1][1].startswith("jit_ckpt lower")  # jit restores faster
    assert got[2] == (FAILS, "its restore lies below disk_ckpt, inmem_replica's")
    assert got[4] == (FAILS, "loss is lower than the baseline's at matched time")


def test_overlapping_intervals_small_state_and_missing_cells_are_not_comparable() -> None:
    rows = paper_rows(**{"ddp/disk_ckpt/single": {"overhead_samples": [-20.0, 5.0, 30.0]}})
    assert verdicts(rows)[0] == (
        NOT_COMPARABLE,
        "disk_ckpt cannot be told apart from inmem_replica, jit_ckpt",
    )
    tiny = [r | {"state_bytes_per_rank": 171e3} for r in paper_rows()]
    verdict, reason = verdicts(tiny)[0]
    assert verdict == NOT_COMPARABLE and reason.startswith("these cells hold 0.171 MB of state")
    assert reason.endswith("(holds: disk_ckpt's interval lies below every other mechanism's)")
    assert verdicts(tiny)[4][0] == HOLDS  # gossip's claim is about throughput, not state cost
    one_trial = [r | {"trials": 1} for r in paper_rows()]
    assert pick_a2(one_trial)[0] is None
    assert {v for v, _ in verdicts(one_trial)} == {NOT_COMPARABLE}
    no_gain = paper_rows(**{"gossip/none/single": {"throughput_ratios": [0.9, 1.0, 1.1]}})
    assert verdicts(no_gain)[4] == (NOT_COMPARABLE, "no detectable throughput change")


def test_re_formation_that_does_not_take_seconds_cannot_test_the_first_claim() -> None:
    fast = [r | {"reform_samples": [0.1, 0.12, 0.11]} for r in paper_rows()]
    assert verdicts(fast)[3] == (NOT_COMPARABLE, "re-formation here does not take seconds")


def test_a_claim_that_does_not_hold_is_explained_from_what_its_cells_measured() -> None:
    rows = paper_rows(**{"ddp/disk_ckpt/single": {"overhead_samples": [9.0, 10.0, 11.0]}})
    claim = compare(rows)[1][0]
    lines = explain(claim, rows)
    assert lines[0] == (
        "ddp/disk_ckpt/single: recovery dominated by reformed (2.5 s of 3.14 s to resumed); "
        "state written at 350 MB/s; a save holds its step 1.1 s; 400 MB of state per rank"
    )
