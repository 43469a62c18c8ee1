"""Recovery events say how the dead ranks came back (cold, warm or none), and the quiesce
strategy apart from why it differs from the spec's (it was one string, "kill_survivors (abort:
...)", that readers had to parse).

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
        t.add_column(sa.Column("quiesce_reason", sa.String(), nullable=False, server_default=""))
    prefix = "kill_survivors ("
    op.execute(
        sa.text(
            "UPDATE recovery_events SET quiesce_reason = "
            "substr(quiesce, :start, length(quiesce) - :start), quiesce = 'kill_survivors' "
            "WHERE quiesce LIKE 'kill_survivors (%)'"
        ).bindparams(start=len(prefix) + 1)
    )


def downgrade() -> None:
    op.execute(
        sa.text(
            "UPDATE recovery_events SET quiesce = 'kill_survivors (' || quiesce_reason || ')' "
            "WHERE quiesce_reason <> ''"
        )
    )
    with op.batch_alter_table("recovery_events") as t:
        t.drop_column("quiesce_reason")
        t.drop_column("replacement")
