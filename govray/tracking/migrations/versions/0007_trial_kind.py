"""Replays are marked: a trial's kind (``original`` or ``replay``) and the trial a replay reruns.
Existing trials were all started as originals, except that a replay could not be told apart:
they become ``original`` (the server default), as they were recorded.

Revision ID: 0007_trial_kind
Revises: 0006_bigint_counts_and_index
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_trial_kind"
down_revision: str | None = "0006_bigint_counts_and_index"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("trials", sa.Column("kind", sa.String(), nullable=False, server_default="original"))
    # Plain ADD COLUMN (SQLite accepts a REFERENCES clause there): a batch copy of `trials` would
    # drop a table other tables' foreign keys point at.
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE trials ADD COLUMN replay_of INTEGER REFERENCES trials (id)")
    else:
        op.add_column("trials", sa.Column("replay_of", sa.Integer(), nullable=True))
        op.create_foreign_key("fk_trials_replay_of", "trials", "trials", ["replay_of"], ["id"])


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint("fk_trials_replay_of", "trials", type_="foreignkey")
    op.drop_column("trials", "replay_of")  # SQLite ≥ 3.35 drops columns in place
    op.drop_column("trials", "kind")
