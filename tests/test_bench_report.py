"""`make bench`'s report: the summary reads any subset of goals (a `--only` run)."""

from __future__ import annotations

from typing import Any

from bench.run import summary_lines

MACHINE = {"cpu_count": 2, "torch": "2.13.0", "ray": "2.60.0"}


def report(goals: dict[str, Any]) -> dict[str, Any]:
    return {"date": "2026-12-02", "quick": False, "wall_s": 1.0, "machine": MACHINE, "goals": goals}


def test_summary_of_one_goal() -> None:
    api = {
        "status": "not met",
        "requests_per_s": 250.0,
        "p99_s": 0.2,
        "p50_s": 0.05,
        "errors": 0,
        "clients": 50,
    }
    lines = summary_lines(report({"api_load": api}))
    assert len(lines) == 2
    assert "api_load" in lines[1] and "NOT MET" in lines[1] and "250 req/s" in lines[1]


def test_summary_of_no_goal_and_of_an_error() -> None:
    assert len(summary_lines(report({}))) == 1
    err = {"status": "error", "error": "RuntimeError: boom"}
    (head, line) = summary_lines(report({"async_overhead": err}))
    assert "ERROR" in line and "boom" in line


def test_summary_of_every_mechanism_goal() -> None:
    goals = {
        "hot_spare_recovery": {
            "status": "met",
            "median_resumed_s": {"hot_spare": 0.5, "disk_ckpt": 3.0},
            "ratio": 0.17,
        },
        "async_overhead": {
            "status": "met",
            "overhead_pct": {"async_ckpt": 4.0, "disk_ckpt": 40.0},
            "ratio": 0.1,
            "rounds": 3,
        },
    }
    lines = summary_lines(report(goals))
    assert any(line.strip().startswith("hot_spare_recov") for line in lines)
    assert any("0.10x" in line for line in lines)


def _sample(cell: int, rss: int, threads: int, pids: tuple[int, ...], alive: list[str]) -> Any:
    proc = {"rss_bytes": rss, "threads": threads, "open_files": 40}
    return {
        "cell": f"c{cell}",
        "driver": {"pid": 1, **proc},
        "pooled": [{"pid": p, **proc} for p in pids],
        "other_actors_alive": alive,
        "started": 4, "reused": 10 * cell, "ended": 1, "idle": len(pids), "parked": 0,
    }  # fmt: skip


def test_leak_verdict_compares_the_end_with_cell_five() -> None:
    from bench.mechanisms import leak_verdict

    flat = [_sample(i, 100 + i % 3, 30, (7, 8), []) for i in range(1, 51)]
    v = leak_verdict(flat)
    assert v["met"] and v["cells"] == 50 and v["longest_lived_worker"]["cells"] == 50
    assert v["pool_processes_after_cell5"] == v["pool_processes_at_end"] == 2
    # memory that grows 20% fails; so does an actor left alive after a cell
    grows = flat[:-1] + [_sample(50, 125, 30, (7, 8), [])]
    assert not leak_verdict(grows)["met"] and leak_verdict(grows)["worst_ratio"] > 1.2
    left = flat[:20] + [_sample(21, 100, 30, (7, 8), ["fb-x-rank0-i0"])] + flat[21:]
    assert not leak_verdict(left)["met"]
    assert leak_verdict(left)["actors_alive_between_cells"] == {"c21": ["fb-x-rank0-i0"]}
    # processes replaced meanwhile: the pool is compared as a whole (its largest values)
    replaced = flat[:-1] + [_sample(50, 101, 30, (9,), [])]
    assert leak_verdict(replaced)["met"]
    threads = flat[:-1] + [_sample(50, 101, 40, (9,), [])]
    assert (
        not leak_verdict(threads)["met"] and leak_verdict(threads)["pooled_ratio"]["threads"] > 1.3
    )
    assert not leak_verdict(flat[:4])["met"]


def test_the_loopback_goal_reads_our_processes_and_reports_the_peer_apart() -> None:
    """Issue 15's check in `make bench`: a wide socket of ours fails it; Ray Train's own
    rendezvous (torch's default, in the comparison peer's workers) is reported, not counted."""
    from bench.run import loopback_goal
    from failbench_ray.network import Listener, ListenWatch

    watch = ListenWatch()
    watch.samples = 3
    watch.seen = {
        Listener(1, "raylet", "127.0.0.1", 5000),
        Listener(2, "ray::RayTrainWorker", "::", 6000),
        # the same Ray Train worker, titled after the task it ran when sampled
        Listener(4, "ray::RayTrainWorker", "127.0.0.1", 6100),
        Listener(4, "ray::execute._setup_torch_process_group", "::", 6200),
    }
    watch.processes = {"raylet", "ray::RayTrainWorker"}
    goal = loopback_goal(watch)
    assert goal["status"] == "met" and goal["measured"]["peer_beyond_loopback"] == [
        "ray::RayTrainWorker (pid 2) on :::6000",
        "ray::execute._setup_torch_process_group (pid 4) on :::6200",
    ]
    (_, line) = summary_lines(report({"loopback": goal}))
    assert "MET" in line and "Ray Train's own (the peer): 2 beyond loopback" in line
    watch.seen.add(Listener(3, "python", "0.0.0.0", 7000))
    ours = loopback_goal(watch)
    assert ours["status"] == "not met"
    assert ours["measured"]["beyond_loopback"] == ["python (pid 3) on 0.0.0.0:7000"]
    (_, line) = summary_lines(report({"loopback": ours}))
    assert "NOT MET" in line and "python (pid 3) on 0.0.0.0:7000" in line
