"""Model registry: a version's own model directory (a version made by removing an adapter has
one), the version it was derived from, the adapters it lacks and the corpora that excludes, and
a description.

Revision ID: 0004_registry
Revises: 0003_lifecycle
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_registry"
down_revision: str | None = "0003_lifecycle"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":  # ADD COLUMN with REFERENCES; no table copy
        op.execute("ALTER TABLE model_versions ADD COLUMN parent_id INTEGER REFERENCES model_versions (id)")
    else:
        op.add_column("model_versions", sa.Column("parent_id", sa.Integer(), nullable=True))
        op.create_foreign_key(
            "fk_model_versions_parent_id", "model_versions", "model_versions", ["parent_id"], ["id"]
        )
    op.add_column("model_versions", sa.Column("path", sa.Text(), nullable=True))
    op.add_column("model_versions", sa.Column("description", sa.String(), nullable=False, server_default=""))
    for column in ("removed_adapters_json", "excluded_corpora_json"):
        op.add_column("model_versions", sa.Column(column, sa.Text(), nullable=False, server_default="[]"))
    op.create_index("ix_attestations_model_version_id", "attestations", ["model_version_id"])
    op.create_index("ix_attestations_checkpoint_id", "attestations", ["checkpoint_id"])


def downgrade() -> None:
    op.drop_index("ix_attestations_checkpoint_id", table_name="attestations")
    op.drop_index("ix_attestations_model_version_id", table_name="attestations")
    for column in ("excluded_corpora_json", "removed_adapters_json", "description", "path"):
        op.drop_column("model_versions", column)
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint("fk_model_versions_parent_id", "model_versions", type_="foreignkey")
    op.drop_column("model_versions", "parent_id")
