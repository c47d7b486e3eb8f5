"""The tracking schema: experiments, trials, metrics, corpora, checkpoints, decisions, the model
registry and its attestations, ledger rows and the audit log.

The one migration of govray 1.0 (the pre-release ones were squashed into it; its revision id is
new, so a pre-release store, whose first revision was ``0001_initial``, is refused, not taken for
this schema). It equals
``govray.tracking.tables``: ``tests/test_tracking.py`` compares the migrated database with the
SQLModel metadata, so the two cannot drift. A later schema change is a new migration revising
this one, with its own data migration test; a store at a revision this govray does not know is
refused (``govray.tracking.database.upgrade``).

Revision ID: 0001_release
Revises:
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_release"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("seq", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("at", sa.String(), nullable=False),
        sa.Column("event_type", sa.String(), nullable=False),
        sa.Column("experiment_id", sa.Integer(), nullable=True),
        sa.Column("actor", sa.String(), nullable=False),
        sa.Column("payload_json", sa.Text(), nullable=False),
        sa.Column("prev_hash", sa.String(), nullable=False),
        sa.Column("hash", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    op.create_index(op.f("ix_audit_events_event_type"), "audit_events", ["event_type"], unique=False)
    op.create_index(op.f("ix_audit_events_experiment_id"), "audit_events", ["experiment_id"], unique=False)
    op.create_table(
        "experiments",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("description", sa.String(), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("config_digest", sa.String(), nullable=False),
        sa.Column("policy_digest", sa.String(), nullable=True),
        sa.Column("storage_path", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("gc_policy_json", sa.Text(), nullable=True),
        sa.Column("requested", sa.String(), nullable=True),
        sa.ForeignKeyConstraint(
            ["parent_id"],
            ["experiments.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_experiments_name"), "experiments", ["name"], unique=False)
    op.create_table(
        "registered_models",
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("description", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "corpora",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("corpus_id", sa.String(), nullable=False),
        sa.Column("role", sa.String(), nullable=False),
        sa.Column("fingerprint", sa.String(), nullable=False),
        sa.Column("rows", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("train_rows", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("holdout_rows", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("credential_json", sa.Text(), nullable=False),
        sa.Column("route_counts_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["experiment_id"],
            ["experiments.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("experiment_id", "corpus_id", name="uq_corpora_experiment_corpus"),
    )
    op.create_index(op.f("ix_corpora_corpus_id"), "corpora", ["corpus_id"], unique=False)
    op.create_table(
        "trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("hparams_json", sa.Text(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("ray_run_name", sa.String(), nullable=True),
        sa.Column("cloned_from", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reproducibility_json", sa.Text(), nullable=True),
        sa.Column("source_checkpoint_json", sa.Text(), nullable=True),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("replay_of", sa.Integer(), nullable=True),
        sa.Column("last_step", sa.Integer(), nullable=True),
        sa.Column("stop_reason", sa.String(), nullable=True),
        sa.Column("world_history_json", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["cloned_from"],
            ["trials.id"],
        ),
        sa.ForeignKeyConstraint(
            ["experiment_id"],
            ["experiments.id"],
        ),
        sa.ForeignKeyConstraint(
            ["replay_of"],
            ["trials.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_trials_experiment_id"), "trials", ["experiment_id"], unique=False)
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("uuid", sa.String(), nullable=False),
        sa.Column("path", sa.String(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("manifest_digest", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("metrics_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["trial_id"],
            ["trials.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("uuid", name="uq_checkpoints_uuid"),
    )
    op.create_index(op.f("ix_checkpoints_trial_id"), "checkpoints", ["trial_id"], unique=False)
    op.create_table(
        "decisions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("payload_json", sa.Text(), nullable=False),
        sa.Column("replayed", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["trial_id"],
            ["trials.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("trial_id", "seq", name="uq_decisions_trial_seq"),
    )
    op.create_index(op.f("ix_decisions_trial_id"), "decisions", ["trial_id"], unique=False)
    op.create_table(
        "metrics",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["trial_id"],
            ["trials.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_metrics_trial_name_step", "metrics", ["trial_id", "name", "step"], unique=False)
    op.create_table(
        "ledger_rows",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("corpus_id", sa.String(), nullable=False),
        sa.Column("parameter", sa.String(), nullable=False),
        sa.Column("layer_index", sa.Integer(), nullable=True),
        sa.Column("examples", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("tokens", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
        ),
        sa.ForeignKeyConstraint(
            ["trial_id"],
            ["trials.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_ledger_rows_corpus_id", "ledger_rows", ["corpus_id", "id"], unique=False)
    op.create_index(
        "ix_ledger_rows_corpus_parameter", "ledger_rows", ["corpus_id", "parameter"], unique=False
    )
    op.create_index(
        "ix_ledger_rows_corpus_trial", "ledger_rows", ["corpus_id", "trial_id", "checkpoint_id"], unique=False
    )
    op.create_index("ix_ledger_rows_trial_id", "ledger_rows", ["trial_id", "id"], unique=False)
    op.create_index("ix_ledger_rows_trial_parameter", "ledger_rows", ["trial_id", "parameter"], unique=False)
    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_name", sa.String(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("tags_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("path", sa.Text(), nullable=True),
        sa.Column("description", sa.String(), server_default="", nullable=False),
        sa.Column("removed_adapters_json", sa.Text(), server_default="[]", nullable=False),
        sa.Column("excluded_corpora_json", sa.Text(), server_default="[]", nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
        ),
        sa.ForeignKeyConstraint(
            ["model_name"],
            ["registered_models.name"],
        ),
        sa.ForeignKeyConstraint(
            ["parent_id"],
            ["model_versions.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("model_name", "version", name="uq_model_versions_name_version"),
    )
    op.create_index(
        op.f("ix_model_versions_checkpoint_id"), "model_versions", ["checkpoint_id"], unique=False
    )
    op.create_index(op.f("ix_model_versions_model_name"), "model_versions", ["model_name"], unique=False)
    op.create_table(
        "attestations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("model_version_id", sa.Integer(), nullable=True),
        sa.Column("subject_digest", sa.String(), nullable=False),
        sa.Column("envelope_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
        ),
        sa.ForeignKeyConstraint(
            ["model_version_id"],
            ["model_versions.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_attestations_checkpoint_id"), "attestations", ["checkpoint_id"], unique=False)
    op.create_index(
        op.f("ix_attestations_model_version_id"), "attestations", ["model_version_id"], unique=False
    )
    op.create_index(op.f("ix_attestations_subject_digest"), "attestations", ["subject_digest"], unique=False)


def downgrade() -> None:
    op.drop_table("attestations")
    op.drop_table("model_versions")
    op.drop_table("ledger_rows")
    op.drop_table("metrics")
    op.drop_table("decisions")
    op.drop_table("checkpoints")
    op.drop_table("trials")
    op.drop_table("corpora")
    op.drop_table("registered_models")
    op.drop_table("experiments")
    op.drop_table("audit_events")
