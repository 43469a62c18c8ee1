"""The service end to end: `failbench serve` / `failbench dispatch` with real dispatchers on a
real Ray cluster (the service's own), real kills of the service, real SQLite and PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from sqlalchemy import func, select

from failbench_ray import network
from failbench_ray.spec import parse_spec
from failbench_ray.storage import queue, repo
from failbench_ray.storage.db import Database
from failbench_ray.storage.tables import Experiment, StepRecordRow, Trial
from tests.service import Process, Server, wait_status

TINY: dict[str, Any] = {
    "architecture": "ddp",
    "world_size": 2,
    "model": {"kind": "mlp", "input_dim": 8, "hidden_dim": 16, "depth": 2},
    "optimizer": {"name": "adam", "lr": 0.01},
    "steps": 12,
    "batch_size": 8,
    "warmup_steps": 1,
    "pg_timeout_s": 60,
}
FAULTY = {
    **TINY,
    "mechanism": {"name": "disk_ckpt", "params": {"interval": 4}},
    "failures": {"kind": "single", "rank": 1, "at_step": 7},
}


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except psutil.Error:  # exited meanwhile
        return {}


def actor_processes(session_leader: int) -> list[str]:
    """Titles of the project's Ray actor processes (ranks, chaos, holders) in the service's
    process session (Ray's own agents live as long as the cluster)."""
    titles = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        mine = int(fields[3]) == session_leader and fields[0] != "Z"
        if mine and cmd.startswith(("ray::Worker", "ray::Chaos", "ray::ReplicaHolder")):
            titles.append(cmd)
    return titles


def rows(url: str, exp_id: str) -> tuple[int, int, int]:
    """(attempts, trials, step records) of an experiment, read from the database."""
    with Database(url, migrate=False) as db, db.session() as s:
        attempts = repo.get_experiment(s, exp_id).attempts
        trials = s.scalars(select(Trial.id).where(Trial.experiment_id == exp_id)).all()
        steps = s.scalar(
            select(func.count())
            .select_from(StepRecordRow)
            .where(StepRecordRow.trial_id.in_(trials))
        )
        return attempts, len(trials), int(steps or 0)


def test_a_served_experiment_runs_and_reads_like_the_cli(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fb.db'}"
    token = "served-secret"
    srv = Server(tmp_path, url, dispatchers=1, env={"FAILBENCH_API_TOKEN": token})
    auth = {"Authorization": f"Bearer {token}"}
    try:
        srv.wait_up()
        # Issue 15: what the service and its Ray cluster listen on, while the experiment runs
        with srv.client(headers=auth) as api, network.ListenWatch(srv.pid, 0.3) as watch:
            exp_id = api.post("/v1/experiments", json=FAULTY).json()["id"]
            body = wait_status(api, exp_id, {"completed", "failed"})
            # Issue 16: the token stays in the service; its Ray processes never see it
            children = network.process_tree(srv.pid)[1:]
            assert any(p.name() == "raylet" for p in children)
            assert not [p.pid for p in children if token in str(_environ(p))]
        assert {"raylet", "gcs_server"} <= watch.processes, watch.processes
        assert any(p.startswith("ray::") for p in watch.processes), watch.processes
        assert not watch.wide, "listening beyond loopback:\n" + "\n".join(map(str, watch.wide))
        with srv.client(headers=auth) as api:
            assert body["status"] == "completed", body
            result = body["result"]
            trial = result["trials"][0]
            assert trial["matches_baseline"] is True and len(trial["failures"]) == 1
            assert trial["failures"][0]["phases"]["resumed_s"] > 0
            events = api.get(f"/v1/experiments/{exp_id}/events").json()
            (faulty,) = [t for t in events["trials"] if t["kind"] == "trial"]
            assert faulty["failures"][0]["ranks"] == [1]
            assert {c["kind"] for c in faulty["checkpoints"]} >= {"save", "restore"}
            metrics = api.get("/metrics").text
            assert "failbench_dispatcher_heartbeat_age_seconds{" in metrics
            assert 'failbench_experiments{status="completed"} 1.0' in metrics
        shown = subprocess.run(
            [sys.executable, "-m", "failbench_ray.cli", "show", exp_id, "--json", "--db", url],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout) == result  # the API and the CLI print the same result
        assert rows(url, exp_id)[:2] == (1, 2)  # one attempt: a baseline and one trial
        _a_served_sweep_keeps_its_status(srv, url, auth)
    finally:
        srv.stop()


def _a_served_sweep_keeps_its_status(srv: Server, url: str, auth: dict[str, str]) -> None:
    """A sweep through the API goes the way `failbench sweep` goes: its cells share a baseline
    (the second copies the first's), and the dispatcher that runs a cell stores the cell's
    status and the sweep's (they went stale before), with the mapping the API shows."""
    sweep = {
        "name": "served-sweep",
        "base": {k: v for k, v in TINY.items() if k != "architecture"},
        "grid": {
            "architecture": ["ddp", "hybrid"],  # hybrid's 2 x 2 needs 4 ranks: skipped
            "mechanism": ["none", "disk_ckpt"],
            "failures": ["none"],
        },
    }
    with srv.client(headers=auth) as api:
        body = api.post("/v1/sweeps", json=sweep).json()
        first, second = (c["experiment_id"] for c in body["experiments"])
        ran = {i: wait_status(api, i, {"completed", "failed"}) for i in (first, second)}
        shown = api.get(f"/v1/sweeps/{body['sweep_id']}").json()
    # one dispatcher: one cell after the other, and the later one copies the earlier's baseline
    reused = {i: ran[i]["result"]["baseline"].get("reused_from") for i in ran}
    # exactly one cell made its own baseline; the other copied it (sorting by str once put
    # None first or last depending on whether the id began with a digit: a flaky check)
    assert list(reused.values()).count(None) == 1, reused
    (copy,) = [i for i in ran if reused[i] is not None]
    assert reused[copy] == ({first, second} - {copy}).pop()
    assert shown["status"] == "completed", shown
    assert shown["progress"] == {
        "pending": 0, "running": 0, "completed": 2, "failed": 0, "skipped": 2
    }  # fmt: skip
    deadline = time.monotonic() + 30  # the dispatcher stores them just after the experiment
    with Database(url, migrate=False) as db:
        while True:
            with db.session() as s:
                stored = repo.get_sweep(s, body["sweep_id"]).status
                cells = {c.key: c.status for c in repo.list_sweep_cells(s, body["sweep_id"])}
            if stored != "running" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert stored == "completed"
    assert cells == {
        "ddp/none/none": "completed",
        "ddp/disk_ckpt/none": "completed",
        "hybrid/none/none": "skipped",
        "hybrid/disk_ckpt/none": "skipped",
    }


def test_cancel_stops_a_running_experiment_and_its_actors(tmp_path: Path) -> None:
    # Fresh processes, so that every actor of the run is one to see gone; with reuse (the
    # default) they are reset into the pool instead (tests/test_pool.py checks that).
    srv = Server(
        tmp_path, f"sqlite:///{tmp_path / 'fb.db'}", dispatchers=1, extra=["--fresh-workers"]
    )
    try:
        srv.wait_up()
        with srv.client() as api:
            long = {**TINY, "steps": 100_000, "baseline": False}
            exp_id = api.post("/v1/experiments", json=long).json()["id"]
            wait_status(api, exp_id, {"running"})
            deadline = time.monotonic() + 120
            while not actor_processes(srv.pid) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert actor_processes(srv.pid), "the experiment's actors never started"
            r = api.post(f"/v1/experiments/{exp_id}/cancel")
            assert r.status_code == 202 and r.json()["status"] == "running"
            body = wait_status(api, exp_id, {"cancelled", "failed", "completed"}, timeout=120)
            assert body["status"] == "cancelled", body
            assert body["result"]["trials"][0]["status"] == "interrupted"
            deadline = time.monotonic() + 30
            while actor_processes(srv.pid) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert actor_processes(srv.pid) == []  # every actor of the run is gone
            assert api.post(f"/v1/experiments/{exp_id}/cancel").status_code == 409
    finally:
        srv.stop()


def test_the_service_killed_mid_run_restarts_and_the_experiment_completes(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'fb.db'}"
    lease = ["--lease-s", "3"]
    srv = Server(tmp_path, url, dispatchers=1, extra=lease)
    try:
        srv.wait_up()
        with srv.client() as api:
            spec = {**FAULTY, "steps": 300, "failures": {"kind": "none"}}
            exp_id = api.post("/v1/experiments", json=spec).json()["id"]
            wait_status(api, exp_id, {"running"})
            deadline = time.monotonic() + 120
            while rows(url, exp_id)[1] == 0 and time.monotonic() < deadline:
                time.sleep(0.2)  # until its first trial has begun
        srv.kill()  # the service, its dispatcher and its Ray cluster, all at once
    finally:
        srv.stop()
    assert rows(url, exp_id)[0] == 1
    again = Server(tmp_path, url, dispatchers=1, extra=lease, port=srv.port)
    try:
        again.wait_up()
        with again.client() as api:
            body = wait_status(api, exp_id, {"completed", "failed"}, timeout=600)
        assert body["status"] == "completed", body
        attempts, trials, steps = rows(url, exp_id)
        # the first attempt's rows were dropped: one baseline and one trial, each step once
        assert (attempts, trials) == (2, 2)
        assert steps == 2 * 300 * 2  # 2 runs x 300 steps x 2 ranks
        assert "re-queued" not in (body["error"] or "")  # a completed run clears the reason
    finally:
        again.stop()


@pytest.mark.postgres
def test_four_dispatchers_drain_eight_experiments_each_exactly_once(
    tmp_path: Path, pg_url: str
) -> None:
    small = {**TINY, "steps": 3, "baseline": False, "warmup_steps": 0}
    # 8 keep all four busy and racing for claims (2 each); the soak (make bench) runs 100
    with Database(pg_url) as db, db.session() as s:
        ids = [queue.submit(s, parse_spec({**small, "seed": i})).experiment_id for i in range(8)]
    proc = Process(["dispatch", "-n", "4", "--db", pg_url], tmp_path, log="dispatch")
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            with Database(pg_url, migrate=False) as db, db.session() as s:
                left = s.scalar(
                    select(func.count()).where(
                        Experiment.status.in_(("queued", "running")), Experiment.id.in_(ids)
                    )
                )
            if left == 0:
                break
            assert proc.proc.poll() is None, proc.output()[-3000:]
            time.sleep(1)
        assert left == 0, f"{left} experiments not done after 15 min"
    finally:
        assert proc.stop() is not None
    with Database(pg_url, migrate=False) as db, db.session() as s:
        exps = s.scalars(select(Experiment).where(Experiment.id.in_(ids))).all()
        assert {e.status for e in exps} == {"completed"}, {e.id: e.error for e in exps}
        assert {e.attempts for e in exps} == {1}  # none claimed twice
        for e in exps:
            (trial,) = s.scalars(select(Trial).where(Trial.experiment_id == e.id)).all()
            n = s.scalar(
                select(func.count())
                .select_from(StepRecordRow)
                .where(StepRecordRow.trial_id == trial.id)
            )
            assert n == 3 * 2  # 3 steps x 2 ranks, each once
    assert "dispatcher" in proc.output()


def test_dispatch_needs_at_least_one(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "failbench_ray.cli", "dispatch", "-n", "0"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2 and "--dispatchers 0" in r.stderr
