"""Sweeps: a grid of experiments, one row per cell.

Written by hand and self-contained, like 0001. `experiments.sweep_id` exists since 0001 and stays
a plain column (no foreign key): adding one would make SQLite copy the experiments table.

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-02 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_sweeps"),
        sa.UniqueConstraint("name", "spec_hash", name="uq_sweeps_name_spec_hash"),
    )
    op.create_table(
        "sweep_cells",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column(
            "sweep_id",
            sa.String(32),
            sa.ForeignKey("sweeps.id", name="fk_sweep_cells_sweep_id_sweeps", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(), nullable=False),
        sa.Column("architecture", sa.String(), nullable=False),
        sa.Column("mechanism", sa.String(), nullable=False),
        sa.Column("trace", sa.String(), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column(
            "experiment_id",
            sa.String(32),
            sa.ForeignKey(
                "experiments.id",
                name="fk_sweep_cells_experiment_id_experiments",
                ondelete="SET NULL",
            ),
            nullable=True,
        ),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_sweep_cells"),
        sa.UniqueConstraint("sweep_id", "key", name="uq_sweep_cells_sweep_id_key"),
    )


def downgrade() -> None:
    op.drop_table("sweep_cells")
    op.drop_table("sweeps")
