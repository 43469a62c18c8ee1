"""The SQL queue on real SQLite and PostgreSQL: idempotent submission, exclusive claims under
contention, leases that expire and re-queue, cancels, and the retry limit."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from failbench_ray.spec import ExperimentSpec, parse_spec
from failbench_ray.storage import queue, repo
from failbench_ray.storage.db import Database
from failbench_ray.storage.tables import Dispatcher, Experiment, Trial, utcnow


def spec(**over: Any) -> ExperimentSpec:
    data: dict[str, Any] = {
        "architecture": "ddp",
        "world_size": 2,
        "model": {"kind": "mlp", "input_dim": 8, "hidden_dim": 8, "depth": 1},
        "steps": 3,
        "batch_size": 4,
        "mechanism": "none",
    }
    return parse_spec({**data, **over})


def status(db: Database, exp_id: str) -> tuple[str, str | None, int]:
    with db.session() as s:
        e = repo.get_experiment(s, exp_id)
        return e.status, e.lease_owner, e.attempts


def expire(db: Database, exp_id: str) -> None:
    with db.session() as s:
        s.execute(
            update(Experiment)
            .where(Experiment.id == exp_id)
            .values(lease_expires_at=utcnow() - timedelta(seconds=1))
        )


def test_an_idempotency_key_returns_the_same_experiment(db: Database) -> None:
    with db.session() as s:
        first = queue.submit(s, spec(), idempotency_key="k1")
        again = queue.submit(s, spec(), idempotency_key="k1")
        other = queue.submit(s, spec())
    assert first.created and not again.created and other.created
    assert again.experiment_id == first.experiment_id != other.experiment_id
    with db.session() as s, pytest.raises(queue.IdempotencyConflict, match="different spec"):
        queue.submit(s, spec(steps=4), idempotency_key="k1")
    with db.session() as s:
        assert queue.counts_by_status(s) == {"queued": 2}


def test_claims_go_oldest_first_and_each_to_one_dispatcher(db: Database) -> None:
    with db.session() as s:
        ids = [queue.submit(s, spec(name=f"e{i}")).experiment_id for i in range(30)]
    got: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def dispatcher(name: str) -> None:
        mine: list[str] = []
        try:
            with Database(db.url, migrate=False) as own:  # its own connections, like a process
                while True:
                    with own.session() as s:
                        exp_id = queue.claim(s, name, lease_s=60)
                    if exp_id is None:
                        break
                    mine.append(exp_id)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
        got[name] = mine

    threads = [threading.Thread(target=dispatcher, args=(f"d{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    claimed = [e for mine in got.values() for e in mine]
    assert sorted(claimed) == sorted(ids)  # every one claimed, none twice
    for name, mine in got.items():
        assert mine == sorted(mine, key=ids.index)  # each dispatcher took them oldest first
        for exp_id in mine:
            assert status(db, exp_id) == ("running", name, 1)
    with db.session() as s:
        assert queue.claim(s, "late") is None
        assert queue.depth(s) == 0


def test_a_lease_is_renewed_by_its_owner_only(db: Database) -> None:
    with db.session() as s:
        exp_id = queue.submit(s, spec()).experiment_id
    with db.session() as s:
        assert queue.claim(s, "a", lease_s=60) == exp_id
    with db.session() as s:
        assert queue.renew(s, exp_id, "a") == queue.Lease(held=True, cancel_requested=False)
        assert queue.renew(s, exp_id, "b") == queue.Lease(held=False, cancel_requested=False)
        assert queue.holds(s, exp_id, "a") and not queue.holds(s, exp_id, "b")


def test_an_expired_lease_requeues_then_fails_after_max_attempts(db: Database) -> None:
    with db.session() as s:
        exp_id = queue.submit(s, spec()).experiment_id
    for attempt in (1, 2):
        with db.session() as s:
            assert queue.claim(s, f"d{attempt}", lease_s=60) == exp_id
        with db.session() as s:  # not expired yet: nothing moves
            assert queue.requeue_expired(s, max_attempts=2) == []
        with db.session() as s:
            trial = repo.create_trial(s, experiment_id=exp_id, kind="trial", index=0)
        expire(db, exp_id)
        with db.session() as s:
            assert queue.requeue_expired(s, max_attempts=2) == [exp_id]
            assert queue.requeue_expired(s, max_attempts=2) == []  # moved once
        if attempt == 1:
            st, owner, n = status(db, exp_id)
            assert (st, owner, n) == ("queued", None, 1)
            with db.session() as s:
                error = repo.get_experiment(s, exp_id).error or ""
                assert "lease of dispatcher d1 expired" in error
                repo.delete_trials(s, exp_id)  # what the next run does first
    st, owner, n = status(db, exp_id)
    assert (st, owner, n) == ("failed", None, 2)
    with db.session() as s:
        e = repo.get_experiment(s, exp_id)
        assert "gave up after 2 attempts" in (e.error or "")
        t = s.get(Trial, trial)
        assert t is not None and t.status == "interrupted"  # no row left `running`
        # the lost owner cannot renew or finish it
        assert queue.renew(s, exp_id, "d2").held is False


def test_cancel(db: Database) -> None:
    with db.session() as s:
        queued = queue.submit(s, spec(name="q")).experiment_id
        running = queue.submit(s, spec(name="r")).experiment_id
    with db.session() as s:
        assert queue.claim(s, "d", lease_s=60) == queued  # the oldest first
    with db.session() as s:
        assert queue.cancel(s, running) == "cancelled"  # still queued: at once
        assert queue.cancel(s, queued) == "running"  # running: by request
    assert status(db, running)[0] == "cancelled"
    with db.session() as s:
        assert queue.renew(s, queued, "d") == queue.Lease(held=True, cancel_requested=True)
        with pytest.raises(queue.InvalidTransition, match="is cancelled"):
            queue.cancel(s, running)
        with pytest.raises(repo.ExperimentNotFound):
            queue.cancel(s, "f" * 32)
    # a cancel request whose dispatcher died ends cancelled, not re-queued
    expire(db, queued)
    with db.session() as s:
        assert queue.requeue_expired(s) == [queued]
    assert status(db, queued)[:2] == ("cancelled", None)


def test_release_keeps_the_lease_of_an_experiment_still_running(db: Database) -> None:
    with db.session() as s:
        exp_id = queue.submit(s, spec()).experiment_id
    with db.session() as s:
        queue.claim(s, "d", lease_s=60)
    with db.session() as s:
        queue.release(s, exp_id, "d")
    assert status(db, exp_id)[:2] == ("running", "d")  # would otherwise never be re-queued
    with db.session() as s:
        repo.set_experiment_status(s, exp_id, "completed")
        queue.release(s, exp_id, "d")
    assert status(db, exp_id)[:2] == ("completed", None)


def test_heartbeats(db: Database) -> None:
    with db.session() as s:
        queue.heartbeat(s, "host:1:aa", None)
    time.sleep(0.01)
    with db.session() as s:
        queue.heartbeat(s, "host:1:aa", "e1", ran=1)
        (d,) = queue.dispatchers(s)
        assert (d.id, d.host, d.experiment_id, d.runs) == ("host:1:aa", "host", "e1", 1)
        assert d.heartbeat_at > d.started_at
        queue.forget_dispatcher(s, d.id)
        assert queue.dispatchers(s) == []


def test_a_dispatcher_whose_heartbeat_expired_leaves_the_table(db: Database) -> None:
    """Issue 16: a dispatcher killed without saying goodbye stayed in the table, counted by
    /healthz and busy on /metrics, forever."""
    with db.session() as s:
        queue.heartbeat(s, "host:1:dead", "e1", lease_s=0.05)
        queue.heartbeat(s, "host:2:alive", None, lease_s=60)
    time.sleep(0.1)
    with db.session() as s:
        assert [d.id for d in queue.dispatchers(s)] == ["host:2:alive"]
        assert queue.forget_expired_dispatchers(s) == ["host:1:dead"]
    with db.session() as s:
        assert {d.id for d in s.scalars(select(Dispatcher))} == {"host:2:alive"}
        assert queue.forget_expired_dispatchers(s) == []
