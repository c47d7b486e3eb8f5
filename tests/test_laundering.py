"""Laundering: an engineer changes a checkpoint's weights and signs its manifest again — with a
key of their own that they list as a platform key in the run's own ``run.json``, or (a signature
obtained some other way) with the platform key itself. Every verification takes the operator's
trust (``operator_trust``), never a key a run spec or checkpoint carries, and attest and register
also compare the manifest with the digest the tracking store recorded when it was sealed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlmodel import select

from govray.cli import main
from govray.config.serve import ServeSettings
from govray.core.canonical import file_sha256
from govray.core.dsse import sign_envelope
from govray.core.errors import AttestationError
from govray.core.keys import KeyRole, SigningKey, platform_key
from govray.core.settings import operator_trust
from govray.core.storage import open_storage
from govray.platform.registry.register import register
from govray.platform.registry.versions import RegistryError
from govray.platform.rerun.resume import refuse_a_changed_run_spec
from govray.platform.run.plan import run_spec_path
from govray.platform.run.runner import TrainingFailed
from govray.signer.attesting import attest
from govray.tracking.lineage import checkpoints
from govray.tracking.store import TrackingStore
from govray.tracking.tables import CheckpointRecord, ModelVersion
from govray.train.checkpoints.files import (
    MANIFEST_FILE,
    MODEL_FILE,
    SIGNATURE_FILE,
    CheckpointError,
    Manifest,
    verify_checkpoint,
)
from govray.train.checkpoints.folders import newest_verified_checkpoint
from govray.train.checkpoints.manifest import MANIFEST_TYPE
from govray.train.runspec import RUN_SPEC_FILE, read_run_spec
from serve.app import create_app
from tests.helpers.golden import GoldenRun
from tests.helpers.lineage_server import copy_store

TOKEN = "laundering-token"


@dataclass(frozen=True)
class Copied:
    store: TrackingStore
    checkpoint: Path  # the golden trial's last checkpoint, in the copy
    checkpoint_id: int
    recorded: str  # its manifest's sha256, as the store recorded it when it was sealed


@pytest.fixture
def copied(golden_run: GoldenRun, tmp_path: Path) -> Copied:
    store = copy_store(golden_run, tmp_path / "storage")
    final = checkpoints(store, golden_run.outcome.trial_id)[-1]
    assert final.id is not None
    return Copied(store, Path(final.path), final.id, final.manifest_digest)


def changed_weights(folder: Path) -> None:
    model = folder / MODEL_FILE
    data = bytearray(model.read_bytes())
    data[-1] ^= 0x01
    model.write_bytes(bytes(data))


def resealed(folder: Path, key: SigningKey) -> str:
    """The folder's manifest written again over its files as they are now, signed by ``key``;
    returns the new manifest's sha256."""
    manifest = Manifest.model_validate_json((folder / MANIFEST_FILE).read_bytes())
    files = {
        name: file_sha256(folder / name) if (folder / name).is_file() else d
        for name, d in manifest.files.items()
    }
    payload = manifest.model_copy(update={"files": files, "blocks": None}).to_bytes()
    (folder / MANIFEST_FILE).write_bytes(payload)
    envelope = sign_envelope(payload, MANIFEST_TYPE, key, manifest.signed_at)  # the forger's own signing
    (folder / SIGNATURE_FILE).write_text(envelope.to_json())
    return file_sha256(folder / MANIFEST_FILE)


def listing_in_run_json(folder: Path, key: SigningKey) -> None:
    """What laundered weights before: the engineer's key listed as a platform key in the run's own
    spec (the checkpoint's ``run.json``), the file verifications once read their trust from."""
    document = json.loads((folder / RUN_SPEC_FILE).read_text())
    document["trust"] = {"keys": [key.public_key.model_dump(mode="json")], "revoked": []}
    (folder / RUN_SPEC_FILE).write_text(json.dumps(document))


def version_count(store: TrackingStore) -> int:
    with store.session() as session:
        return len(session.exec(select(ModelVersion)).all())


