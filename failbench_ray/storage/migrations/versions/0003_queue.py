"""The experiment queue: leases, attempts, cancel requests, idempotency keys; dispatchers.

Columns are added with server defaults (SQLite adds such columns in place) and the unique
idempotency key is an index, not a table constraint, for the same reason.

Revision ID: 0003
Revises: 0002
Create Date: 2025-01-03 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("experiments") as t:
        t.add_column(sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"))
        t.add_column(sa.Column("lease_owner", sa.String(), nullable=True))
        t.add_column(sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))
        t.add_column(
            sa.Column("cancel_requested", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        t.add_column(sa.Column("idempotency_key", sa.String(), nullable=True))
    op.create_index(
        "ix_experiments_idempotency_key", "experiments", ["idempotency_key"], unique=True
    )
    op.create_table(
        "dispatchers",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("host", sa.String(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("experiment_id", sa.String(32), nullable=True),
        sa.Column("runs", sa.Integer(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("id", name="pk_dispatchers"),
    )


def downgrade() -> None:
    op.drop_table("dispatchers")
    op.drop_index("ix_experiments_idempotency_key", table_name="experiments")
    with op.batch_alter_table("experiments") as t:
        for column in (
            "idempotency_key",
            "cancel_requested",
            "lease_expires_at",
            "lease_owner",
            "attempts",
        ):
            t.drop_column(column)
