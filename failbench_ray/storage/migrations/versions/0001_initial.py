"""Initial schema: experiments, trials, step records, recovery events, checkpoint events.

Written by hand and self-contained (it does not import the models, which will move on), with
the constraint names of `tables.NAMING_CONVENTION`.

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# SQLite only auto-increments a plain INTEGER primary key.
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _ts(name: str, nullable: bool = False) -> sa.Column[datetime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _double(name: str, nullable: bool = True) -> sa.Column[float]:
    return sa.Column(name, sa.Double(), nullable=nullable)


def _trial_fk(table: str) -> sa.Column[int]:
    return sa.Column(
        "trial_id",
        sa.Integer(),
        sa.ForeignKey("trials.id", name=f"fk_{table}_trial_id_trials", ondelete="CASCADE"),
        nullable=False,
    )


def _index(table: str, column: str) -> None:
    op.create_index(f"ix_{table}_{column}", table, [column])


def upgrade() -> None:
    op.create_table(
        "experiments",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(), nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("architecture", sa.String(), nullable=False),
        sa.Column("mechanism", sa.String(), nullable=False),
        sa.Column("sweep_id", sa.String(), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_experiments"),
    )
    for column in ("created_at", "status", "architecture", "mechanism", "sweep_id"):
        _index("experiments", column)

    op.create_table(
        "trials",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column(
            "experiment_id",
            sa.String(32),
            sa.ForeignKey(
                "experiments.id", name="fk_trials_experiment_id_experiments", ondelete="CASCADE"
            ),
            nullable=False,
        ),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        _ts("started_at"),
        _ts("finished_at", nullable=True),
        _double("step_time_s"),
        _double("mean_step_time_s"),
        _double("overhead_pct"),
        _double("final_loss"),
        sa.Column("params_digest", sa.String(), nullable=True),
        sa.Column("matches_baseline", sa.Boolean(), nullable=True),
        sa.Column("match_expected", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("extra", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_trials"),
        sa.UniqueConstraint(
            "experiment_id", "kind", "index", name="uq_trials_experiment_id_kind_index"
        ),
    )
    _index("trials", "experiment_id")

    op.create_table(
        "step_records",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        _trial_fk("step_records"),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        _double("loss"),  # SQLite stores NaN as NULL
        _double("t_start", nullable=False),
        _double("t_end", nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        _double("blocked_s", nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_step_records"),
    )
    _index("step_records", "trial_id")

    op.create_table(
        "recovery_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        _trial_fk("recovery_events"),
        sa.Column("failure_index", sa.Integer(), nullable=False),
        sa.Column("ranks", sa.JSON(), nullable=False),
        sa.Column("kill_kind", sa.String(), nullable=False),
        sa.Column("trigger", sa.String(), nullable=False),
        sa.Column("injected_at_step", sa.Integer(), nullable=False),
        _double("t_injected", nullable=False),
        sa.Column("quiesce", sa.String(), nullable=False),
        sa.Column("restore_source", sa.String(), nullable=False),
        sa.Column("restored_from_step", sa.Integer(), nullable=True),
        sa.Column("lost_steps", sa.Integer(), nullable=True),
        sa.Column("interrupted_by", sa.Integer(), nullable=True),
        *(
            _double(f"{phase}_s")
            for phase in ("detected", "quiesced", "reformed", "restored", "resumed", "caught_up")
        ),
        sa.PrimaryKeyConstraint("id", name="pk_recovery_events"),
        sa.UniqueConstraint(
            "trial_id", "failure_index", name="uq_recovery_events_trial_id_failure_index"
        ),
    )
    _index("recovery_events", "trial_id")

    op.create_table(
        "checkpoint_events",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        _trial_fk("checkpoint_events"),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        _double("duration_s", nullable=False),
        _double("t_end", nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoint_events"),
    )
    _index("checkpoint_events", "trial_id")


def downgrade() -> None:
    # Children first; dropping a table drops its indexes.
    for table in ("checkpoint_events", "recovery_events", "step_records", "trials", "experiments"):
        op.drop_table(table)
