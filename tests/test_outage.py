"""Issue 16, item 4: a database outage shorter than the retry window (a dispatcher's lease)
costs a running experiment nothing: its writes retry with backoff. The outage is real: the
run's connections to PostgreSQL go through a proxy that drops them and refuses new ones (the
shared server keeps running)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from failbench_ray.runner import run_experiment
from failbench_ray.spec import parse_spec
from failbench_ray.storage.db import Database
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


def _run_through_an_outage(url: str, tmp: Path, retry_s: float) -> str:
    """Run SPEC with the database cut from step 2 for OUTAGE_S; the experiment's status."""
    proxy = Proxy(("127.0.0.1", 5432))
    db = Database(url.replace(":5432/", f":{proxy.port}/"))
    cut = threading.Event()

    def at_step(label: str, step: int, total: int) -> None:
        if step >= 2 and not cut.is_set():
            cut.set()
            proxy.cut()
            threading.Timer(OUTAGE_S, proxy.restore).start()

    try:
        result = run_experiment(
            parse_spec(SPEC), db=db, out_dir=tmp, progress=at_step, db_retry_s=retry_s
        )
    finally:
        db.dispose()
        proxy.close()
    assert cut.is_set(), "the outage never started"
    return result.status


@pytest.mark.postgres
@pytest.mark.usefixtures("no_leaks")
def test_an_outage_shorter_than_the_retry_window_costs_the_run_nothing(tmp_path: Path) -> None:
    with fresh_pg_database() as url:
        assert _run_through_an_outage(url, tmp_path / "a", retry_s=30) == "completed"
        # the same outage without retries: the trial's results are lost with the write
        with pytest.raises(OperationalError):
            _run_through_an_outage(url, tmp_path / "b", retry_s=0)
