"""Recovery events time the parts of re-formation (`records.REFORM_PARTS`): when the
replacements were up, every member reached the store, every group was connected and the first
collective went through, when the survivors had reached the new group's store, and when the
new processes of cold replacements were asked for, each in seconds after the injection like the
phases.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05 21:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PARTS = ("replaced_s", "rendezvous_s", "connected_s", "collective_s", "survivors_s", "spawned_s")


def upgrade() -> None:
    with op.batch_alter_table("recovery_events") as t:
        for name in _PARTS:
            t.add_column(sa.Column(name, sa.Double(), nullable=True))  # as the phases


def downgrade() -> None:
    with op.batch_alter_table("recovery_events") as t:
        for name in reversed(_PARTS):
            t.drop_column(name)
