"""Bounded cost per request, against a real `failbench serve` on 127.0.0.1: `recommend`'s
simulations run in the compute workers (not the server's threads), past the deadline a request
gets 503 (its worker killed; a write safe to retry with its key), and `/healthz` answers while
the worst allowed requests run. Latency itself is measured by `make bench` (api_health)."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from bench.health import WORST
from bench.serving import session_processes
from failbench_ray.storage import repo
from failbench_ray.storage.db import Database
from tests.service import Server
from tests.test_api import TINY

CHEAP: dict[str, Any] = {"architecture": "ddp", "state_gb": 1, "world": 8, "mtbf_hours": 1000}


def compute_workers(srv: Server) -> list[psutil.Process]:
    return [p for p in psutil.Process(srv.pid).children() if "api.offload" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def short(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose requests have 0.5 s (the worst recommend takes longer), one worker."""
    cwd = tmp_path_factory.mktemp("deadline")
    env = {"FAILBENCH_REQUEST_TIMEOUT_S": "0.5", "FAILBENCH_COMPUTE_WORKERS": "1"}
    srv = Server(cwd, f"sqlite:///{cwd / 'fb.db'}", env=env)
    try:
        srv.wait_up()
        yield srv
    finally:
        srv.stop()


def warm(api: httpx.Client, workers: int) -> None:
    """Until each worker has answered (they serve in turn; one still starting says so)."""
    answered = 0
    for _ in range(60):
        r = api.get("/v1/recommend", params={**CHEAP, "simulate_runs": 0})
        assert r.status_code in (200, 503), r.text
        if r.status_code == 200:
            answered += 1
            if answered == workers:
                return
            continue
        # still starting; or, on a loaded machine, even this ran past 0.5 s (its worker is
        # replaced: the next try waits for the new one)
        assert "still starting" in r.text or "deadline" in r.text, r.text
        answered = 0
        time.sleep(0.5)
    raise AssertionError("the compute workers never became ready")


def test_a_recommend_past_the_deadline_is_503_and_its_worker_is_replaced(short: Server) -> None:
    with short.client() as api:
        warm(api, 1)
        before = {p.pid for p in compute_workers(short)}
        assert len(before) == 1  # FAILBENCH_COMPUTE_WORKERS
        r = api.get("/v1/recommend", params=WORST)
        assert r.status_code == 503, r.text
        assert "deadline of 0.5 s" in r.json()["detail"] and r.headers["Retry-After"]
        after = {p.pid for p in compute_workers(short)}
        # the one that ran it was killed, not left to finish unseen; a successor took its place
        assert len(before - after) == 1 and len(after) == 1, (before, after)
        warm(api, 1)  # and answers


