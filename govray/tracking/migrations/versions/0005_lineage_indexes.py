"""Lineage queries: an index on the ledger by (corpus, trial, checkpoint), so "which checkpoints did
corpus C reach" pages through an index instead of sorting every row of the corpus.

Revision ID: 0005_lineage_indexes
Revises: 0004_registry
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005_lineage_indexes"
down_revision: str | None = "0004_registry"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_ledger_rows_corpus_trial", "ledger_rows", ["corpus_id", "trial_id", "checkpoint_id"])


def downgrade() -> None:
    op.drop_index("ix_ledger_rows_corpus_trial", table_name="ledger_rows")
