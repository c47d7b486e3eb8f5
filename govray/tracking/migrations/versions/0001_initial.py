"""The first tracking schema: experiments, trials, metrics, corpora, checkpoints, registry,
attestations, ledger rows and the audit log.

Written by hand to equal ``govray.tracking.tables``; ``tests/test_tracking.py`` compares the
migrated database with the SQLModel metadata so the two cannot drift.

Revision ID: 0001_initial
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_initial"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _id() -> sa.Column[int]:
    return sa.Column("id", sa.Integer(), primary_key=True, nullable=False)


def _timestamp(name: str, nullable: bool = False) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "experiments",
        _id(),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("description", sa.String(), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("config_digest", sa.String(), nullable=False),
        sa.Column("policy_digest", sa.String(), nullable=True),
        sa.Column("storage_path", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        _timestamp("created_at"),
        _timestamp("updated_at"),
    )
    op.create_index("ix_experiments_name", "experiments", ["name"])

    op.create_table(
        "registered_models",
        sa.Column("name", sa.String(), primary_key=True, nullable=False),
        sa.Column("description", sa.String(), nullable=False),
        _timestamp("created_at"),
    )

    op.create_table(
        "audit_events",
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=False, nullable=False),
        sa.Column("at", sa.String(), nullable=False),
        sa.Column("event_type", sa.String(), nullable=False),
        sa.Column("experiment_id", sa.Integer(), nullable=True),
        sa.Column("actor", sa.String(), nullable=False),
        sa.Column("payload_json", sa.Text(), nullable=False),
        sa.Column("prev_hash", sa.String(), nullable=False),
        sa.Column("hash", sa.String(), nullable=False),
    )
    op.create_index("ix_audit_events_event_type", "audit_events", ["event_type"])
    op.create_index("ix_audit_events_experiment_id", "audit_events", ["experiment_id"])

    op.create_table(
        "trials",
        _id(),
        sa.Column("experiment_id", sa.Integer(), sa.ForeignKey("experiments.id"), nullable=False),
        sa.Column("hparams_json", sa.Text(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("ray_run_name", sa.String(), nullable=True),
        sa.Column("cloned_from", sa.Integer(), sa.ForeignKey("trials.id"), nullable=True),
        _timestamp("created_at"),
        _timestamp("ended_at", nullable=True),
    )
    op.create_index("ix_trials_experiment_id", "trials", ["experiment_id"])

    op.create_table(
        "corpora",
        _id(),
        sa.Column("experiment_id", sa.Integer(), sa.ForeignKey("experiments.id"), nullable=False),
        sa.Column("corpus_id", sa.String(), nullable=False),
        sa.Column("role", sa.String(), nullable=False),
        sa.Column("fingerprint", sa.String(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("train_rows", sa.Integer(), nullable=False),
        sa.Column("holdout_rows", sa.Integer(), nullable=False),
        sa.Column("credential_json", sa.Text(), nullable=False),
        sa.Column("route_counts_json", sa.Text(), nullable=False),
        _timestamp("created_at"),
        sa.UniqueConstraint("experiment_id", "corpus_id", name="uq_corpora_experiment_corpus"),
    )
    op.create_index("ix_corpora_corpus_id", "corpora", ["corpus_id"])

    op.create_table(
        "metrics",
        _id(),
        sa.Column("trial_id", sa.Integer(), sa.ForeignKey("trials.id"), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        _timestamp("recorded_at"),
    )
    op.create_index("ix_metrics_trial_name_step", "metrics", ["trial_id", "name", "step"])

    op.create_table(
        "checkpoints",
        _id(),
        sa.Column("trial_id", sa.Integer(), sa.ForeignKey("trials.id"), nullable=False),
        sa.Column("uuid", sa.String(), nullable=False),
        sa.Column("path", sa.String(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("manifest_digest", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("metrics_json", sa.Text(), nullable=False),
        _timestamp("created_at"),
        _timestamp("deleted_at", nullable=True),
        sa.UniqueConstraint("uuid", name="uq_checkpoints_uuid"),
    )
    op.create_index("ix_checkpoints_trial_id", "checkpoints", ["trial_id"])

    op.create_table(
        "ledger_rows",
        _id(),
        sa.Column("trial_id", sa.Integer(), sa.ForeignKey("trials.id"), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), sa.ForeignKey("checkpoints.id"), nullable=True),
        sa.Column("corpus_id", sa.String(), nullable=False),
        sa.Column("parameter", sa.String(), nullable=False),
        sa.Column("layer_index", sa.Integer(), nullable=True),
        sa.Column("examples", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
    )
    op.create_index("ix_ledger_rows_corpus_parameter", "ledger_rows", ["corpus_id", "parameter"])
    op.create_index("ix_ledger_rows_trial_parameter", "ledger_rows", ["trial_id", "parameter"])

    op.create_table(
        "model_versions",
        _id(),
        sa.Column("model_name", sa.String(), sa.ForeignKey("registered_models.name"), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), sa.ForeignKey("checkpoints.id"), nullable=False),
        sa.Column("tags_json", sa.Text(), nullable=False),
        _timestamp("created_at"),
        sa.UniqueConstraint("model_name", "version", name="uq_model_versions_name_version"),
    )
    op.create_index("ix_model_versions_model_name", "model_versions", ["model_name"])

    op.create_table(
        "attestations",
        _id(),
        sa.Column("checkpoint_id", sa.Integer(), sa.ForeignKey("checkpoints.id"), nullable=True),
        sa.Column("model_version_id", sa.Integer(), sa.ForeignKey("model_versions.id"), nullable=True),
        sa.Column("subject_digest", sa.String(), nullable=False),
        sa.Column("envelope_json", sa.Text(), nullable=False),
        _timestamp("created_at"),
    )
    op.create_index("ix_attestations_subject_digest", "attestations", ["subject_digest"])


def downgrade() -> None:
    for table in (
        "attestations",
        "model_versions",
        "ledger_rows",
        "checkpoints",
        "metrics",
        "corpora",
        "trials",
        "audit_events",
        "registered_models",
        "experiments",
    ):
        op.drop_table(table)
