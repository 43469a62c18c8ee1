"""Issue 16, item 4: a database outage shorter than the retry window (a dispatcher's lease)
costs a running experiment nothing: its writes retry with backoff. The outage is real: the
run's connections to PostgreSQL go through a proxy that drops them and refuses new ones (the
shared server keeps running)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from failbench_ray import cli
from failbench_ray.errors import DatabaseError
from failbench_ray.runner import mark_database_lost, run_experiment
from failbench_ray.spec import parse_spec
from failbench_ray.storage import queue, repo
from failbench_ray.storage.db import Database
from failbench_ray.storage.tables import Trial
from tests.conftest import fresh_pg_database
from tests.tcpproxy import Proxy

SPEC = {
    "architecture": "ddp",
    "world_size": 2,
    "model": {"kind": "mlp", "input_dim": 8, "hidden_dim": 16, "depth": 2},
    "steps": 30,
    "batch_size": 8,
    "warmup_steps": 1,
    "baseline": False,
}
OUTAGE_S = 6.0  # longer than what is left of the trial once it starts: its writes hit it


def _run_through_an_outage(
    url: str, tmp: Path, retry_s: float, created: list[str] | None = None
) -> str:
    """Run SPEC with the database cut from step 2 for OUTAGE_S; the experiment's status.
    Where the run gives up, a CLI run's handling of that (`_database_lost`) is checked."""
    proxy = Proxy(("127.0.0.1", 5432))
    db = Database(url.replace(":5432/", f":{proxy.port}/"))
    cut = threading.Event()
    created = [] if created is None else created

    def at_step(label: str, step: int, total: int) -> None:
        if step >= 2 and not cut.is_set():
            cut.set()
            proxy.cut()
            threading.Timer(OUTAGE_S, proxy.restore).start()

    try:
        try:
            result = run_experiment(
                parse_spec(SPEC),
                db=db,
                out_dir=tmp,
                progress=at_step,
                db_retry_s=retry_s,
                on_created=created.append,
            )
        except OperationalError:
            _check_a_cli_run_marks_it_failed(db, created[0], retry_s)
            raise
    finally:
        db.dispose()
        proxy.close()
    assert cut.is_set(), "the outage never started"
    return result.status


def _check_a_cli_run_marks_it_failed(db: Database, exp_id: str, retry_s: float) -> None:
    """The run gave up with the database still cut: its row would say `running` for ever.
    Still down: it cannot be marked (and says so). Back (the proxy restores within
    OUTAGE_S): the CLI's handler marks it failed, and says what to do."""
    assert not mark_database_lost(db, exp_id, retry_s, wait_s=0.2)
    err = cli._database_lost(db, [exp_id], retry_s)
    assert isinstance(err, DatabaseError) and f"experiment {exp_id} is marked failed" in str(err)
    with db.session() as s:
        row = repo.get_experiment(s, exp_id)
        assert row.status == "failed" and "database stayed unreachable" in (row.error or "")


@pytest.mark.postgres
@pytest.mark.usefixtures("no_leaks")
def test_an_outage_shorter_than_the_retry_window_costs_the_run_nothing(tmp_path: Path) -> None:
    with fresh_pg_database() as url:
        assert _run_through_an_outage(url, tmp_path / "a", retry_s=30) == "completed"
        # the same outage without retries: the trial's results are lost with the write, and
        # the experiment is marked failed once the database is back (a CLI run's case)
        with pytest.raises(OperationalError):
            _run_through_an_outage(url, tmp_path / "b", retry_s=0)


@pytest.mark.postgres
@pytest.mark.usefixtures("no_leaks")
def test_an_outage_longer_than_the_lease_requeues_without_costing_an_attempt(
    tmp_path: Path,
) -> None:
    """A dispatcher whose run's writes outlast their retries (the lease) puts the experiment
    back in the queue, not failed and without counting the attempt, and runs it again once the
    database answers. (Before: its writes failed at once, it logged "failed", and the
    experiment waited out a dead lease and burned one of --max-attempts.)"""
    from service.dispatcher import Dispatcher

    with fresh_pg_database() as url:
        direct = Database(url)
        proxy = Proxy(("127.0.0.1", 5432))
        db = Database(url.replace(":5432/", f":{proxy.port}/"))
        with direct.session() as s:
            exp_id = queue.submit(s, parse_spec(SPEC)).experiment_id
        stop = threading.Event()
        d = Dispatcher(db, lease_s=2.0, poll_s=0.2, out_dir=tmp_path, stop_event=stop)
        runner = threading.Thread(target=d.run_forever, args=(stop,), daemon=True)
        runner.start()
        try:
            _cut_once_training(direct, exp_id, proxy, outage_s=8.0)
            final = _wait_done(direct, exp_id, timeout_s=180)
        finally:
            stop.set()
            runner.join(timeout=120)
            db.dispose()
            direct.dispose()
            proxy.close()
    assert final == ("completed", 1), final  # one attempt: the outage did not count


def _cut_once_training(db: Database, exp_id: str, proxy: Proxy, outage_s: float) -> None:
    """Cut the proxy as soon as the experiment's trial starts; restore it `outage_s` later."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with db.session() as s:
            if s.scalars(select(Trial).where(Trial.experiment_id == exp_id)).first():
                proxy.cut()
                threading.Timer(outage_s, proxy.restore).start()
                return
        time.sleep(0.05)
    raise AssertionError("the experiment's trial never started")


def _wait_done(db: Database, exp_id: str, timeout_s: float) -> tuple[str, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with db.session() as s:
            row = repo.get_experiment(s, exp_id)
            if row.status in ("completed", "failed", "cancelled"):
                return str(row.status), row.attempts
        time.sleep(0.2)
    raise AssertionError("the experiment did not finish")