def test_a_write_past_the_deadline_is_503_and_its_retry_with_the_key_is_safe(
    short: Server,
) -> None:
    # A real lock: another writer holds the database, so the insert waits (busy_timeout 30 s).
    holder = sqlite3.connect(short.log_path.parent / "fb.db", timeout=30, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with short.client() as api:
            t0 = time.monotonic()
            r = api.post("/v1/experiments", json=TINY, headers={"Idempotency-Key": "late-1"})
            waited = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert "same Idempotency-Key" in r.json()["detail"]
        assert waited < 25  # answered at the deadline, not when the lock would have let go
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with short.client() as api:
        r = api.post("/v1/experiments", json=TINY, headers={"Idempotency-Key": "late-1"})
        assert r.status_code in (200, 201), r.text
        first = r.json()["id"]
        again = api.post("/v1/experiments", json=TINY, headers={"Idempotency-Key": "late-1"})
        assert again.status_code == 200 and again.json()["id"] == first
        listed = api.get("/v1/experiments", params={"limit": 500}).json()
        assert [e["id"] for e in listed["items"]].count(first) == 1
        assert listed["total"] == 1  # the cut-off write and its retries made one experiment


def test_recommends_run_in_workers_while_health_answers(tmp_path: Path) -> None:
    env = {"FAILBENCH_COMPUTE_WORKERS": "1", "FAILBENCH_REQUEST_TIMEOUT_S": "120"}
    srv = Server(tmp_path, f"sqlite:///{tmp_path / 'fb.db'}", env=env)
    try:
        srv.wait_up()
        server = psutil.Process(srv.pid)
        cpu0 = sum(server.cpu_times()[:2])
        answers: list[int] = []

        def ask() -> None:
            answers.append(
                httpx.get(f"{srv.url}/v1/recommend", params=WORST, timeout=150).status_code
            )

        askers = [threading.Thread(target=ask) for _ in range(2)]
        for t in askers:
            t.start()
        health = []
        while any(t.is_alive() for t in askers):
            health.append(httpx.get(f"{srv.url}/healthz", timeout=30).status_code)
            time.sleep(0.1)
        for t in askers:
            t.join()
        server_cpu = sum(server.cpu_times()[:2]) - cpu0
        (worker,) = compute_workers(srv)  # one worker, whatever the number of questions
        worker_cpu = sum(worker.cpu_times()[:2])
        assert answers == [200, 200]
        assert len(health) >= 3 and set(health) == {200}  # answered while they ran
        # the simulations' CPU was the worker's, not the server's (whose GIL health needs)
        assert server_cpu < worker_cpu / 2, (server_cpu, worker_cpu)
    finally:
        srv.stop()


def _sigterm(srv: Server) -> float:
    """SIGTERM to the service alone (as `docker stop` sends it); seconds until it exited."""
    t0 = time.monotonic()
    os.kill(srv.pid, signal.SIGTERM)
    srv.proc.wait(timeout=60)
    return time.monotonic() - t0


def _session_left(srv: Server) -> list[int]:
    """Processes of the service's session still alive a moment after it exited (its Ray
    cluster's, its compute workers): ray.shutdown() and close() ran if there are none."""
    deadline = time.monotonic() + 10
    while (left := session_processes(srv.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_sigterm_while_the_cluster_starts_stops_serve_and_the_cluster(tmp_path: Path) -> None:
    srv = Server(tmp_path, f"sqlite:///{tmp_path / 'fb.db'}", dispatchers=1)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            "gcs_server" in " ".join(p.cmdline()) for p in _children(srv.pid)
        ):
            time.sleep(0.05)  # until Ray's first process is up, before the API is
        took = _sigterm(srv)
        assert srv.proc.returncode == 0, srv.output()[-2000:]
        assert took < 10, srv.output()[-2000:]  # what docker and systemd wait before SIGKILL
        assert _session_left(srv) == []
    finally:
        srv.stop()


def test_sigterm_mid_run_and_mid_recommend_stops_serve_and_requeues(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fb.db'}"
    srv = Server(tmp_path, url, dispatchers=1)
    try:
        srv.wait_up()
        with srv.client() as api:
            long = {**TINY, "steps": 100_000, "baseline": False}
            exp_id = api.post("/v1/experiments", json=long).json()["id"]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                r = api.get(f"/v1/experiments/{exp_id}/events").json()
                if r["status"] == "running" and r["trials"]:
                    break  # its trial has begun
                time.sleep(0.2)
            asked = threading.Thread(
                target=lambda: httpx.get(f"{srv.url}/v1/recommend", params=WORST, timeout=60)
            )
            asked.start()
            time.sleep(0.5)  # the recommend is in a worker
            took = _sigterm(srv)
            asked.join()
        assert srv.proc.returncode == 0, srv.output()[-2000:]
        assert took < 10, srv.output()[-2000:]
        assert _session_left(srv) == []
        with Database(url, migrate=False) as db, db.session() as s:
            e = repo.get_experiment(s, exp_id)
            assert (e.status, e.attempts) == ("queued", 0), e.error  # back, no attempt spent
    finally:
        srv.stop()


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