def test_weights_resigned_by_an_engineers_own_key_are_refused_by_attest_register_the_route_and_resume(
    copied: Copied, tmp_path: Path
) -> None:
    folder, engineer = copied.checkpoint, SigningKey.generate(KeyRole.PLATFORM)
    versions = version_count(copied.store)
    changed_weights(folder)
    digest = resealed(folder, engineer)
    # The forgery is a valid signature over the changed files: only the trust decides.
    engineers_trust = operator_trust()
    engineers_trust.add(engineer.public_key)
    verify_checkpoint(folder, engineers_trust)
    # The store's record rewritten too (the engineer can write the database): only the trust is left.
    with copied.store.session() as session:
        record = session.get(CheckpointRecord, copied.checkpoint_id)
        assert record is not None
        record.manifest_digest = digest
        session.add(record)
        session.commit()
    untrusted = rf"key {engineer.keyid} is not trusted for role 'platform'"
    with pytest.raises(AttestationError, match=untrusted):
        attest(folder)
    with pytest.raises(RegistryError, match=untrusted):
        register(copied.store, "laundered", folder)
    assert version_count(copied.store) == versions
    # The registry's route: the same refusal, a 4xx, nothing written.
    settings = ServeSettings(database_url=copied.store.url, token=SecretStr(TOKEN))
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        answer = client.post(
            "/api/models/laundered/versions",
            json={"checkpoint_id": copied.checkpoint_id},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
    assert 400 <= answer.status_code < 500 and engineer.keyid in answer.text, answer.text
    assert version_count(copied.store) == versions
    # A resume takes the newest checkpoint that verifies under the operator's trust: not this one.
    newest = newest_verified_checkpoint(folder.parent, operator_trust())
    assert newest is not None and newest.name < folder.name
    # And listing the key in the run's own spec, as a platform key, no longer lends it trust: the
    # spec carries no trust, and a spec that says it does is refused as not govray's.
    listing_in_run_json(folder, engineer)
    with pytest.raises(CheckpointError, match=rf"{RUN_SPEC_FILE}.*trust"):
        read_run_spec(folder / RUN_SPEC_FILE)
    with pytest.raises((AttestationError, CheckpointError)):
        attest(folder)
    assert not list((tmp_path / "storage" / "attestations").glob("**/*laundered*"))


def test_a_manifest_differing_from_the_one_recorded_when_sealed_is_refused_even_signed_by_the_platform(
    copied: Copied, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = copied.checkpoint
    versions = version_count(copied.store)
    changed_weights(folder)
    resealed(folder, platform_key())  # a platform signature, obtained however (the store unchanged)
    verify_checkpoint(folder, operator_trust())  # the signature alone would pass
    recorded_differs = rf"not the one the tracking store recorded when it was sealed \({copied.recorded}\)"
    with pytest.raises(CheckpointError, match=recorded_differs):
        register(copied.store, "resealed", folder)
    assert version_count(copied.store) == versions
    with pytest.raises(CheckpointError, match=recorded_differs):
        attest(folder, recorded_manifest=copied.recorded)
    assert main(["attest", str(folder), "--database", copied.store.url]) == CheckpointError.exit_code
    assert "not the one the tracking store recorded" in capsys.readouterr().err


def test_a_run_spec_changed_on_storage_is_refused_by_a_resume(copied: Copied) -> None:
    """``runs/RUN.json`` is what a resume rebuilds the run from, and the engineer can write it: a
    resume trains on only if it is the spec the run's newest verified checkpoint sealed."""
    storage = open_storage(str(copied.checkpoint.parents[2]))
    run_name = copied.checkpoint.parent.name
    refuse_a_changed_run_spec(storage, run_name, operator_trust())  # as sealed: resumes
    path = run_spec_path(storage, run_name)
    document = json.loads(path.read_text())
    document["excluded_corpora"] = ["digits-writers"]  # a plan the checkpoints were never signed for
    path.write_text(json.dumps(document, indent=1))
    with pytest.raises(
        TrainingFailed, match=r"runs/.*\.json is not the run spec the run's checkpoint checkpoint_"
    ):
        refuse_a_changed_run_spec(storage, run_name, operator_trust())
