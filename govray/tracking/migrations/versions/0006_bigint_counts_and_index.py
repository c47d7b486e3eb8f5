"""Counts that can pass 2**31 become BIGINT on PostgreSQL (a ledger's examples and tokens, a
corpus's rows), whose INTEGER is 32-bit; SQLite's INTEGER is 64-bit already and keeps its tables.
And model versions are indexed by checkpoint: the lineage queries (a corpus's influence, a row's
reach) look up the versions made from a set of checkpoints.

Revision ID: 0006_bigint_counts_and_index
Revises: 0005_lineage_indexes
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_bigint_counts_and_index"
down_revision: str | None = "0005_lineage_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COUNTS = {"ledger_rows": ("examples", "tokens"), "corpora": ("rows", "train_rows", "holdout_rows")}


def _retype(old: sa.types.TypeEngine[int], new: sa.types.TypeEngine[int]) -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    for table, columns in COUNTS.items():
        for column in columns:
            op.alter_column(table, column, type_=new, existing_type=old, existing_nullable=False)


def upgrade() -> None:
    _retype(sa.Integer(), sa.BigInteger())
    op.create_index("ix_model_versions_checkpoint_id", "model_versions", ["checkpoint_id"])


def downgrade() -> None:
    op.drop_index("ix_model_versions_checkpoint_id", table_name="model_versions")
    _retype(sa.BigInteger(), sa.Integer())
