"""Issue 16, item 8: a soak of the service. Small experiments go through the REST API (each with
an Idempotency-Key) to `failbench serve --dispatchers 4` on a fresh PostgreSQL database reached
through a cuttable proxy (`bench/tcpproxy.py`), in two phases:

1. the first share is submitted at a steady pace; once most are acknowledged and some train,
   the whole service session (API, dispatchers, its Ray cluster) is SIGKILLed and started again
   on the same database and port; the client keeps retrying with the same keys (and sends the
   last few it had answers for again, as a client that lost them in the crash would), and the
   runs the kill cut short go back to the queue when their (short) lease expires. The restarted
   process drains the queue, and its RSS, threads and open files are read once it is idle:
   the start of the flatness comparison;
2. the rest is submitted the same way; while some train, the database is cut for a few seconds
   (shorter than the lease), then restored. Once every experiment is done the same process is
   read again, idle: the end.

The books are then checked against the database itself: per key, how many experiments exist
(duplicated), which did not complete (lost: never acknowledged, missing, unfinished, failed or
cancelled, each with its reason), each run's attempts, and whether each completed experiment has
exactly its steps x ranks step records (a run written twice would show). The verdict functions
(`tally`, `flatness`, `verdict`) are pure: tests/test_soak_books.py checks them without Ray.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from bench.common import log, status_of
from bench.serving import Server, free_port, session_processes
from bench.tcpproxy import Proxy

if TYPE_CHECKING:
    from failbench_ray.storage.db import Database

PG = ("127.0.0.1", 5432)
PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
RAY_ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")
DISPATCHERS = 4
LEASE_S = 10.0  # short, so the runs the kill cut short are re-queued soon
OUTAGE_S = 4.0  # shorter than the lease: it must cost a running experiment nothing
FLAT_TOLERANCE = 0.10
METRICS = ("rss_bytes", "threads", "open_files")
TERMINAL = ("completed", "failed", "cancelled")
GIVE_UP_S = 180.0  # a client retries one submission this long (a restart or an outage)
REPLAYS = 5  # acknowledged submissions sent again after the restart (their answers "lost")
# The smallest spec that still trains on real Ray workers: 2 ranks, 3 steps, one trial.
SPEC: dict[str, Any] = {
    "architecture": "ddp",
    "world_size": 2,
    "model": {"kind": "mlp", "input_dim": 8, "hidden_dim": 16, "depth": 2},
    "steps": 3,
    "batch_size": 8,
    "warmup_steps": 0,
    "baseline": False,
    "trials": 1,
    "mechanism": "none",
    "failures": {"kind": "none"},
    "pg_timeout_s": 60,
}
STEP_RECORDS = SPEC["steps"] * SPEC["world_size"]  # per completed experiment, each once


@dataclass(frozen=True)
class SoakPlan:
    experiments: int
    first_phase: int  # submitted before (and across) the kill; the rest across the outage
    kill_after: int  # acknowledged submissions before the kill (once some experiments train)
    cut_after: int  # acknowledged submissions of phase 2 before the database is cut
    pace_s: float  # between two submissions
    phase_limit_s: float  # the most one phase waits for its experiments to finish

    @classmethod
    def make(cls, quick: bool) -> SoakPlan:
        if quick:
            return cls(
                40, first_phase=16, kill_after=12, cut_after=6, pace_s=0.3, phase_limit_s=300
            )
        return cls(100, first_phase=40, kill_after=30, cut_after=15, pace_s=0.3, phase_limit_s=480)


# ---------------------------------------------------------------------------------------------
# The books and the verdict (pure)


@dataclass(frozen=True)
class Row:
    """One `experiments` row, as the soak reads it back."""

    id: str
    key: str | None
    name: str | None
    status: str
    attempts: int
    error: str | None


@dataclass
class Books:
    """The client's side: what the API answered, per Idempotency-Key."""

    acked: dict[str, list[str]] = field(default_factory=dict)  # key -> ids answered (200/201)
    created: Counter[str] = field(default_factory=Counter)  # key -> 201s answered
    answers: Counter[str] = field(default_factory=Counter)  # status code or error -> count
    gave_up: dict[str, str] = field(default_factory=dict)  # key -> the last answer
    # the submitter and the replays after the restart write at the same time
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, key: str, code: int, exp_id: str) -> None:
        with self._lock:
            self.acked.setdefault(key, []).append(exp_id)
            if code == 201:
                self.created[key] += 1

    def answered(self, what: str) -> None:
        with self._lock:
            self.answers[what] += 1


