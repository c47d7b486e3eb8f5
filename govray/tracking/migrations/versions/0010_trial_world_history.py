"""A trial's world-size history: ``[[from_step, workers], ...]``, as its signed checkpoints carry it
(``CheckpointState.world_history``), recorded by the driver as the trial's reports bring it. An
elastic run's resizes and a resume on another world size change it. Trials recorded before have
none (NULL: the configured workers throughout, or unknown).

Revision ID: 0010_trial_world_history
Revises: 0009_ledger_change_indexes
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_trial_world_history"
down_revision: str | None = "0009_ledger_change_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("trials", sa.Column("world_history_json", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("trials", "world_history_json")
