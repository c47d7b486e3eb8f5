"""The registry's read side: a registered version by reference, the versions of a model, their
attestations and model signatures, as the tracking store and the storage hold them. Reading needs
neither torch nor Ray (the CLI's ``model list/versions/describe`` answer at once); writing versions
is :mod:`govray.platform.registry.register`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from govray.core.canonical import sha256_hex
from govray.core.errors import GovrayError
from govray.core.identifiers import ModelName, check, parse_model_ref
from govray.provenance.locations import attestation_prefix, run_spec_of, signature_path
from govray.provenance.statement_types import PROVENANCE_TYPE, statement_type
from govray.tracking.registry import attestations_of_version, find_version, is_registered, model_versions
from govray.tracking.store import TrackingStore
from govray.tracking.tables import AttestationRecord, CheckpointRecord, ModelVersion


class RegistryError(GovrayError):
    """A registry request that cannot be met: an unknown model or version, a bad name or tag, a
    checkpoint the store does not know, an adapter the version does not carry."""

    exit_code = 17


@dataclass(frozen=True)
class RegisteredVersion:
    """One version of a registered model, with the checkpoint it descends from and where its
    model files are."""

    model: str
    version: int
    record: ModelVersion
    checkpoint: CheckpointRecord
    directory: Path
    removed_adapters: tuple[str, ...]
    excluded_corpora: tuple[str, ...]
    tags: dict[str, str]

    @property
    def ref(self) -> str:
        return f"{self.model}:{self.version}"

    @property
    def uri(self) -> str:
        return model_uri(self.model, self.version)


def model_uri(name: str, version: int) -> str:
    return f"govray:model/{name}/{version}"


def parse_ref(ref: str) -> tuple[str, int | None]:
    """``NAME`` (the latest version) or ``NAME:VERSION``; ``RegistryError`` for anything else (a
    name the pattern does not allow, a version that is not ASCII digits within 1..2^63-1)."""
    return parse_model_ref(ref, RegistryError)


def resolve(store: TrackingStore, ref: str) -> RegisteredVersion:
    """The version ``ref`` names; ``RegistryError`` naming what is unknown."""
    name, number = parse_ref(ref)
    if not is_registered(store, name):
        raise RegistryError(f"no registered model '{name}'")
    found = find_version(store, name, number)
    if found is None:
        raise RegistryError(
            f"model '{name}' has no version {number}" if number else f"model '{name}' has no versions"
        )
    return registered_version(*found)


def versions(store: TrackingStore, name: str) -> list[RegisteredVersion]:
    """The versions of model ``name``, oldest first."""
    resolve(store, checked_name(name))  # an unknown model is an error, not an empty list
    return [registered_version(row, checkpoint) for row, checkpoint in model_versions(store, name)]


def version_attestations(store: TrackingStore, version: RegisteredVersion) -> list[AttestationRecord]:
    """The attestation envelopes kept for a version (provenance first, then coverage)."""
    return attestations_of_version(store, version.record.id)


def provenance_record(store: TrackingStore, version: RegisteredVersion) -> AttestationRecord:
    """The version's provenance attestation as the store keeps it."""
    for record in version_attestations(store, version):
        if statement_type(record.envelope_json) == PROVENANCE_TYPE:
            return record
    raise RegistryError(f"{version.ref} has no provenance attestation in the tracking store")


def model_signature_of(version: RegisteredVersion) -> Path:
    """The OpenSSF model signature of the version's directory (``model_signing verify key
    --signature THIS --public_key platform-ecdsa.pub.pem DIRECTORY``)."""
    if version.record.path is not None:  # a derived version's own sealed directory
        return signature_path(derived_prefix(storage_of(version), version.model, version.version))
    return signature_path(attestation_prefix(version.directory, run_spec_of(version.directory)))


def derived_prefix(storage: Path, model: str, number: int) -> Path:
    return storage / "attestations" / "models" / model / str(number)


def envelope_sha256(record: AttestationRecord) -> str:
    """The sha256 of the envelope's bytes (the file written beside the model holds the same)."""
    return sha256_hex(record.envelope_json.encode())


def registered_version(row: ModelVersion, checkpoint: CheckpointRecord) -> RegisteredVersion:
    return RegisteredVersion(
        model=row.model_name,
        version=row.version,
        record=row,
        checkpoint=checkpoint,
        directory=Path(row.path if row.path is not None else checkpoint.path),
        removed_adapters=tuple(json.loads(row.removed_adapters_json)),
        excluded_corpora=tuple(json.loads(row.excluded_corpora_json)),
        tags=json.loads(row.tags_json),
    )


def storage_of(version: RegisteredVersion) -> Path:
    # STORAGE/ray/RUN/checkpoint_N and STORAGE/models/NAME/VERSION both sit three levels down.
    return version.directory.resolve().parents[2]


def checked_name(name: str) -> str:
    checked: str = check(ModelName, name, "model name", RegistryError)
    return checked
