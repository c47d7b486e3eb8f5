"""Live lineage: indexes on the ledger by (corpus, id) and (trial, id), so the Serve app's cache
finds the newest ledger row of a corpus or a trial with one index seek (what changed since an
answer was cached) instead of counting every row of the corpus after each commit.

Revision ID: 0009_ledger_change_indexes
Revises: 0008_trial_progress
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0009_ledger_change_indexes"
down_revision: str | None = "0008_trial_progress"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_ledger_rows_corpus_id", "ledger_rows", ["corpus_id", "id"])
    op.create_index("ix_ledger_rows_trial_id", "ledger_rows", ["trial_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_ledger_rows_trial_id", table_name="ledger_rows")
    op.drop_index("ix_ledger_rows_corpus_id", table_name="ledger_rows")
