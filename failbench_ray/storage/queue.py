"""The durable experiment queue, in the results database itself.

An experiment is `queued` until a dispatcher claims it: claiming is one atomic statement
(PostgreSQL: `SELECT ... FOR UPDATE SKIP LOCKED`, so dispatchers never wait on each other;
SQLite: a single `UPDATE ... RETURNING`, which takes the one writer lock) that makes it `running`
under a *lease* in the dispatcher's name. The dispatcher renews the lease while it runs the
experiment. If the dispatcher dies, nobody renews it: once it expires any dispatcher puts the
experiment back in the queue (its partial trials are discarded), or, after `max_attempts` runs,
fails it with the reason. Only the lease holder may finish an experiment, so an experiment whose
lease was taken away cannot be completed twice.

Cancelling a queued experiment is immediate; a running one gets `cancel_requested`, which its
dispatcher sees at the next renewal and acts on (it stops the run and every actor).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, delete, func, or_, select, update
from sqlalchemy.orm import Session

from failbench_ray.errors import IdempotencyConflict, InvalidTransition
from failbench_ray.spec import ExperimentSpec
from failbench_ray.storage import repo
from failbench_ray.storage.status import ExperimentStatus, TrialStatus
from failbench_ray.storage.tables import Dispatcher, Experiment, Trial, utcnow

DEFAULT_LEASE_S = 30.0
DEFAULT_MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class Submitted:
    experiment_id: str
    status: str
    created: bool  # False: the Idempotency-Key named an existing experiment


def submit(
    session: Session,
    spec: ExperimentSpec,
    *,
    idempotency_key: str | None = None,
    sweep_id: str | None = None,
) -> Submitted:
    """Queue `spec`. With a key already used for the same spec, the existing experiment."""
    data = spec.model_dump(mode="json")
    if idempotency_key is not None:
        found = session.scalars(
            select(Experiment).where(Experiment.idempotency_key == idempotency_key)
        ).first()
        if found is not None:
            if found.spec != data:
                raise IdempotencyConflict(
                    f"Idempotency-Key {idempotency_key!r} was used for experiment {found.id} "
                    "with a different spec; use a new key for a new experiment"
                )
            return Submitted(found.id, found.status, created=False)
    exp_id = repo.create_experiment(
        session,
        spec=data,
        architecture=spec.architecture.name,
        mechanism=spec.mechanism.name,
        name=spec.name,
        status=ExperimentStatus.QUEUED,
        sweep_id=sweep_id,
    )
    if idempotency_key is not None:
        repo.get_experiment(session, exp_id).idempotency_key = idempotency_key
        session.flush()
    return Submitted(exp_id, ExperimentStatus.QUEUED, created=True)


def claim(session: Session, owner: str, lease_s: float = DEFAULT_LEASE_S) -> str | None:
    """Take the oldest queued experiment for `owner` (now `running`, leased); None if none.
    Call it first thing in a fresh session: the claim must be the transaction's first write."""
    now = utcnow()
    values: dict[str, Any] = {
        "status": ExperimentStatus.RUNNING,
        "lease_owner": owner,
        "lease_expires_at": now + timedelta(seconds=lease_s),
        "attempts": Experiment.attempts + 1,
        "updated_at": now,
        "error": None,
    }
    oldest = (
        select(Experiment.id)
        .where(Experiment.status == ExperimentStatus.QUEUED)
        .order_by(Experiment.created_at, Experiment.id)
        .limit(1)
    )
    if session.get_bind().dialect.name == "postgresql":
        exp_id = session.scalar(oldest.with_for_update(skip_locked=True))
        if exp_id is None:
            return None
        session.execute(update(Experiment).where(Experiment.id == exp_id).values(**values))
        return exp_id
    # SQLite: one statement, so the choice and the update happen under the one write lock.
    stmt = (
        update(Experiment)
        .where(
            Experiment.id == oldest.scalar_subquery(), Experiment.status == ExperimentStatus.QUEUED
        )
        .values(**values)
        .returning(Experiment.id)
    )
    return session.scalar(stmt)