def _duplicates(keys: Sequence[str], books: Books, rows: Sequence[Row]) -> dict[str, Any]:
    """Keys that name more than one experiment, however it shows."""
    by_key: dict[str | None, list[Row]] = {}
    for r in rows:
        by_key.setdefault(r.key, []).append(r)
    known = set(keys)
    # a row without a known key (its name is its key): a second copy of a submission
    stray = [r for r in rows if r.key not in known]
    found: dict[str, list[str]] = {}
    for key in keys:
        ids = {r.id for r in by_key.get(key, [])}
        ids |= {r.id for r in stray if r.name == key}
        ids |= set(books.acked.get(key, []))  # a replay answering another id is one too
        if len(ids) > 1 or books.created[key] > 1:
            found[key] = sorted(ids)
    unmatched = [r.id for r in stray if r.name not in known]
    return {
        "count": len(found) + len(unmatched),
        "keys": found,
        "created_twice": sorted(k for k in keys if books.created[k] > 1),
        "rows_without_a_known_key": unmatched,
    }


def _lost(keys: Sequence[str], books: Books, rows: Sequence[Row]) -> dict[str, Any]:
    """Keys with no completed experiment, by why."""
    by_key: dict[str | None, list[Row]] = {}
    for r in rows:
        by_key.setdefault(r.key, []).append(r)
    kinds: dict[str, dict[str, str]] = {
        k: {} for k in ("never_acked", "acked_missing", "unfinished", "failed", "cancelled")
    }
    for key in keys:
        mine = by_key.get(key, [])
        if any(r.status == "completed" for r in mine):
            continue
        if not mine:
            kind = "acked_missing" if key in books.acked else "never_acked"
            kinds[kind][key] = books.gave_up.get(key, "acknowledged, then not in the database")
            continue
        r = mine[0]
        kind = r.status if r.status in ("failed", "cancelled") else "unfinished"
        kinds[kind][key] = f"{r.id} {r.status}: {r.error}"
    return {"count": sum(len(v) for v in kinds.values()), **kinds}


def tally(
    keys: Sequence[str],
    books: Books,
    rows: Sequence[Row],
    step_records: Mapping[str, int],
    expected_steps: int,
) -> dict[str, Any]:
    """The soak's books against the database: duplicated and lost experiments, attempts, and
    completed experiments whose step records are not exactly `expected_steps`.

    Args:
        keys: every Idempotency-Key the client submitted (one experiment each).
        books: what the API answered to the client.
        rows: the database's experiments (all of them: the database is the soak's own).
        step_records: experiment id -> its step records.
        expected_steps: step records of one completed experiment (steps x ranks).
    """
    completed = [r for r in rows if r.status == "completed"]
    attempts = Counter(r.attempts for r in rows)
    return {
        "submitted": len(keys),
        "acknowledged": sum(1 for k in keys if k in books.acked),
        "rows": len(rows),
        "completed": len(completed),
        "duplicated": _duplicates(keys, books, rows),
        "lost": _lost(keys, books, rows),
        "attempts": {str(n): attempts[n] for n in sorted(attempts)},
        "step_record_mismatches": {
            r.id: step_records.get(r.id, 0)
            for r in completed
            if step_records.get(r.id, 0) != expected_steps
        },
    }


def attempts_of(rows: Sequence[Row], ids: Sequence[str]) -> dict[str, int]:
    """The attempts of the experiments `ids` (e.g. those running when the database was cut)."""
    wanted = set(ids)
    return {r.id: r.attempts for r in rows if r.id in wanted}


