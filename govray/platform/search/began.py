"""The record a search begins with, kept beside its Ray Tune state.

When a search begins, its reproducibility record — the code snapshot every trial imports, the
corpora's fingerprints, the torch threads every trial trains with, the environment — is written to
``STORAGE/searches/NAME-searchID.json``, its sha256 to the audit log (and every trial's row keeps
the record). A search resumed later,
by ``govray search`` again or by ``govray resume``, reads it back: its trials import the code it
began with (whatever the working directory holds now), train on the threads it began with, and a
corpus whose bytes changed since is refused.

Example::

    use_search_code(config, store)          # before the policy check imports the trial
    began = began_record(store, storage, config, experiment)
"""

from __future__ import annotations

import json
from pathlib import Path

from govray.config.experiment import ExperimentConfig
from govray.core.canonical import file_sha256
from govray.core.storage import Storage, open_storage
from govray.data.shards import ShardManifest
from govray.platform.run.plan import code_directory
from govray.platform.run.preflight import existing_experiment
from govray.platform.search.tune_trial import SearchError
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Experiment
from govray.train.reproduce.record import ReproducibilityRecord
from govray.train.reproduce.snapshots import use_recorded_code


def search_path(storage: Storage, config: ExperimentConfig, experiment: Experiment) -> Path:
    """Where Ray Tune keeps the search's state (in this node's cache, for object storage)."""
    return storage.root / "tune" / f"{config.name}-search{experiment.id}"


def search_record_path(storage: Storage, config: ExperimentConfig, experiment: Experiment) -> Path:
    """``STORAGE/searches/NAME-searchID.json``: the record the search began with."""
    return storage.root / "searches" / f"{search_path(storage, config, experiment).name}.json"


def search_began(config: ExperimentConfig, experiment: Experiment) -> bool:
    """Whether ``experiment`` ran a search whose Ray Tune state is kept (a resume resumes it)."""
    from ray.tune import Tuner

    storage = open_storage(config.storage_path)
    location = storage.ray_path(search_path(storage, config, experiment))
    return Tuner.can_restore(location, storage_filesystem=storage.filesystem)


def keep_record(
    store: TrackingStore,
    storage: Storage,
    config: ExperimentConfig,
    experiment: Experiment,
    record: ReproducibilityRecord,
) -> None:
    """Write the record a search begins with, and its code snapshot, to storage, and its sha256
    to the audit log (``search.began``), which a resume checks the file against."""
    path = search_record_path(storage, config, experiment)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(record.model_dump_json(indent=1))
    storage.upload(path, code_directory(storage, record.code))
    AuditLog(store).append(
        AuditEventType.SEARCH_BEGAN,
        {"search": path.stem, "record_sha256": file_sha256(path), "code": record.code.digest},
        experiment_id=experiment.id,
    )


def began_record(
    store: TrackingStore, storage: Storage, config: ExperimentConfig, experiment: Experiment
) -> ReproducibilityRecord | None:
    """The record the experiment's search began with — the file the audit log's ``search.began``
    names by its sha256, refused if missing or changed — with its trial code imported from here
    on from its verified snapshot (a changed or missing file is refused, named); None before the
    search began."""
    path = search_record_path(storage, config, experiment)
    began = [
        event
        for event in AuditLog(store).list(experiment.id, AuditEventType.SEARCH_BEGAN)
        if json.loads(event.payload_json).get("search") == path.stem
    ]
    if not began:
        return None
    if not storage.fetch(path) or file_sha256(path) != json.loads(began[-1].payload_json)["record_sha256"]:
        raise SearchError(
            f"{path}: the record search {path.stem} began with is missing or changed since (the "
            "audit log holds its sha256): its trials cannot go on as they began"
        )
    record = ReproducibilityRecord.model_validate_json(path.read_text())
    use_recorded_code(record.code, code_directory(storage, record.code), storage)
    return record


def use_search_code(config: ExperimentConfig, store: TrackingStore) -> None:
    """Before a resumed search's policy check (which builds the trial): import the trial from the
    code the experiment's search began with, when one began."""
    experiment = existing_experiment(config, store)
    if experiment is not None:
        began_record(store, open_storage(config.storage_path), config, experiment)


def check_corpora(record: ReproducibilityRecord, manifest: ShardManifest) -> None:
    """Refuse to go on with a search on corpora whose bytes changed since it began."""
    began = {corpus.corpus_id: corpus.fingerprint for corpus in record.corpora}
    for corpus in manifest.corpora:
        if began.get(corpus.corpus_id, corpus.fingerprint) != corpus.fingerprint:
            raise SearchError(
                f"corpus '{corpus.corpus_id}' changed since the search began (fingerprint "
                f"{began[corpus.corpus_id][:16]}… → {corpus.fingerprint[:16]}…): its trials would go on "
                "on other bytes than they began with; start a new experiment"
            )