@dataclass(frozen=True)
class Lease:
    held: bool  # False: it expired and was given to someone else (stop, write nothing)
    cancel_requested: bool


def renew(
    session: Session, experiment_id: str, owner: str, lease_s: float = DEFAULT_LEASE_S
) -> Lease:
    """Extend `owner`'s lease on a running experiment."""
    now = utcnow()
    row = session.execute(
        update(Experiment)
        .where(
            Experiment.id == experiment_id,
            Experiment.lease_owner == owner,
            Experiment.status == ExperimentStatus.RUNNING,
        )
        .values(lease_expires_at=now + timedelta(seconds=lease_s))
        .returning(Experiment.cancel_requested)
    ).first()
    if row is None:
        return Lease(held=False, cancel_requested=False)
    return Lease(held=True, cancel_requested=bool(row[0]))


def holds(session: Session, experiment_id: str, owner: str) -> bool:
    exp = session.get(Experiment, experiment_id)
    return exp is not None and exp.lease_owner == owner and exp.status == ExperimentStatus.RUNNING


def release(session: Session, experiment_id: str, owner: str) -> None:
    """Drop `owner`'s lease once the experiment is finished. One still `running` keeps it: it
    expires and the experiment is re-queued, rather than running forever with no owner."""
    session.execute(
        update(Experiment)
        .where(
            Experiment.id == experiment_id,
            Experiment.lease_owner == owner,
            Experiment.status != ExperimentStatus.RUNNING,
        )
        .values(lease_owner=None, lease_expires_at=None)
    )


def give_back(session: Session, experiment_id: str, owner: str, reason: str) -> bool:
    """Put a running experiment back in the queue at once (its dispatcher is stopping); the
    attempt does not count against the retry limit."""
    done = session.execute(
        update(Experiment)
        .where(
            Experiment.id == experiment_id,
            Experiment.lease_owner == owner,
            Experiment.status == ExperimentStatus.RUNNING,
        )
        .values(
            status=ExperimentStatus.QUEUED,
            error=reason,
            lease_owner=None,
            lease_expires_at=None,
            attempts=Experiment.attempts - 1,
            updated_at=utcnow(),
        )
    )
    return bool(done.rowcount)  # type: ignore[attr-defined]


