"""Experiment lifecycle and lineage: states active/paused/errored/killed, pause/kill requests, a
GC policy set later, parent experiments, runs started from a checkpoint, recorded decisions.

Revision ID: 0003_lifecycle
Revises: 0002_trial_reproducibility
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_lifecycle"
down_revision: str | None = "0002_trial_reproducibility"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RENAMED = {  # 0001's state names → Determined's
    "experiments": {"running": "active", "failed": "errored", "canceled": "killed"},
    "trials": {"running": "active", "failed": "errored", "stopped": "killed"},
}


def upgrade() -> None:
    # Plain ADD COLUMN (SQLite accepts a REFERENCES clause there): a batch copy of `experiments`
    # would drop a table other tables' foreign keys point at.
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE experiments ADD COLUMN parent_id INTEGER REFERENCES experiments (id)")
    else:
        op.add_column("experiments", sa.Column("parent_id", sa.Integer(), nullable=True))
        op.create_foreign_key("fk_experiments_parent_id", "experiments", "experiments", ["parent_id"], ["id"])
    op.add_column("experiments", sa.Column("gc_policy_json", sa.Text(), nullable=True))
    op.add_column("experiments", sa.Column("requested", sa.String(), nullable=True))
    op.add_column("trials", sa.Column("source_checkpoint_json", sa.Text(), nullable=True))
    op.create_table(
        "decisions",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("trial_id", sa.Integer(), sa.ForeignKey("trials.id"), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("payload_json", sa.Text(), nullable=False),
        sa.Column("replayed", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("trial_id", "seq", name="uq_decisions_trial_seq"),
    )
    op.create_index("ix_decisions_trial_id", "decisions", ["trial_id"])
    for table, renames in RENAMED.items():
        for old, new in renames.items():
            rename = sa.text(f"UPDATE {table} SET state = :new WHERE state = :old")
            op.execute(rename.bindparams(old=old, new=new))


def downgrade() -> None:
    for table, renames in RENAMED.items():
        for old, new in renames.items():
            restore = sa.text(f"UPDATE {table} SET state = :old WHERE state = :new")
            op.execute(restore.bindparams(old=old, new=new))
    op.drop_index("ix_decisions_trial_id", table_name="decisions")
    op.drop_table("decisions")
    op.drop_column("trials", "source_checkpoint_json")  # SQLite ≥ 3.35 drops columns in place
    op.drop_column("experiments", "requested")
    op.drop_column("experiments", "gc_policy_json")
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint("fk_experiments_parent_id", "experiments", type_="foreignkey")
    op.drop_column("experiments", "parent_id")
