"""The model registry in the tracking store: registered models, their numbered versions, and the
attestations kept for a version. ``govray.platform.registry.register`` decides what is registered;
these are its rows.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy.exc import IntegrityError
from sqlmodel import col, func, select

from govray.core.errors import TrackingError
from govray.tracking.store import TrackingStore
from govray.tracking.tables import AttestationRecord, CheckpointRecord, ModelVersion, RegisteredModel


class VersionTaken(TrackingError):
    """Another writer added the same version number of a model first."""


def is_registered(store: TrackingStore, name: str) -> bool:
    with store.session() as session:
        return session.get(RegisteredModel, name) is not None


def find_version(
    store: TrackingStore, name: str, number: int | None
) -> tuple[ModelVersion, CheckpointRecord] | None:
    """Version ``number`` of model ``name`` (None: its latest) and the checkpoint it descends from."""
    with store.session() as session:
        query = select(ModelVersion).where(ModelVersion.model_name == name)
        if number is None:
            row = session.exec(query.order_by(col(ModelVersion.version).desc())).first()
        else:
            row = session.exec(query.where(ModelVersion.version == number)).first()
        if row is None:
            return None
        checkpoint = session.get(CheckpointRecord, row.checkpoint_id)
    assert checkpoint is not None  # a foreign key
    return row, checkpoint


def model_versions(store: TrackingStore, name: str) -> list[tuple[ModelVersion, CheckpointRecord]]:
    """The versions of model ``name`` with their checkpoints, oldest first."""
    with store.session() as session:
        return list(
            session.exec(
                select(ModelVersion, CheckpointRecord)
                .join(CheckpointRecord, col(CheckpointRecord.id) == col(ModelVersion.checkpoint_id))
                .where(ModelVersion.model_name == name)
                .order_by(col(ModelVersion.version))
            ).all()
        )


def list_models(store: TrackingStore) -> list[tuple[RegisteredModel, int]]:
    """Every registered model with its number of versions, by name."""
    with store.session() as session:
        counts = dict(
            session.exec(
                select(ModelVersion.model_name, func.count()).group_by(col(ModelVersion.model_name))
            ).all()
        )
        models = session.exec(select(RegisteredModel).order_by(col(RegisteredModel.name))).all()
    return [(model, counts.get(model.name, 0)) for model in models]


def versions_of_checkpoints(store: TrackingStore, checkpoint_ids: Iterable[int]) -> list[ModelVersion]:
    """The versions registered from these checkpoints, by model then version."""
    with store.session() as session:
        query = select(ModelVersion).where(col(ModelVersion.checkpoint_id).in_(list(checkpoint_ids)))
        return list(session.exec(query.order_by(col(ModelVersion.model_name), col(ModelVersion.version))))


def next_version(store: TrackingStore, name: str) -> int:
    """The number model ``name``'s next version gets (1 for a new model)."""
    with store.session() as session:
        latest = session.exec(
            select(func.max(ModelVersion.version)).where(ModelVersion.model_name == name)
        ).one()
    return int(latest or 0) + 1


def insert_version(store: TrackingStore, version: ModelVersion, description: str) -> None:
    """Store a new version, registering its model (with ``description``) the first time;
    ``VersionTaken`` if another writer stored that number first."""
    try:
        with store.session() as session:
            if session.get(RegisteredModel, version.model_name) is None:
                session.add(RegisteredModel(name=version.model_name, description=description))
                session.flush()
            session.add(version)
    except IntegrityError:
        raise VersionTaken(
            f"another writer registered {version.model_name}:{version.version} at the same time"
        ) from None


def replace_tags(store: TrackingStore, version_id: int | None, tags_json: str) -> None:
    """Replace a version's tags."""
    with store.session() as session:
        row = session.get(ModelVersion, version_id)
        assert row is not None
        row.tags_json = tags_json
        session.add(row)


def record_version_attestations(
    store: TrackingStore,
    version_id: int | None,
    checkpoint_id: int | None,
    subject_digest: str,
    envelopes: Iterable[str],
) -> None:
    """Keep a version's attestation envelopes (all or none), in the order given."""
    with store.session() as session:
        for envelope_json in envelopes:
            session.add(
                AttestationRecord(
                    checkpoint_id=checkpoint_id,
                    model_version_id=version_id,
                    subject_digest=subject_digest,
                    envelope_json=envelope_json,
                )
            )


def attestations_of_version(store: TrackingStore, version_id: int | None) -> list[AttestationRecord]:
    """The attestation envelopes kept for a version, oldest first."""
    with store.session() as session:
        query = select(AttestationRecord).where(AttestationRecord.model_version_id == version_id)
        return list(session.exec(query.order_by(col(AttestationRecord.id))))