def requeue_expired(session: Session, max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> list[str]:
    """Put running experiments whose lease expired back in the queue, or fail those that used
    up their attempts (cancel those asked to stop). Returns the ids it moved. Each move is a
    compare-and-set on the expired lease, so two dispatchers doing this at once, or a claim in
    between, never move an experiment twice."""
    now = utcnow()
    stale = session.execute(
        select(Experiment.id, Experiment.lease_owner, Experiment.attempts)
        .where(Experiment.status == ExperimentStatus.RUNNING, Experiment.lease_expires_at < now)
        .order_by(Experiment.created_at)
    ).all()
    moved = []
    for exp_id, who, attempts in stale:
        if attempts >= max_attempts:
            status = ExperimentStatus.FAILED
            error = (
                f"its dispatcher stopped renewing the lease (last: {who}); gave up after "
                f"{attempts} attempts (max_attempts={max_attempts})"
            )
        else:
            status, error = (
                ExperimentStatus.QUEUED,
                f"re-queued: the lease of dispatcher {who} expired",
            )
        row = session.execute(
            update(Experiment)
            .where(
                Experiment.id == exp_id,
                Experiment.status == ExperimentStatus.RUNNING,
                Experiment.lease_owner == who,
                Experiment.lease_expires_at < now,
            )
            .values(
                status=case(
                    (Experiment.cancel_requested, ExperimentStatus.CANCELLED), else_=status
                ),
                error=case(
                    (Experiment.cancel_requested, f"cancelled (its dispatcher {who} died)"),
                    else_=error,
                ),
                lease_owner=None,
                lease_expires_at=None,
                updated_at=now,
            )
            .returning(Experiment.status, Experiment.error)
        ).first()
        if row is None:
            continue  # renewed, finished or moved by someone else meanwhile
        moved.append(exp_id)
        if row[0] != ExperimentStatus.QUEUED:
            session.execute(
                update(Trial)
                .where(Trial.experiment_id == exp_id, Trial.status == TrialStatus.RUNNING)
                .values(status=TrialStatus.INTERRUPTED, finished_at=now, error=row[1])
            )
    return moved


def cancel(session: Session, experiment_id: str) -> str:
    """Cancel: a queued experiment at once, a running one by request (its dispatcher stops
    it). Returns the status after the call."""
    repo.get_experiment(session, experiment_id)  # 404 before anything else
    now = utcnow()
    done = session.execute(
        update(Experiment)
        .where(Experiment.id == experiment_id, Experiment.status == ExperimentStatus.QUEUED)
        .values(status=ExperimentStatus.CANCELLED, error="cancelled before it ran", updated_at=now)
    )
    if done.rowcount:  # type: ignore[attr-defined]
        return ExperimentStatus.CANCELLED
    asked = session.execute(
        update(Experiment)
        .where(Experiment.id == experiment_id, Experiment.status == ExperimentStatus.RUNNING)
        .values(cancel_requested=True, updated_at=now)
    )
    if asked.rowcount:  # type: ignore[attr-defined]
        return ExperimentStatus.RUNNING
    status = session.scalar(select(Experiment.status).where(Experiment.id == experiment_id))
    raise InvalidTransition(
        f"experiment {experiment_id} is {status}: only a queued or running "
        "experiment can be cancelled"
    )


def depth(session: Session) -> int:
    return int(
        session.scalar(select(func.count()).where(Experiment.status == ExperimentStatus.QUEUED))
        or 0
    )


def counts_by_status(session: Session) -> dict[str, int]:
    rows = session.execute(select(Experiment.status, func.count()).group_by(Experiment.status))
    return {status: int(n) for status, n in rows}


# -- dispatchers' heartbeats -----------------------------------------------------------------
def new_owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"


def heartbeat(
    session: Session,
    owner: str,
    experiment_id: str | None,
    *,
    ran: int = 0,
    lease_s: float = DEFAULT_LEASE_S,
) -> None:
    """Record that dispatcher `owner` is alive (and what it runs), for `lease_s` more."""
    now = utcnow()
    row = session.get(Dispatcher, owner)
    if row is None:
        host, pid = owner.split(":")[0], os.getpid()
        row = Dispatcher(id=owner, host=host, pid=pid, started_at=now, heartbeat_at=now, runs=0)
        session.add(row)
    row.heartbeat_at = now
    row.expires_at = now + timedelta(seconds=lease_s)
    row.experiment_id = experiment_id
    row.runs += ran
    session.flush()


def _expired(now: datetime) -> Any:
    # a row from before expiry was recorded: its heartbeat plus the default lease
    return or_(
        Dispatcher.expires_at < now,
        and_(
            Dispatcher.expires_at.is_(None),
            Dispatcher.heartbeat_at < now - timedelta(seconds=DEFAULT_LEASE_S),
        ),
    )


def dispatchers(session: Session) -> list[Dispatcher]:
    """The dispatchers alive now (their heartbeat has not expired)."""
    stmt = select(Dispatcher).where(~_expired(utcnow())).order_by(Dispatcher.started_at)
    return list(session.scalars(stmt))


def forget_expired_dispatchers(session: Session) -> list[str]:
    """Delete the dispatchers whose heartbeat expired (killed, or their host is gone)."""
    gone = list(session.scalars(select(Dispatcher.id).where(_expired(utcnow()))))
    if gone:
        session.execute(delete(Dispatcher).where(Dispatcher.id.in_(gone)))
    return gone


def forget_dispatcher(session: Session, owner: str) -> None:
    session.execute(delete(Dispatcher).where(Dispatcher.id == owner))


def seconds_since(t: datetime) -> float:
    return (utcnow() - t).total_seconds()
