"""Recovery events say how the dead ranks came back: cold, warm or none.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("recovery_events") as t:
        t.add_column(sa.Column("replacement", sa.String(), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("recovery_events") as t:
        t.drop_column("replacement")
