"""How a stored row becomes the document a reader gets (``govray.queries.views``)."""

from __future__ import annotations

import json
from typing import Any

from govray.core.errors import TrackingError
from govray.queries.ledger_rows import statement_of
from govray.queries.views import (
    AttestationView,
    CheckpointView,
    ExperimentView,
    MetricView,
    ModelVersionView,
    TrialView,
)
from govray.tracking.tables import (
    AttestationRecord,
    CheckpointRecord,
    Experiment,
    Metric,
    ModelVersion,
    TrialRecord,
)


def json_object(text: str) -> dict[str, Any]:
    """A stored JSON document, as an object (a scalar or list is wrapped as ``{"value": ...}``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise TrackingError(f"the tracking store holds a malformed JSON document: {error}") from None
    return value if isinstance(value, dict) else {"value": value}


def experiment_view(experiment: Experiment, trials: int) -> ExperimentView:
    """An experiment row as its document, with its number of trials."""
    fields = experiment.model_dump(exclude={"config_json", "gc_policy_json", "requested"})
    return ExperimentView(**fields, trials=trials)


def trial_view(trial: TrialRecord) -> TrialView:
    """A trial row as its document."""
    return TrialView(
        id=trial.id or 0,
        experiment_id=trial.experiment_id,
        state=trial.state,
        seed=trial.seed,
        hyperparameters=json_object(trial.hparams_json),
        ray_run_name=trial.ray_run_name,
        cloned_from=trial.cloned_from,
        kind=trial.kind,
        replay_of=trial.replay_of,
        created_at=trial.created_at,
        ended_at=trial.ended_at,
    )


def metric_view(metric: Metric) -> MetricView:
    """A metric row as its document."""
    return MetricView(**metric.model_dump(exclude={"id", "trial_id"}))


def checkpoint_view(checkpoint: CheckpointRecord) -> CheckpointView:
    """A checkpoint row as its document."""
    return CheckpointView(**checkpoint.model_dump(exclude={"metrics_json", "deleted_at"}))


def version_view(version: ModelVersion) -> ModelVersionView:
    """A model version row as its document."""
    return ModelVersionView(
        **version.model_dump(exclude={"tags_json", "removed_adapters_json", "excluded_corpora_json"}),
        tags=json_object(version.tags_json),
        removed_adapters=json.loads(version.removed_adapters_json),
        excluded_corpora=json.loads(version.excluded_corpora_json),
    )


def attestation_view(record: AttestationRecord) -> AttestationView:
    """An attestation row as its document (its predicate type read from the envelope)."""
    return AttestationView(
        id=record.id or 0,
        checkpoint_id=record.checkpoint_id,
        model_version_id=record.model_version_id,
        subject_digest=record.subject_digest,
        predicate_type=statement_of(record.envelope_json).get("predicateType"),
        created_at=record.created_at,
    )
