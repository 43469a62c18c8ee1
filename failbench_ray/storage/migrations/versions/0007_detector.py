"""Recovery events say which detector found the failure: `death` (the process ended) or
`heartbeat` (it lived but answered nothing). Rows from before say `death`: only fail-stop
kinds existed then.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 18:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("recovery_events") as t:
        t.add_column(sa.Column("detector", sa.String(), nullable=False, server_default="death"))


def downgrade() -> None:
    with op.batch_alter_table("recovery_events") as t:
        t.drop_column("detector")
