"""The model registry: named models, numbered versions of checkpoints, tags — and a version made
by removing an adapter, with its own attestation naming the corpora that leaves out.

>>> version = register(store, "digits", Path("storage/ray/RUN/checkpoint_000002"))  # doctest: +SKIP
>>> resolve(store, "digits:1").directory                                              # doctest: +SKIP
>>> clean = remove_adapter(store, "digits:1", "pii")  # -> digits:2, without adapter-pii  # doctest: +SKIP
>>> clean.excluded_corpora                                                             # doctest: +SKIP
('digits-writers',)

A version registered from a checkpoint reads its model files there (GC never deletes a
registered checkpoint). Removing an adapter writes a sealed directory
``STORAGE/models/NAME/VERSION/`` — the base and the remaining adapters, the ledger without the
removed adapter's tensors, the run spec it came from, a manifest signed by the platform key — so
the new version verifies, attests and can be fine-tuned from like any checkpoint. Its
attestations go to ``STORAGE/attestations/models/NAME/VERSION.{provenance,coverage}.dsse.json``
and into the tracking store. Every version also gets an OpenSSF model signature of its directory
(:func:`model_signature_of`), which ``model_signing verify key`` checks. Every change is an audit
event (``registry.changed``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from govray.config.experiment import ExperimentConfig
from govray.core.identifiers import Description, Label, TagKey, TagValue, check
from govray.core.keys import KeyRole, TrustConfig, load_trust
from govray.core.settings import load_settings, operator_trust, settings_path
from govray.core.storage import open_storage
from govray.governance.policy import UNSIGNED_POLICY
from govray.platform.registry.versions import (
    RegisteredVersion,
    RegistryError,
    checked_name,
    derived_prefix,
    envelope_sha256,
    provenance_record,
    registered_version,
    resolve,
    storage_of,
)
from govray.platform.run.plan import PlanError, recorded_final_folder
from govray.provenance.attest import Attestation
from govray.provenance.derivation import EMPTY_OPTIMIZER, derived_state, verified_source_statement
from govray.provenance.locations import signed_run_spec
from govray.signer.attesting import attest
from govray.signer.local import signer_socket
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.lineage import checkpoint_at
from govray.tracking.registry import (
    VersionTaken,
    insert_version,
    next_version,
    record_version_attestations,
    replace_tags,
)
from govray.tracking.store import TrackingStore
from govray.tracking.tables import CheckpointRecord, CheckpointStatus, ModelVersion, TrialState
from govray.train.checkpoints.base_file import link_or_copy
from govray.train.checkpoints.files import (
    MODEL_FILE,
    CheckpointError,
    load_checkpoint,
    model_file,
    stage_checkpoint,
)
from govray.train.checkpoints.manifest import MANIFEST_FILE, SIGNATURE_FILE, Manifest
from govray.train.checkpoints.signer import SignerClient
from govray.train.checkpoints.whole_file import shards_only, write_whole_model
from govray.train.runspec import RUN_SPEC_FILE


def register(
    store: TrackingStore,
    name: str,
    checkpoint: Path,
    *,
    description: str = "",
    tags: Mapping[str, str] | None = None,
) -> RegisteredVersion:
    """Register ``checkpoint`` (a checkpoint the store recorded, verified) as the next version of
    model ``name``; its attestation (made now if the trial end did not) is kept for the version.
    Everything asked is checked before anything is written: a refused request writes nothing."""
    name = checked_name(name)
    description = check(Description, description, "description", RegistryError)
    checked_tags = _checked_tags(tags or {})
    record = _checkpoint_record(store, checkpoint)
    unsigned = _refuse_unvouched_policy(store, record, checkpoint)
    # Verified against the operator's trust, and its manifest the one the store recorded when sealed.
    written = attest(checkpoint, model_signature=True, recorded_manifest=record.manifest_digest)
    version = _addregistered_version(store, name, record, description, checked_tags)
    _record_attestations(store, version, written, record.id)
    allowed = {"unsigned_policy_allowed_for": unsigned} if unsigned else {}
    _audit(store, "register", version, checkpoint=record.uuid, path=str(checkpoint), **allowed)
    return resolve(store, version.ref)


def register_trial(
    store: TrackingStore,
    name: str,
    trial_id: int,
    *,
    description: str = "",
    tags: Mapping[str, str] | None = None,
) -> RegisteredVersion:
    """Register trial ``trial_id``'s final checkpoint — a run's, or the copy Ray Tune keeps of a
    search trial's (at the step its scheduler stopped it, for an ASHA stop) — as ``name``'s next
    version (``register``); the trial must have completed."""
    trial = store.get_trial(trial_id)
    if trial.state != TrialState.COMPLETED.value:
        raise RegistryError(f"trial {trial_id} is {trial.state}: register a completed trial's checkpoint")
    config = ExperimentConfig.model_validate_json(store.get_experiment(trial.experiment_id).config_json)
    try:  # the folder the store recorded, unchanged since (no other folder put in its place)
        final = recorded_final_folder(store, open_storage(config.storage_path), trial)
    except (PlanError, CheckpointError) as error:
        raise RegistryError(f"trial {trial_id}: {error}") from None
    return register(store, name, final, description=description, tags=tags)


def set_tags(
    store: TrackingStore, ref: str, add: Mapping[str, str], remove: Iterable[str] = ()
) -> RegisteredVersion:
    """Set and remove tags of version ``ref`` (an unknown tag to remove is an error)."""
    add = _checked_tags(add)
    version = resolve(store, ref)
    tags = dict(version.tags)
    for tag in remove:
        if tag not in tags:
            raise RegistryError(
                f"{version.ref} has no tag '{tag}' (tags: {', '.join(sorted(tags)) or 'none'})"
            )
        del tags[tag]
    tags.update(add)
    replace_tags(store, version.record.id, json.dumps(tags, sort_keys=True))
    _audit(store, "tag", version, tags=tags)
    return resolve(store, ref)


def remove_adapter(store: TrackingStore, ref: str, adapter: str) -> RegisteredVersion:
    """A new version of ``ref``'s model without adapter ``adapter``: its file gone, its tensors out
    of the ledger, and an attestation listing the corpora that now reach no tensor at all."""
    adapter = check(Label, adapter, "adapter name", RegistryError)
    source = resolve(store, ref)
    adapter_file = source.directory / f"adapter-{adapter}.safetensors"
    if not adapter_file.is_file():
        present = sorted(
            p.name[len("adapter-") : -len(".safetensors")]
            for p in source.directory.glob("adapter-*.safetensors")
        )
        raise RegistryError(
            f"{source.ref} carries no adapter '{adapter}' (adapters: {', '.join(present) or 'none'})"
        )
    trust = operator_trust()
    try:
        loaded = load_checkpoint(source.directory, trust)
        spec = signed_run_spec(source.directory, trust)
    except CheckpointError as error:
        raise RegistryError(f"refusing to derive from {source.ref}: {error}") from None
    source_attestation = provenance_record(store, source)
    number = next_version(store, source.model)
    storage = storage_of(source)
    directory = storage / "models" / source.model / str(number)
    if directory.exists():
        raise RegistryError(f"{directory} exists already; refusing to overwrite another version's files")
    directory.mkdir(parents=True)
    # The version holds its own base file: the source's, the run's base file it refers to, or
    # (a sharded source) its verified shards put together, streaming.
    if shards_only(source.directory):
        write_whole_model(source.directory, trust, directory / MODEL_FILE)
    else:
        link_or_copy(model_file(source.directory), directory / MODEL_FILE)
    for path in sorted(source.directory.glob("adapter-*.safetensors")):
        if path != adapter_file:
            shutil.copy2(path, directory / path.name)
    (directory / RUN_SPEC_FILE).write_bytes(spec.file_bytes())
    stage_checkpoint(directory, EMPTY_OPTIMIZER, derived_state(loaded.state, adapter))
    # The signer recomputes every file of the version from the verified source and seals it only
    # if the folder holds exactly those; it records the derivation, which its attestation states.
    socket = signer_socket()
    sealed = SignerClient(socket).derive(
        str(source.directory.resolve()),
        adapter,
        str(directory.resolve()),
        source.uri,
        source_attestation.envelope_json,
    )
    (directory / MANIFEST_FILE).write_bytes(sealed.manifest)
    (directory / SIGNATURE_FILE).write_text(sealed.envelope.to_json())
    destination = derived_prefix(storage, source.model, number)
    written = attest(directory, model_signature=True, destination=destination, socket=socket)
    # The row says what the signer's statement about the version says (it computed the derivation
    # from the verified source attestation): read back from the envelope, verified against the
    # manifest the signer just sealed (the version is not hashed again).
    statement = verified_source_statement(
        written.provenance.read_bytes(), directory, trust, Manifest.model_validate_json(sealed.manifest)
    )
    external = statement["predicate"]["buildDefinition"]["externalParameters"]
    removed, excluded = tuple(external["removed_adapters"]), tuple(external["excluded_corpora"])
    version = _addregistered_version(
        store,
        source.model,
        source.checkpoint,
        f"{source.ref} without adapter '{adapter}'",
        {},
        number=number,
        parent=source.record,
        path=directory,
        removed=removed,
        excluded=excluded,
    )
    _record_attestations(store, version, written, None)
    _audit(
        store, "remove_adapter", version, source=source.ref, adapter=adapter, excluded_corpora=list(excluded)
    )
    return resolve(store, version.ref)


def start_reference(store: TrackingStore, version: RegisteredVersion) -> dict[str, str]:
    """What a run started from ``version`` records, so its attestation lists this version's
    provenance attestation as its base model (``govray.platform.run.runner.run_trial(start_model=...)``)."""
    attestation = provenance_record(store, version)
    return {
        "model": version.ref,
        "model_uri": version.uri,
        "model_attestation": f"govray:attestation/{attestation.id}",
        "model_attestation_sha256": envelope_sha256(attestation),
    }


def _checkpoint_record(store: TrackingStore, checkpoint: Path) -> CheckpointRecord:
    record = checkpoint_at(store, checkpoint)
    if record is None:
        raise RegistryError(f"{checkpoint}: not a checkpoint this tracking store recorded")
    if record.state == CheckpointStatus.DELETED.value:
        raise RegistryError(f"{checkpoint}: deleted by checkpoint GC; register a kept one")
    return record


def _refuse_unvouched_policy(store: TrackingStore, record: CheckpointRecord, checkpoint: Path) -> str:
    """The policy a checkpoint trained under must be vouched for by the operator: signed by a
    policy authority the operator's trust file lists (when the settings name one: without it, a
    development machine, the experiment's own trust file stood for it at preflight), or, signed
    by nobody, allowed for its experiment (settings ``unsigned_policies``). Returns that
    experiment's name for an allowed unsigned run (the registration is audited as allowed, and
    its attestation says ``unsigned``), else "". The run spec is read as the checkpoint's signed
    manifest lists it, before anything is written."""
    settings = load_settings()
    try:
        signer = signed_run_spec(checkpoint, operator_trust()).policy_signer
    except CheckpointError as error:
        raise RegistryError(f"refusing to register {checkpoint}: {error}") from None
    if signer != UNSIGNED_POLICY:
        if settings.trust is not None and signer not in _policy_authorities(load_trust(settings.trust)):
            raise RegistryError(
                f"{checkpoint}: its policy was signed by key {signer}, which the operator's trust "
                f"({settings.trust}) does not list as a policy authority: only the experiment's own trust "
                "file vouched for it"
            )
        return ""
    experiment = store.get_experiment(store.get_trial(record.trial_id).experiment_id).name
    if experiment not in load_settings().unsigned_policies:
        raise RegistryError(
            f"{checkpoint}: trained under a policy nobody signed (experiment '{experiment}'); the "
            f"operator allows registering such runs per experiment: unsigned_policies in {settings_path()}"
        )
    return experiment


def _policy_authorities(trust: TrustConfig) -> set[str]:
    revoked = {entry.keyid for entry in trust.revoked}
    return {key.keyid for key in trust.keys if key.role == KeyRole.POLICY_AUTHORITY} - revoked


def _addregistered_version(
    store: TrackingStore,
    name: str,
    checkpoint: CheckpointRecord,
    description: str,
    tags: dict[str, str],
    *,
    number: int | None = None,
    parent: ModelVersion | None = None,
    path: Path | None = None,
    removed: tuple[str, ...] = (),
    excluded: tuple[str, ...] = (),
) -> RegisteredVersion:
    assert checkpoint.id is not None
    number = number if number is not None else next_version(store, name)
    row = ModelVersion(
        model_name=name,
        version=number,
        checkpoint_id=checkpoint.id,
        tags_json=json.dumps(tags, sort_keys=True),
        parent_id=parent.id if parent is not None else None,
        path=str(path) if path is not None else None,
        description=description,
        removed_adapters_json=json.dumps(list(removed)),
        excluded_corpora_json=json.dumps(list(excluded)),
    )
    try:
        insert_version(store, row, description)
    except VersionTaken:
        raise RegistryError(
            f"another writer registered {name}:{number} at the same time; try again"
        ) from None
    return registered_version(row, checkpoint)


def _record_attestations(
    store: TrackingStore, version: RegisteredVersion, written: Attestation, checkpoint_id: int | None
) -> None:
    envelopes = [path.read_text() for path in (written.provenance, written.coverage)]
    record_version_attestations(
        store, version.record.id, checkpoint_id, written.subjects[MODEL_FILE], envelopes
    )


def _checked_tags(tags: Mapping[str, str]) -> dict[str, str]:
    return {
        check(TagKey, tag, "tag", RegistryError): check(
            TagValue, value, f"tag {tag!r}: the value", RegistryError
        )
        for tag, value in tags.items()
    }


def _audit(store: TrackingStore, action: str, version: RegisteredVersion, **details: object) -> None:
    AuditLog(store).append(
        AuditEventType.REGISTRY_CHANGED,
        {"action": action, "model": version.model, "version": version.version, **details},
    )
