"""A dispatcher's heartbeat says until when it counts as alive (its lease), so one that died
without saying goodbye leaves the table, `/healthz` and `/metrics` once that passes.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("dispatchers") as t:
        t.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        t.create_index("ix_dispatchers_expires_at", ["expires_at"])


def downgrade() -> None:
    with op.batch_alter_table("dispatchers") as t:
        t.drop_index("ix_dispatchers_expires_at")
        t.drop_column("expires_at")
