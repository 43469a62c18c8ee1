"""SQL schema of the results store: experiments, their trials, and what each trial produced.

The schema is created and evolved only by the Alembic migrations next to this file
(`migrations/versions`); these models must stay in step with them (a test compares the two).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    Double,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.sql.expression import false

TRIAL_KINDS = ("baseline", "trial")  # the statuses: failbench_ray/storage/status.py

# Deterministic constraint names, so that migrations can refer to them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_id() -> str:
    return uuid.uuid4().hex


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that always comes back tz-aware in UTC.

    SQLite has no time zones and returns naive datetimes; values are stored in UTC everywhere and
    tagged as UTC on the way out. Naive input is taken to be UTC already.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:  # PostgreSQL would read it in the session's time zone
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


# Step records grow fastest; SQLite only auto-increments a plain INTEGER primary key.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    """Declarative base with the type conventions of every table.

    Free-form strings are unbounded VARCHAR: SQLite ignores lengths, so a length limit would only
    ever fail on PostgreSQL, in production. Floats are DOUBLE PRECISION everywhere: epoch seconds
    need the 53-bit mantissa.
    """

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        datetime: UTCDateTime(),
        float: Double(),
        dict[str, Any]: JSON(),
        list[int]: JSON(),
    }


class Experiment(Base):
    """One mechanism benchmarked on one architecture: a baseline and its trials."""

    __tablename__ = "experiments"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    status: Mapped[str] = mapped_column(String(20), index=True)
    architecture: Mapped[str] = mapped_column(index=True)
    mechanism: Mapped[str] = mapped_column(index=True)
    sweep_id: Mapped[str | None] = mapped_column(index=True)
    spec: Mapped[dict[str, Any]]
    error: Mapped[str | None] = mapped_column(Text)
    # The queue (see `failbench_ray.storage.queue`): runs so far, who holds it and until when.
    attempts: Mapped[int] = mapped_column(default=0, server_default="0")
    lease_owner: Mapped[str | None]
    lease_expires_at: Mapped[datetime | None]
    cancel_requested: Mapped[bool] = mapped_column(default=False, server_default=false())
    idempotency_key: Mapped[str | None] = mapped_column(index=True, unique=True)

    trials: Mapped[list[Trial]] = relationship(
        back_populates="experiment", passive_deletes=True, order_by="(Trial.kind, Trial.index)"
    )


class Dispatcher(Base):
    """A process that runs queued experiments; its heartbeat says it is alive."""

    __tablename__ = "dispatchers"

    id: Mapped[str] = mapped_column(primary_key=True)
    host: Mapped[str]
    pid: Mapped[int]
    started_at: Mapped[datetime]
    heartbeat_at: Mapped[datetime]
    experiment_id: Mapped[str | None] = mapped_column(String(32))
    runs: Mapped[int] = mapped_column(default=0, server_default="0")
    # Alive until then unless it beats again (heartbeat + its lease): a dispatcher killed
    # without saying goodbye leaves the table once this passes.
    expires_at: Mapped[datetime | None] = mapped_column(index=True)


class Trial(Base):
    """One run of an experiment: the failure-free baseline (kind "baseline") or a trial."""

    __tablename__ = "trials"
    __table_args__ = (UniqueConstraint("experiment_id", "kind", "index"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    experiment_id: Mapped[str] = mapped_column(
        ForeignKey("experiments.id", ondelete="CASCADE"), index=True
    )
    kind: Mapped[str] = mapped_column(String(16))
    index: Mapped[int]
    status: Mapped[str] = mapped_column(String(20))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]
    step_time_s: Mapped[float | None]
    mean_step_time_s: Mapped[float | None]
    overhead_pct: Mapped[float | None]
    final_loss: Mapped[float | None]
    params_digest: Mapped[str | None]
    matches_baseline: Mapped[bool | None]
    match_expected: Mapped[bool] = mapped_column(default=False)
    error: Mapped[str | None] = mapped_column(Text)
    extra: Mapped[dict[str, Any]] = mapped_column(default=dict)

    experiment: Mapped[Experiment] = relationship(back_populates="trials")


class StepRecordRow(Base):
    """A `records.StepRecord`."""

    __tablename__ = "step_records"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int]
    step: Mapped[int]
    generation: Mapped[int]
    loss: Mapped[float | None]  # NULL: NaN (a diverged loss) stored by SQLite, which has no NaN
    t_start: Mapped[float]
    t_end: Mapped[float]
    samples: Mapped[int]
    blocked_s: Mapped[float] = mapped_column(default=0.0)


class RecoveryEventRow(Base):
    """A `records.FailureRecord`: one injected failure and the recovery that followed.

    One column per recovery phase (seconds after `t_injected`), so phases can be aggregated in
    SQL; `lost_steps` is derived but stored for the same reason.
    """

    __tablename__ = "recovery_events"
    __table_args__ = (UniqueConstraint("trial_id", "failure_index"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"), index=True)
    failure_index: Mapped[int]
    ranks: Mapped[list[int]]
    kill_kind: Mapped[str]
    trigger: Mapped[str]
    injected_at_step: Mapped[int]
    t_injected: Mapped[float]
    quiesce: Mapped[str] = mapped_column(default="")
    quiesce_reason: Mapped[str] = mapped_column(default="")
    replacement: Mapped[str] = mapped_column(default="")  # cold | warm | none
    detector: Mapped[str] = mapped_column(default="death")  # what found it
    restore_source: Mapped[str] = mapped_column(default="")
    restored_from_step: Mapped[int | None]
    lost_steps: Mapped[int | None]
    interrupted_by: Mapped[int | None]
    detected_s: Mapped[float | None]
    quiesced_s: Mapped[float | None]
    reformed_s: Mapped[float | None]
    restored_s: Mapped[float | None]
    resumed_s: Mapped[float | None]
    caught_up_s: Mapped[float | None]
    # The parts of re-formation (`records.REFORM_PARTS`), also seconds after `t_injected`.
    replaced_s: Mapped[float | None]
    rendezvous_s: Mapped[float | None]
    connected_s: Mapped[float | None]
    collective_s: Mapped[float | None]
    survivors_s: Mapped[float | None]  # `records.SURVIVORS_AT_STORE`
    spawned_s: Mapped[float | None]  # `records.SPAWNED`


class CheckpointEventRow(Base):
    """A `records.CheckpointEvent`."""

    __tablename__ = "checkpoint_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int]
    step: Mapped[int]
    kind: Mapped[str]
    nbytes: Mapped[int] = mapped_column(BigInteger)
    duration_s: Mapped[float]
    t_end: Mapped[float]
    path: Mapped[str] = mapped_column(Text, default="")


class Sweep(Base):
    """A grid of experiments. The same name and the same expanded cells are the same sweep."""

    __tablename__ = "sweeps"
    __table_args__ = (UniqueConstraint("name", "spec_hash"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    spec: Mapped[dict[str, Any]]
    spec_hash: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(20))

    cells: Mapped[list[SweepCell]] = relationship(
        back_populates="sweep", passive_deletes=True, order_by="SweepCell.position"
    )


class SweepCell(Base):
    """One point of a sweep: the experiment that ran it, or why it is skipped."""

    __tablename__ = "sweep_cells"
    __table_args__ = (UniqueConstraint("sweep_id", "key"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"))
    position: Mapped[int]  # order of the expansion
    key: Mapped[str]
    architecture: Mapped[str]
    mechanism: Mapped[str]
    trace: Mapped[str]
    status: Mapped[str] = mapped_column(String(20))
    reason: Mapped[str | None] = mapped_column(Text)  # why skipped, or why it failed
    # The latest experiment of the cell (a re-run makes a new one; the old keeps its sweep_id).
    experiment_id: Mapped[str | None] = mapped_column(
        String(32), ForeignKey("experiments.id", ondelete="SET NULL")
    )
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    sweep: Mapped[Sweep] = relationship(back_populates="cells")
