"""A mirror of govray's tracking store in an MLflow 3 tracking server, for teams that browse MLflow.

With ``tracking.mlflow: {uri, experiment_prefix}`` in the experiment file, the driver (never a
worker) copies to MLflow what govray's own store holds:

- the experiment, as the MLflow experiment ``PREFIX + NAME`` (tags: govray id, config and policy
  digests);
- each trial, as a run (tag ``govray.trial_id``) with its hyperparameters, the experiment's
  ``seed`` and its ``trial_seed`` as params, every stored metric at its step, and its state as the
  run's status;
- each registered version of the experiment's checkpoints, as a version of the MLflow registered
  model of the same name (tag ``govray.version``), its tags carrying the sha256 of the provenance
  and coverage envelopes and of the base model file; the coverage matrix, the policy and both
  envelopes are artifacts of the trial's run under ``govray-models/NAME/VERSION/``.

The mirror only reads govray's store, and every sync copies what MLflow still lacks (a run's
cursor is its tag ``govray.mirrored_metric_id``), so nothing is lost and nothing is sent twice: a
server that is down makes a sync log one warning and return; the next sync catches up. During a
run a background thread syncs every few seconds (training never waits on it); the run's end, each
registration and ``govray experiment mlflow-sync`` sync once more.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import yaml

from govray.config.experiment import ExperimentConfig, MlflowConfig
from govray.core.errors import ConfigError
from govray.core.settings import operator_trust
from govray.platform.registry.versions import (
    RegisteredVersion,
    envelope_sha256,
    model_signature_of,
    version_attestations,
    versions,
)
from govray.provenance.locations import run_spec_of
from govray.provenance.predicates import coverage_matrix
from govray.provenance.statement_types import COVERAGE_TYPE, PROVENANCE_TYPE, statement_type
from govray.tracking.registry import list_models
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Experiment, TrialRecord, TrialState
from govray.train.checkpoints.files import MODEL_FILE, load_checkpoint
from govray.train.step.ledger import Ledger

log = logging.getLogger(__name__)

TRIAL_TAG = "govray.trial_id"
CURSOR_TAG = "govray.mirrored_metric_id"
VERSION_TAG = "govray.version"
RUN_STATUS = {
    TrialState.PENDING.value: "SCHEDULED",
    TrialState.ACTIVE.value: "RUNNING",
    TrialState.COMPLETED.value: "FINISHED",
    TrialState.ERRORED.value: "FAILED",
}  # paused and killed: KILLED
_BATCH = 1000  # MLflow's log_batch limit on metrics per call


class MlflowMirror:
    """Copies one experiment's rows from govray's store to an MLflow tracking server."""

    def __init__(self, store: TrackingStore, settings: MlflowConfig) -> None:
        # Fail fast when the server is down (MLflow's client retries for minutes by default);
        # a user's own settings win.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        try:  # 2 s to import: only where a mirror is configured
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError(
                "tracking.mlflow needs MLflow's client: pip install -c constraints.txt 'govray[mlflow]'"
            ) from None

        self.store = store
        self.settings = settings
        self.client = MlflowClient(tracking_uri=settings.uri, registry_uri=settings.uri)
        self._warned = False

    @classmethod
    def of(cls, store: TrackingStore, experiment: Experiment) -> MlflowMirror | None:
        """The experiment's mirror, if its (recorded) config names one."""
        settings = ExperimentConfig.model_validate_json(experiment.config_json).tracking.mlflow
        return cls(store, settings) if settings is not None else None

    def sync(self, experiment_id: int) -> bool:
        """Copy what MLflow lacks of the experiment; False (one warning per outage) if the server
        cannot be reached. Never raises for the server's sake."""
        try:
            if not self._healthy():
                raise ConnectionError(f"{self.settings.uri}/health does not answer")
            self._sync(experiment_id)
        except Exception as error:  # any failure of the mirror must leave training alone
            if not self._warned:
                log.warning(
                    "MLflow mirror at %s failed (%s); govray's tracking store keeps everything and "
                    "the next sync catches up",
                    self.settings.uri,
                    error,
                )
            self._warned = True
            return False
        self._warned = False
        return True

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.settings.uri}/health", timeout=3) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _sync(self, experiment_id: int) -> None:
        experiment = self.store.get_experiment(experiment_id)
        mlflow_experiment = self._experiment(experiment)
        seed = json.loads(experiment.config_json).get("seed")
        runs = {}
        for trial in self.store.list_trials(experiment_id):
            assert trial.id is not None
            runs[trial.id] = self._run(mlflow_experiment, trial, seed)
        for version in self._versions(set(runs)):
            self._version(version, runs[version.checkpoint.trial_id])

    def _experiment(self, experiment: Experiment) -> str:
        name = f"{self.settings.experiment_prefix}{experiment.name}"
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        tags = {"govray.experiment_id": str(experiment.id), "govray.config_sha256": experiment.config_digest}
        if experiment.policy_digest:
            tags["govray.policy_sha256"] = experiment.policy_digest
        return str(self.client.create_experiment(name, tags=tags))

    def _run(self, experiment_id: str, trial: TrialRecord, seed: Any) -> str:
        """The trial's run (created once: hyperparameters, the experiment's ``seed`` and the trial's
        own ``trial_seed`` as params), its metrics after the cursor, its status."""
        from mlflow.entities import Metric, Param

        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{TRIAL_TAG}` = '{trial.id}'")
        if found:
            run_id: str = found[0].info.run_id
            cursor = int(found[0].data.tags.get(CURSOR_TAG, "0"))
            mirrored_status = found[0].info.status
        else:
            run = self.client.create_run(
                experiment_id,
                run_name=trial.ray_run_name or f"trial-{trial.id}",
                start_time=_millis(trial.created_at),
                tags={TRIAL_TAG: str(trial.id), "govray.kind": trial.kind, CURSOR_TAG: "0"},
            )
            run_id, cursor, mirrored_status = run.info.run_id, 0, run.info.status
            params = {**_flat(json.loads(trial.hparams_json)), "seed": seed, "trial_seed": trial.seed}
            self.client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())])
        assert trial.id is not None
        # In recording order: the cursor is the newest row sent (name order would resend rows).
        new = sorted(self.store.metrics(trial.id, after_id=cursor), key=lambda m: m.id or 0)
        for start in range(0, len(new), _BATCH):
            chunk = new[start : start + _BATCH]
            metrics = [Metric(m.name, m.value, _millis(m.recorded_at), m.step) for m in chunk]
            self.client.log_batch(run_id, metrics=metrics)
            self.client.set_tag(run_id, CURSOR_TAG, str(chunk[-1].id))
        status = RUN_STATUS.get(trial.state, "KILLED")
        if status != mirrored_status and status in ("SCHEDULED", "RUNNING"):
            self.client.update_run(run_id, status=status)
        elif status != mirrored_status:
            end = _millis(trial.ended_at) if trial.ended_at is not None else None
            self.client.set_terminated(run_id, status=status, end_time=end)
        return run_id

    def _versions(self, trial_ids: set[int]) -> Iterator[RegisteredVersion]:
        for model, _ in list_models(self.store):
            for version in versions(self.store, model.name):
                if version.checkpoint.trial_id in trial_ids:
                    yield version

    def _version(self, version: RegisteredVersion, run_id: str) -> None:
        name = version.model
        if self.client.search_registered_models(filter_string=f"name = '{name}'"):
            mirrored = self.client.search_model_versions(f"name = '{name}'")
            if any(v.tags.get(VERSION_TAG) == str(version.version) for v in mirrored):
                return
        else:
            self.client.create_registered_model(name, tags={"govray.model": name})
        folder = f"govray-models/{name}/{version.version}"
        kinds = {PROVENANCE_TYPE: "provenance", COVERAGE_TYPE: "coverage"}
        envelopes = {
            kinds[kind]: record
            for record in version_attestations(self.store, version)
            if (kind := statement_type(record.envelope_json)) in kinds
        }
        tags = {
            VERSION_TAG: str(version.version),
            "govray.uri": version.uri,
            "govray.checkpoint": version.checkpoint.uuid,
            "govray.removed_adapters": ",".join(version.removed_adapters),
            "govray.excluded_corpora": ",".join(version.excluded_corpora),
            "govray.model_signature": str(model_signature_of(version)),
            **{f"govray.{kind}_envelope_sha256": envelope_sha256(r) for kind, r in envelopes.items()},
        }
        if "provenance" in envelopes:
            tags["govray.model_sha256"] = envelopes["provenance"].subject_digest
        for kind, record in envelopes.items():
            self.client.log_text(run_id, record.envelope_json, f"{folder}/{kind}.dsse.json")
        spec = run_spec_of(version.directory)
        state = load_checkpoint(version.directory, operator_trust()).state
        matrix = coverage_matrix(Ledger.from_json(state.ledger), spec.routing)
        self.client.log_dict(run_id, matrix, f"{folder}/coverage-matrix.json")
        policy = spec.policy.model_dump(mode="json", exclude_none=True)
        self.client.log_text(run_id, yaml.safe_dump(policy, sort_keys=False), f"{folder}/policy.yaml")
        self.client.create_model_version(
            name,
            source=f"runs:/{run_id}/{folder}",
            run_id=run_id,
            tags=tags,
            description=version.record.description or f"govray {version.ref} ({MODEL_FILE} and adapters)",
        )


class BackgroundSync:
    """Syncs an experiment's mirror every ``interval`` seconds on a daemon thread of the driver,
    until ``stop`` (which syncs once more)."""

    def __init__(self, mirror: MlflowMirror, experiment_id: int, interval: float = 5.0) -> None:
        self.mirror = mirror
        self.experiment_id = experiment_id
        self.interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="govray-mlflow-mirror", daemon=True)

    def __enter__(self) -> BackgroundSync:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._thread.join()
        self.mirror.sync(self.experiment_id)

    def _loop(self) -> None:
        while not self._stopped.wait(self.interval):
            self.mirror.sync(self.experiment_id)


@contextmanager
def mirrored(store: TrackingStore, settings: MlflowConfig | None, experiment_id: int) -> Iterator[None]:
    """While the block runs, sync the experiment to MLflow in the background (when ``settings``
    names a server); once more at its end, whatever the outcome."""
    if settings is None:
        yield
        return
    with BackgroundSync(MlflowMirror(store, settings), experiment_id):
        yield


def sync_experiment(store: TrackingStore, experiment_id: int) -> bool | None:
    """Sync the experiment's mirror once: None when its config names no mirror."""
    mirror = MlflowMirror.of(store, store.get_experiment(experiment_id))
    return mirror.sync(experiment_id) if mirror is not None else None


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _millis(moment: Any) -> int:
    return int(moment.timestamp() * 1000)
