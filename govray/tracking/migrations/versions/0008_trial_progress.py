"""A trial's progress is state, not inferred from metric rows: the last step it reported and why
it stopped early (``pause``, ``kill``, ``early_stop``). Existing trials get both from the metric
rows that carried them before (``examples`` in every report; ``stopped_on_request`` 1 = pause,
2 = kill; ``early_stopped``).

Revision ID: 0008_trial_progress
Revises: 0007_trial_kind
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_trial_progress"
down_revision: str | None = "0007_trial_kind"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("trials", sa.Column("last_step", sa.Integer(), nullable=True))
    op.add_column("trials", sa.Column("stop_reason", sa.String(), nullable=True))
    op.execute(
        "UPDATE trials SET last_step = (SELECT MAX(metrics.step) FROM metrics "
        "WHERE metrics.trial_id = trials.id AND metrics.name = 'examples')"
    )
    op.execute(
        "UPDATE trials SET stop_reason = (SELECT CASE WHEN MAX(metrics.value) = 1 THEN 'pause' "
        "ELSE 'kill' END FROM metrics WHERE metrics.trial_id = trials.id "
        "AND metrics.name = 'stopped_on_request' AND metrics.step = trials.last_step) "
        "WHERE EXISTS (SELECT 1 FROM metrics WHERE metrics.trial_id = trials.id "
        "AND metrics.name = 'stopped_on_request' AND metrics.step = trials.last_step)"
    )
    op.execute(
        "UPDATE trials SET stop_reason = 'early_stop' WHERE EXISTS (SELECT 1 FROM metrics "
        "WHERE metrics.trial_id = trials.id AND metrics.name = 'early_stopped')"
    )


def downgrade() -> None:
    op.drop_column("trials", "stop_reason")
    op.drop_column("trials", "last_step")
