"""Issue 16, item 8: the soak's bookkeeping (`bench/soak.py`) without Ray or a service: what
counts as lost, as duplicated, and as flat."""

from __future__ import annotations

from bench.run import summary_lines
from bench.soak import Books, Row, attempts_of, flatness, tally, verdict

KEYS = [f"k{i}" for i in range(5)]
STEPS = 6  # 3 steps x 2 ranks


def _clean() -> tuple[Books, list[Row], dict[str, int]]:
    books = Books()
    rows = []
    for i, key in enumerate(KEYS):
        books.record(key, 201, f"e{i}")
        rows.append(Row(f"e{i}", key, key, "completed", 1, None))
    return books, rows, {f"e{i}": STEPS for i in range(5)}


def test_a_clean_soak_has_nothing_lost_or_duplicated() -> None:
    books, rows, steps = _clean()
    books.record("k1", 200, "e1")  # the client retried across the kill: a replay, same id
    rows[1] = Row("e1", "k1", "k1", "completed", 2, None)  # re-run after its lease expired
    t = tally(KEYS, books, rows, steps, STEPS)
    assert t["lost"]["count"] == 0 and t["duplicated"]["count"] == 0
    assert t["acknowledged"] == t["completed"] == t["submitted"] == 5
    assert t["attempts"] == {"1": 4, "2": 1} and not t["step_record_mismatches"]
    assert attempts_of(rows, ["e1", "e3", "gone"]) == {"e1": 2, "e3": 1}


def test_every_way_of_duplicating_counts() -> None:
    books, rows, steps = _clean()
    books.record("k0", 200, "e9")  # a replay that answered another experiment
    books.record("k2", 201, "e2")  # "created" twice for one key
    rows.append(Row("e7", None, "k3", "completed", 1, None))  # a copy that lost its key
    rows.append(Row("e8", None, "someone", "queued", 0, None))  # not the soak's at all
    t = tally(KEYS, books, rows, {**steps, "e7": STEPS}, STEPS)["duplicated"]
    assert t["keys"] == {"k0": ["e0", "e9"], "k2": ["e2"], "k3": ["e3", "e7"]}
    assert t["created_twice"] == ["k2"] and t["rows_without_a_known_key"] == ["e8"]
    assert t["count"] == 4


def test_every_way_of_losing_counts_with_its_reason() -> None:
    books, rows, steps = _clean()
    del books.acked["k0"]
    books.gave_up["k0"] = "503: database unavailable"
    keep = [r for r in rows if r.key not in ("k0", "k1")]  # k1: acknowledged, then no row
    keep[0] = Row("e2", "k2", "k2", "running", 1, None)
    keep[1] = Row("e3", "k3", "k3", "failed", 3, "gave up after 3 attempts")
    keep[2] = Row("e4", "k4", "k4", "cancelled", 1, "cancelled (its dispatcher died)")
    lost = tally(KEYS, books, keep, steps, STEPS)["lost"]
    assert lost["count"] == 5
    assert lost["never_acked"] == {"k0": "503: database unavailable"}
    assert list(lost["acked_missing"]) == ["k1"]
    assert lost["unfinished"] == {"k2": "e2 running: None"}
    assert lost["failed"] == {"k3": "e3 failed: gave up after 3 attempts"}
    assert "cancelled" in lost["cancelled"]["k4"]


def test_a_run_written_twice_shows_in_its_step_records() -> None:
    books, rows, steps = _clean()
    t = tally(KEYS, books, rows, {**steps, "e2": 2 * STEPS, "e4": 0}, STEPS)
    assert t["step_record_mismatches"] == {"e2": 12, "e4": 0}
    assert not verdict(t, {"met": True})


def test_flat_means_every_metric_within_ten_percent_either_way() -> None:
    start = {"rss_bytes": 1000, "threads": 50, "open_files": 40}
    assert flatness(start, {"rss_bytes": 1090, "threads": 50, "open_files": 37})["met"]
    grew = flatness(start, {"rss_bytes": 1110, "threads": 50, "open_files": 40})
    assert not grew["met"] and round(grew["worst_ratio"], 2) == 1.11
    shrank = flatness(start, {"rss_bytes": 1000, "threads": 44, "open_files": 40})
    assert not shrank["met"] and shrank["worst_ratio"] == 0.88
    assert not flatness({**start, "threads": 0}, start)["met"]  # nothing to compare against


def test_the_verdict_and_its_summary_line() -> None:
    books, rows, steps = _clean()
    t = tally(KEYS, books, rows, steps, STEPS)
    start = {"rss_bytes": 300 * 2**20, "threads": 60, "open_files": 50}
    flat = flatness(start, {**start, "threads": 63})
    assert verdict(t, flat) and not verdict(t, {**flat, "met": False})
    goal = {
        "status": "met",
        "experiments": 40,
        "quick": True,
        "lost": 0,
        "duplicated": 0,
        "service": {"start": start, "end": {**start, "threads": 63}, **flat},
    }
    (_, line) = summary_lines(
        {
            "date": "d",
            "quick": True,
            "wall_s": 1.0,
            "goals": {"soak": goal},
            "machine": {"cpu_count": 2, "torch": "t", "ray": "r"},
        }
    )
    assert "MET" in line and "40 experiments (--quick)" in line
    assert "lost 0, duplicated 0" in line and "threads 60 -> 63 (1.050x)" in line