def flatness(
    start: Mapping[str, float], end: Mapping[str, float], tolerance: float = FLAT_TOLERANCE
) -> dict[str, Any]:
    """end / start of each metric; flat when every ratio is within `tolerance` of 1."""
    ratios = {k: end[k] / start[k] for k in METRICS if start.get(k) and k in end}
    worst = max(ratios.values(), key=lambda r: abs(r - 1), default=None)
    met = len(ratios) == len(METRICS) and all(abs(r - 1) <= tolerance for r in ratios.values())
    return {"ratios": ratios, "worst_ratio": worst, "met": met}


def verdict(books: dict[str, Any], flat: dict[str, Any]) -> bool:
    """Met: nothing lost, nothing duplicated, no run written twice, and the service flat."""
    return (
        books["lost"]["count"] == 0
        and books["duplicated"]["count"] == 0
        and not books["step_record_mismatches"]
        and bool(flat["met"])
    )


# ---------------------------------------------------------------------------------------------
# The client


class Submitter(threading.Thread):
    """Submits `items` (key, spec) one by one at a pace; each is retried with its key through a
    restart or an outage until the API acknowledges it, or for `GIVE_UP_S`."""

    def __init__(
        self, base_url: str, items: list[tuple[str, dict[str, Any]]], pace_s: float, books: Books
    ) -> None:
        super().__init__(name="soak-submitter", daemon=True)
        self.base_url, self.items, self.pace_s, self.books = base_url, items, pace_s, books
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=10) as client:
            for key, spec in self.items:
                if self.stop.is_set():
                    return
                self._submit(client, key, spec)
                self.stop.wait(self.pace_s)

    def _submit(self, client: httpx.Client, key: str, spec: dict[str, Any]) -> None:
        deadline, last = time.monotonic() + GIVE_UP_S, "stopped before an answer"
        while not self.stop.is_set():
            try:
                r = client.post("/v1/experiments", json=spec, headers={"Idempotency-Key": key})
                self.books.answered(str(r.status_code))
                if r.status_code in (200, 201):
                    self.books.record(key, r.status_code, r.json()["id"])
                    return
                last = f"{r.status_code}: {r.text[:200]}"
                if r.status_code < 500 and r.status_code != 429:
                    break  # the request itself is wrong: retrying cannot help
            except httpx.HTTPError as err:
                self.books.answered(type(err).__name__)
                last = f"{type(err).__name__}: {err}"
            if time.monotonic() > deadline:
                break
            self.stop.wait(0.5)
        self.books.gave_up[key] = last


# ---------------------------------------------------------------------------------------------
# The database and the service process


@contextlib.contextmanager
def fresh_database() -> Iterator[str]:
    """A new PostgreSQL database for the soak (its URL), dropped at the end."""
    from sqlalchemy import create_engine, text

    name = f"fb_soak_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield f"postgresql+psycopg://postgres@{PG[0]}:{PG[1]}/{name}"
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def status_counts(db: Database) -> dict[str, int]:
    from failbench_ray.storage import queue

    with db.session() as s:
        return queue.counts_by_status(s)


def training(db: Database) -> list[str]:
    """Experiments running with a trial begun (their workers are up)."""
    from sqlalchemy import select

    from failbench_ray.storage.tables import Experiment, Trial

    with db.session() as s:
        stmt = (
            select(Experiment.id)
            .join(Trial, Trial.experiment_id == Experiment.id)
            .where(Experiment.status == "running")
            .distinct()
        )
        return list(s.scalars(stmt))


def read_rows(db: Database) -> tuple[list[Row], dict[str, int]]:
    """Every experiment, and each one's step records."""
    from sqlalchemy import func, select

    from failbench_ray.storage.tables import Experiment, StepRecordRow, Trial

    with db.session() as s:
        rows = [
            Row(e.id, e.idempotency_key, e.name, e.status, e.attempts, e.error)
            for e in s.scalars(select(Experiment))
        ]
        counted = s.execute(
            select(Trial.experiment_id, func.count())
            .join(StepRecordRow, StepRecordRow.trial_id == Trial.id)
            .group_by(Trial.experiment_id)
        )
        return rows, {exp_id: int(n) for exp_id, n in counted}


