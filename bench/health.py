"""`/healthz` while the worst allowed requests run: eight concurrent `recommend`s of the
costliest question found (seconds of CPU each, asked again as each returns) against
`failbench serve` on SQLite; health is asked every 50 ms meanwhile. Goal: every health answer
within 100 ms. Also: SIGTERM to the busy service, and how long it took to exit (goal <= 10 s).
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serving import Server, session_processes

GOAL_S = 0.100
STOP_GOAL_S = 10.0
ASKERS = 8
# The costliest question found within recommend's bounds (tests/test_api_deadlines.py).
WORST: dict[str, str | int | float] = {
    "architecture": "hybrid",
    "state_gb": 1,
    "world": 1_048_576,
    "mtbf_hours": 1e7,
    "job_days": 3650,
    "simulate_runs": 200,
}


def _warm(srv: Server) -> None:
    """The compute workers start at the first question: not part of what is measured."""
    small: dict[str, str | int | float] = {**WORST, "simulate_runs": 0}
    for _ in range(60):
        if httpx.get(f"{srv.url}/v1/recommend", params=small, timeout=60).status_code == 200:
            return
        time.sleep(0.5)


def _ask_until(srv: Server, stop: threading.Event, codes: list[int]) -> None:
    """The worst question, again as soon as it is answered, until `stop`."""
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            codes.append(c.get(f"{srv.url}/v1/recommend", params=WORST).status_code)


def _health(srv: Server, duration: float) -> tuple[list[float], list[int]]:
    """Seconds each `/healthz` took, every 50 ms for `duration`, and any status but 200."""
    health: list[float] = []
    bad: list[int] = []
    end = time.monotonic() + duration
    with httpx.Client(timeout=30) as c:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            r = c.get(f"{srv.url}/healthz")
            health.append(time.perf_counter() - t0)
            if r.status_code != 200:
                bad.append(r.status_code)
            time.sleep(0.05)
    return health, bad


def goal_api_health(tmp: Path, quick: bool) -> dict[str, Any]:
    cwd = tmp / "api_health"
    cwd.mkdir(parents=True, exist_ok=True)
    srv = Server(cwd, f"sqlite:///{cwd / 'fb.db'}")
    codes: list[int] = []
    stop = threading.Event()
    try:
        srv.wait_up()
        _warm(srv)
        askers = [
            threading.Thread(target=_ask_until, args=(srv, stop, codes), daemon=True)
            for _ in range(ASKERS)
        ]
        for t in askers:
            t.start()
        time.sleep(1.0)  # all eight in flight
        health, bad = _health(srv, 10.0 if quick else 30.0)
        stop.set()
        t0 = time.monotonic()  # the stop, with the recommends still in flight
        os.kill(srv.pid, signal.SIGTERM)
        srv.proc.wait(timeout=60)
        stop_s = time.monotonic() - t0
        for t in askers:
            t.join(timeout=30)
        left = session_processes(srv.pid)
    finally:
        srv.stop()
    met = max(health) <= GOAL_S and not bad and stop_s <= STOP_GOAL_S and not left
    return {
        "goal": f"every /healthz within {GOAL_S * 1e3:.0f} ms while {ASKERS} worst recommends "
        f"run; SIGTERM exits within {STOP_GOAL_S:.0f} s",
        "met": met,
        "status": "met" if met else "not met",
        "health_samples": len(health),
        "health_p50_s": statistics.median(health),
        "health_p99_s": statistics.quantiles(health, n=100)[98],
        "health_max_s": max(health),
        "health_not_200": bad,
        "recommend_codes": {str(k): codes.count(k) for k in sorted(set(codes))},
        "sigterm_exit_s": stop_s,
        "exit_code": srv.proc.returncode,
        "processes_left": len(left),
    }