def usage(pid: int) -> dict[str, int]:
    """One process's resident memory, threads and open file descriptors, now."""
    import psutil

    p = psutil.Process(pid)
    with p.oneshot():
        return {
            "rss_bytes": p.memory_info().rss,
            "threads": p.num_threads(),
            "open_files": p.num_fds(),
        }


def steady_usage(pid: int, n: int = 3, every_s: float = 1.0) -> dict[str, Any]:
    """The median of `n` readings `every_s` apart (RSS moves a little from one to the next)."""
    readings = []
    for i in range(n):
        if i:
            time.sleep(every_s)
        readings.append(usage(pid))
    median = {k: int(statistics.median(r[k] for r in readings)) for k in METRICS}
    return {"pid": pid, **median, "readings": readings}


def session_rss(sid: int) -> dict[str, int]:
    """The whole service session's processes and their RSS summed (for information)."""
    import psutil

    total, count = 0, 0
    for pid in session_processes(sid):
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
            count += 1
    return {"processes": count, "rss_bytes": total}


class Sampler(threading.Thread):
    """Reads one process's usage every `every_s` (its peaks, for the report)."""

    def __init__(self, pid: int, every_s: float = 2.0) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.pid, self.every_s = pid, every_s
        self.readings: list[dict[str, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                self.readings.append(usage(self.pid))
            except Exception:  # noqa: BLE001  (the process is gone: nothing more to read)
                return

    def peaks(self) -> dict[str, int]:
        return {k: max((r[k] for r in self.readings), default=0) for k in METRICS}


def _kill_left(sid: int, grace_s: float = 10.0) -> list[str]:
    """What is still alive in a stopped service's session after `grace_s` (a SIGKILLed process
    takes a moment to exit, longer on a loaded machine), SIGKILLed by PID (ours: it was started
    there) and named for the report. Nothing, if the stop did its job."""
    import psutil

    deadline = time.monotonic() + grace_s
    while session_processes(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = []
    for pid in session_processes(sid):
        with contextlib.suppress(psutil.Error):
            left.append(f"{pid} {psutil.Process(pid).name()}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def _address_file() -> str | None:
    with contextlib.suppress(OSError):
        return RAY_ADDRESS_FILE.read_text()
    return None


def _stale_address_file(before: str | None) -> str | None:
    """A `ray_current_cluster` file that appeared during the soak and names a dead cluster (a
    plain `ray.init()` would wait for it) is removed; what it said is returned."""
    import socket

    now = _address_file()
    if now is None or before is not None:
        return None
    host, _, port = now.strip().rpartition(":")
    with contextlib.suppress(OSError, ValueError), socket.create_connection((host, int(port)), 2):
        return None  # a live cluster's: not ours to touch
    RAY_ADDRESS_FILE.unlink(missing_ok=True)
    return now


# ---------------------------------------------------------------------------------------------
# The soak


class Soak:
    """One soak: its proxy, its service processes, the client's books and the timeline."""

    def __init__(self, tmp: Path, plan: SoakPlan, url: str) -> None:
        from failbench_ray.storage.db import Database

        self.plan = plan
        self.cwd = tmp / "soak"
        self.cwd.mkdir(parents=True, exist_ok=True)
        self.proxy = Proxy(PG)
        self.service_url = url.replace(f":{PG[1]}/", f":{self.proxy.port}/")
        self.db = Database(url, migrate=False)  # the soak's own view, never cut
        run = uuid.uuid4().hex[:6]
        self.keys = [f"soak-{run}-{i:03d}" for i in range(plan.experiments)]
        self.books = Books()
        self.port = free_port()  # the restarted service answers where the first one did
        self.servers: list[Server] = []
        self.submitters: list[Submitter] = []
        self.sampler: Sampler | None = None
        self.events: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {}
        self.t0 = time.monotonic()

    def event(self, what: str, **data: Any) -> None:
        self.events.append({"t_s": round(time.monotonic() - self.t0, 2), "what": what, **data})
        log(f"soak: {what}" + (f" {data}" if data else ""))

    def start_server(self) -> Server:
        extra = ["--lease-s", f"{LEASE_S:g}", "--max-attempts", "3"]
        extra += ["--out", str(self.cwd / "runs")]
        srv = Server(
            self.cwd, self.service_url, dispatchers=DISPATCHERS, extra=extra, port=self.port
        )
        self.servers.append(srv)
        srv.wait_up(timeout=240)
        self.event("service up", pid=srv.pid)
        return srv

    def submit(self, indices: Sequence[int], pace_s: float) -> Submitter:
        items = [(self.keys[i], {**SPEC, "name": self.keys[i], "seed": i}) for i in indices]
        sub = Submitter(f"http://127.0.0.1:{self.port}", items, pace_s, self.books)
        self.submitters.append(sub)
        sub.start()
        return sub

    def replay(self, acked: Sequence[int]) -> list[str]:
        """Send the last REPLAYS of the submissions acknowledged before the kill again, with
        their keys, as a client that lost its answers in the crash would: each must name the
        experiment it named before (the books count any other answer as a duplicate)."""
        again = list(acked)[-REPLAYS:]
        self.submit(again, pace_s=0.0).join()
        return [self.keys[i] for i in again]

    def acked(self, first: int, last: int) -> int:
        return sum(1 for k in self.keys[first:last] if k in self.books.acked)

    def wait_until(self, cond: Callable[[], bool], what: str) -> bool:
        deadline = time.monotonic() + self.plan.phase_limit_s
        while time.monotonic() < deadline:
            if cond():
                return True
            if self.servers and self.servers[-1].proc.poll() is not None:
                raise RuntimeError(f"the service exited: {self.servers[-1].output()[-2000:]}")
            time.sleep(0.5)
        self.event(f"gave up waiting after {self.plan.phase_limit_s:g} s for: {what}")
        return False

    def drained(self, sub: Submitter) -> bool:
        counts = status_counts(self.db)
        return not sub.is_alive() and not counts.get("queued") and not counts.get("running")

    def phase_kill(self) -> None:
        """Submit the first share; SIGKILL the service while some train; restart it; drain."""
        p = self.plan
        srv = self.start_server()
        sub = self.submit(range(p.first_phase), p.pace_s)
        self.wait_until(
            lambda: self.acked(0, p.first_phase) >= p.kill_after and len(training(self.db)) >= 2,
            f"{p.kill_after} acknowledged and 2 experiments training",
        )
        running = training(self.db)
        acked = [i for i in range(p.first_phase) if self.keys[i] in self.books.acked]
        self.facts["kill"] = {
            "acknowledged_before": len(acked),
            "training_at_kill": running,
            "counts_at_kill": status_counts(self.db),
            "first_process_usage_at_kill": {"pid": srv.pid, **usage(srv.pid)},
        }
        srv.kill()  # the API, its dispatchers and its Ray cluster (workers included)
        left = _kill_left(srv.pid)
        srv.stop()
        self.event("service SIGKILLed", pid=srv.pid, training=len(running), left_after=left)
        again = self.start_server()
        self.sampler = Sampler(again.pid)
        self.sampler.start()
        self.facts["kill"]["replayed_after_restart"] = self.replay(acked)
        self.wait_until(lambda: self.drained(sub), "phase 1 submitted and drained")
        self.event("phase 1 drained", counts=status_counts(self.db))
        time.sleep(3)  # idle: the last runs' threads and connections wound down
        self.facts["start"] = steady_usage(again.pid)
        self.facts["session_start"] = session_rss(again.pid)

    def phase_outage(self) -> None:
        """Submit the rest; cut the database for OUTAGE_S while some train; drain."""
        p, srv = self.plan, self.servers[-1]
        sub = self.submit(range(p.first_phase, p.experiments), p.pace_s)
        self.wait_until(
            lambda: (
                self.acked(p.first_phase, p.experiments) >= p.cut_after
                and len(training(self.db)) >= 2
            ),
            f"{p.cut_after} of phase 2 acknowledged and 2 experiments training",
        )
        self.facts["outage"] = {
            "seconds": OUTAGE_S,
            "training_at_cut": training(self.db),
            "acknowledged_before": self.acked(p.first_phase, p.experiments),
        }
        self.proxy.cut()
        self.event("database cut", training=len(self.facts["outage"]["training_at_cut"]))
        time.sleep(OUTAGE_S)
        self.proxy.restore()
        self.event("database restored")
        self.wait_until(lambda: self.drained(sub), "phase 2 submitted and drained")
        self.event("phase 2 drained", counts=status_counts(self.db))
        time.sleep(3)
        self.facts["end"] = steady_usage(srv.pid)
        self.facts["session_end"] = session_rss(srv.pid)

    def close(self) -> list[str]:
        """Stop everything the soak started; the processes that had to be killed by PID."""
        for sub in self.submitters:
            sub.stop.set()
            sub.join(timeout=15)
        if self.sampler is not None:
            self.sampler.stop.set()
            self.sampler.join(timeout=5)
        left: list[str] = []
        for srv in self.servers:
            srv.stop()  # SIGTERM, then SIGKILL of its whole session
            left += _kill_left(srv.pid)
        self.proxy.close()
        self.db.dispose()
        return left


def goal_soak(tmp: Path, quick: bool) -> dict[str, Any]:
    plan = SoakPlan.make(quick)
    goal = (
        f"{plan.experiments} experiments through the API, {DISPATCHERS} dispatchers on PostgreSQL, "
        f"one SIGKILL of the service and one {OUTAGE_S:g} s database outage: 0 lost, 0 "
        f"duplicated, and the service process's RSS, threads and open files at the end within "
        f"{FLAT_TOLERANCE:.0%} of the start"
    )
    address_file = _address_file()
    t0 = time.monotonic()
    with fresh_database() as url:
        soak = Soak(tmp, plan, url)
        try:
            soak.phase_kill()
            soak.phase_outage()
            rows, steps = read_rows(soak.db)
        finally:
            left = soak.close()
    return report(
        soak, goal, rows, steps, left, _stale_address_file(address_file), time.monotonic() - t0
    )


def report(
    soak: Soak,
    goal: str,
    rows: list[Row],
    steps: dict[str, int],
    left: list[str],
    stale: str | None,
    wall_s: float,
) -> dict[str, Any]:
    """The goal's result: the books, the flatness, and what happened when."""
    books = tally(soak.keys, soak.books, rows, steps, STEP_RECORDS)
    f = soak.facts
    start = {k: f["start"][k] for k in METRICS}
    end = {k: f["end"][k] for k in METRICS}
    flat = flatness(start, end)
    met = verdict(books, flat)
    cut = f["outage"]["training_at_cut"]
    return {
        "goal": goal,
        "met": met,
        "status": status_of(met),
        "quick": soak.plan.experiments < 100,
        "experiments": soak.plan.experiments,
        "lost": books["lost"]["count"],
        "duplicated": books["duplicated"]["count"],
        "books": books,
        "service": {
            "measured": "the `failbench serve` process started after the SIGKILL (the Ray driver "
            "and API; not its Ray processes), idle each time: start = after it drained phase 1 "
            "(its re-queued and remaining experiments), end = after phase 2 (the outage)",
            "start": f["start"],
            "end": end | {"pid": f["end"]["pid"], "readings": f["end"]["readings"]},
            "peaks_while_running": soak.sampler.peaks() if soak.sampler else {},
            **flat,
            "whole_session_start": f["session_start"],  # Ray's processes too: no goal
            "whole_session_end": f["session_end"],
        },
        "kill": f["kill"] | {"their_attempts": attempts_of(rows, f["kill"]["training_at_kill"])},
        "outage": f["outage"] | {"their_attempts": attempts_of(rows, cut)},
        "setup": {
            **asdict(soak.plan),
            "dispatchers": DISPATCHERS,
            "lease_s": LEASE_S,
            "outage_s": OUTAGE_S,
            "spec": SPEC,
        },
        "client_answers": dict(soak.books.answers),
        "timeline": soak.events,
        "processes_killed_by_pid_at_the_end": left,
        "stale_ray_address_file_removed": stale,
        "wall_s": wall_s,
    }
