"""Attestations of the golden run's final checkpoint: a library govray did not write verifies them,
they say what trained which tensors, and every kind of tampering is refused by name."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from securesystemslib.dsse import Envelope as SslibEnvelope
from securesystemslib.signer import SSlibKey
from torch import nn

from govray.cli import main
from govray.core.canonical import canonical_json
from govray.core.dsse import sign_envelope
from govray.core.keys import (
    KeyRole,
    SigningKey,
    TrustConfig,
    load_trust,
    platform_key,
    platform_trust,
    save_trust,
    trust_root_sha256,
)
from govray.core.settings import operator_trust
from govray.data.shards import ShardSet
from govray.provenance.attest import Attestation, AttestationError
from govray.provenance.locations import run_spec_of
from govray.provenance.predicates import world_history
from govray.provenance.recompute import check_attested_ledger
from govray.provenance.row_reach import row_reach
from govray.provenance.statement_types import COVERAGE_TYPE, PAYLOAD_TYPE, PROVENANCE_TYPE
from govray.provenance.verify import verify_attestation
from govray.signer.attesting import attest
from govray.tracking.lineage import attestations, checkpoints
from govray.train.checkpoints.files import CheckpointState
from govray.train.step.ledger import Ledger
from govray.train.trial import make_trial, resolve_trial_routes
from jobs.examples.digits.golden import GOLDEN_HPARAMS, GOLDEN_STEPS
from jobs.examples.digits.trial import DigitsTrial
from tests.helpers.attest import copied_checkpoint, statement_of
from tests.helpers.golden import GoldenRun, final_checkpoint


@pytest.fixture(scope="module")
def attested(golden_run: GoldenRun) -> tuple[Path, Attestation]:
    checkpoint = final_checkpoint(golden_run.outcome.run_dir)
    return checkpoint, attest(checkpoint)


def test_securesystemslib_verifies_both_envelopes_by_key_id(attested: tuple[Path, Attestation]) -> None:
    _, written = attested
    key = platform_key()
    sslib_key = SSlibKey.from_dict(key.keyid, key.public_key.sslib_dict())
    for path in (written.provenance, written.coverage):
        envelope = SslibEnvelope.from_dict(json.loads(path.read_text()))
        assert envelope.payload_type == "application/vnd.in-toto+json"
        assert key.keyid in envelope.verify([sslib_key], threshold=1)


def test_the_statements_name_the_model_files_the_corpora_and_what_reached_each_tensor(
    golden_run: GoldenRun, attested: tuple[Path, Attestation]
) -> None:
    checkpoint, written = attested
    provenance, coverage = statement_of(written.provenance), statement_of(written.coverage)
    assert provenance["_type"] == coverage["_type"] == "https://in-toto.io/Statement/v1"
    assert (provenance["predicateType"], coverage["predicateType"]) == (PROVENANCE_TYPE, COVERAGE_TYPE)
    names = [subject["name"] for subject in provenance["subject"]]
    assert (
        names == ["model.safetensors", "adapter-pii-lora.safetensors"]
        and coverage["subject"] == provenance["subject"]
    )

    build = provenance["predicate"]["buildDefinition"]
    assert build["externalParameters"]["policy"]["sha256"] == golden_run.checked.policy.digest
    assert build["internalParameters"]["replay_equivalence"] == {  # a CPU run: replay is bit for bit
        "exact": True,
        "tolerance": {"rtol": 0.0, "atol": 0.0},
        "basis": "CPU kernels and gloo",
    }
    assert build["externalParameters"]["hyperparameters"] == GOLDEN_HPARAMS
    manifest = ShardSet.open(golden_run.shard_root).manifest
    dependencies = {d["name"]: d for d in build["resolvedDependencies"]}
    assert set(dependencies) == {corpus.corpus_id for corpus in manifest.corpora}
    for corpus in manifest.corpora:
        assert dependencies[corpus.corpus_id]["digest"] == {"sha256": corpus.fingerprint}
        assert dependencies[corpus.corpus_id]["annotations"]["credential"] == corpus.credential

    state = CheckpointState.model_validate_json((checkpoint / "state.json").read_text())
    assert state.step == GOLDEN_STEPS
    # The world sizes it trained on (2 workers throughout).
    assert build["internalParameters"]["world_history"] == [[0, 2]] == world_history(state)
    assert world_history(state.model_copy(update={"world_history": [(0, 3), (12, 2)]})) == [[0, 3], [12, 2]]
    ledger = Ledger.from_json(state.ledger)
    rows = {(r["corpus"], r["tensor"]): r["examples"] for r in coverage["predicate"]["ledger"]}
    assert rows == {(corpus, tensor): entry.examples for corpus, tensor, entry in ledger.rows()}
    # The PII corpus reached only the removable adapter; the licensed one never the embedding.
    layers = {(r["corpus"], r["layer"]) for r in coverage["predicate"]["ledger"]}
    assert {layer for corpus, layer in layers if corpus == "digits-writers"} == {"adapter:pii-lora"}
    assert ("digits-licensed", "embed") not in layers and ("digits-public", "embed") in layers
    matrix = next(
        b for b in provenance["predicate"]["runDetails"]["byproducts"] if b["name"] == "coverage-matrix"
    )
    assert matrix["annotations"]["content"]["digits-writers"] == {
        "adapter:pii-lora": max(e for (c, _), e in rows.items() if c == "digits-writers")
    }


def test_run_json_holds_the_routing_table_and_attesting_or_looking_up_a_row_never_builds_the_model(
    golden_run: GoldenRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = final_checkpoint(golden_run.outcome.run_dir)
    spec = run_spec_of(checkpoint)  # the checkpoint's own signed run.json
    assert spec.routing is not None
    assert spec.routing == resolve_trial_routes(
        spec.policy, make_trial(spec.trial, spec.hparams, spec.settings)
    )
    built = DigitsTrial.build_model

    def only_on_meta(self: DigitsTrial) -> nn.Module:
        if torch.get_default_device().type != "meta":
            raise AssertionError("the full model was built")
        return built(self)

    monkeypatch.setattr(DigitsTrial, "build_model", only_on_meta)
    with pytest.raises(AssertionError, match="full model"):  # the guard bites a real build
        make_trial(spec.trial, spec.hparams, spec.settings).build_model()
    written = attest(checkpoint, destination=tmp_path / "again")
    assert statement_of(written.coverage)["predicate"]["ledger"]
    assert row_reach(golden_run.store, "digits-writers", 0).trials


@pytest.fixture
def model_dir(attested: tuple[Path, Attestation], tmp_path: Path) -> Path:
    checkpoint, _ = attested
    directory = tmp_path / "model"
    directory.mkdir()
    for file in [checkpoint / "model.safetensors", *checkpoint.glob("adapter-*.safetensors")]:
        shutil.copy(file, directory / file.name)
    return directory


def trust_file(directory: Path, trust: TrustConfig) -> Path:
    path = directory / "trust.yaml"
    save_trust(trust, path)
    return path


def test_a_valid_attestation_verifies_on_the_command_line(
    golden_run: GoldenRun, attested: tuple[Path, Attestation], model_dir: Path, tmp_path: Path
) -> None:
    _, written = attested
    trust = trust_file(tmp_path, platform_trust(platform_key()))
    policy = Path(golden_run.checked.policy.path)
    for path in (written.provenance, written.coverage):
        command = ["verify", str(path), "--model-dir", str(model_dir), "--trust", str(trust)]
        assert main(command + (["--policy", str(policy)] if path == written.provenance else [])) == 0


def test_the_attestation_cites_the_operators_exported_trust_root_and_verify_holds_it_to_it(
    attested: tuple[Path, Attestation], model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A third party holding the root the operator exported verifies against the root the
    attestation was made under; a trust file an engineer widened (their own platform key added)
    is another root: said, and refused under --require-root."""
    _, written = attested
    root = tmp_path / "root.json"
    assert main(["keys", "export-root", "--out", str(root)]) == 0
    digest = hashlib.sha256(root.read_bytes()).hexdigest()
    assert digest == trust_root_sha256(operator_trust())
    internal = statement_of(written.provenance)["predicate"]["buildDefinition"]["internalParameters"]
    assert internal["trust_root"] == {"sha256": digest}
    command = ["verify", str(written.provenance), "--model-dir", str(model_dir), "--trust", str(root)]
    capsys.readouterr()
    assert main([*command, "--require-root"]) == 0
    assert f"trust root: sha256 {digest}, the one this attestation was made under" in capsys.readouterr().out
    widened = load_trust(root)
    widened.add(SigningKey.generate(KeyRole.PLATFORM).public_key)
    command[-1] = str(trust_file(tmp_path, widened))
    assert main([*command, "--require-root"]) == AttestationError.exit_code
    assert main(command) == 0  # without --require-root: verified, and the other root said
    assert f"this attestation was made under sha256 {digest}" in capsys.readouterr().out
    # The coverage statement cites no root: --require-root is refused there, not silently ignored.
    coverage = ["verify", str(written.coverage), "--model-dir", str(model_dir), "--trust", str(root)]
    assert main([*coverage, "--require-root"]) == 2
    assert "--require-root checks a provenance statement" in capsys.readouterr().err


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def resigned_payload(envelope_path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the statement inside the envelope without signing it again."""
    envelope = json.loads(envelope_path.read_text())
    statement = json.loads(base64.b64decode(envelope["payload"]))
    change(statement)
    envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    envelope_path.write_text(json.dumps(envelope))


def flip_signature(envelope_path: Path) -> None:
    envelope = json.loads(envelope_path.read_text())
    raw = bytearray(base64.b64decode(envelope["signatures"][0]["sig"]))
    raw[0] ^= 0x01
    envelope["signatures"][0]["sig"] = base64.b64encode(bytes(raw)).decode()
    envelope_path.write_text(json.dumps(envelope))


def other_digest(statement: dict[str, Any]) -> None:
    statement["subject"][0]["digest"]["sha256"] = "0" * 64


def other_hyperparameters(statement: dict[str, Any]) -> None:
    statement["predicate"]["buildDefinition"]["externalParameters"]["hyperparameters"]["lr"] = 9.0


TAMPERING: dict[str, tuple[Callable[[Path, Path, Path], None], str]] = {
    "one byte of the weights": (
        lambda model, envelope, policy: flip_byte(model / "model.safetensors"),
        r"model.safetensors: sha256 differs from the attested digest",
    ),
    "one byte of an adapter": (
        lambda model, envelope, policy: flip_byte(model / "adapter-pii-lora.safetensors"),
        r"adapter-pii-lora.safetensors: sha256 differs",
    ),
    "an adapter removed": (
        lambda model, envelope, policy: (model / "adapter-pii-lora.safetensors").unlink(),
        r"adapter-pii-lora.safetensors: attested but missing",
    ),
    "an adapter added": (
        lambda model, envelope, policy: shutil.copy(
            model / "adapter-pii-lora.safetensors", model / "adapter-extra.safetensors"
        ),
        r"adapter-extra.safetensors not among the attested subjects",
    ),
    "one byte of the policy": (
        lambda model, envelope, policy: flip_byte(policy),
        r"sha256 differs from the attested policy 'digits' v1",
    ),
    "the payload": (
        lambda model, envelope, policy: resigned_payload(envelope, other_hyperparameters),
        r"does not verify \(tampered signature or payload\)",
    ),
    "a subject digest": (
        lambda model, envelope, policy: resigned_payload(envelope, other_digest),
        r"does not verify \(tampered signature or payload\)",
    ),
    "the signature": (
        lambda model, envelope, policy: flip_signature(envelope),
        r"does not verify \(tampered signature or payload\)",
    ),
}


@pytest.mark.parametrize("what", sorted(TAMPERING))
def test_tampering_is_refused_naming_what_broke(
    what: str, golden_run: GoldenRun, attested: tuple[Path, Attestation], model_dir: Path, tmp_path: Path
) -> None:
    _, written = attested
    envelope = shutil.copy(written.provenance, tmp_path / "provenance.dsse.json")
    policy = shutil.copy(golden_run.checked.policy.path, tmp_path / "policy.yaml")
    tamper, message = TAMPERING[what]
    tamper(model_dir, Path(envelope), Path(policy))
    trust = platform_trust(platform_key())
    with pytest.raises(AttestationError, match=message):
        verify_attestation(Path(envelope), model_dir=model_dir, trust=trust, policy=Path(policy))
    command = [
        "verify",
        str(envelope),
        "--model-dir",
        str(model_dir),
        "--trust",
        str(trust_file(tmp_path, trust)),
    ]
    assert main([*command, "--policy", str(policy)]) == AttestationError.exit_code


def test_a_revoked_or_untrusted_platform_key_is_refused(
    attested: tuple[Path, Attestation], model_dir: Path
) -> None:
    _, written = attested
    key = platform_key()
    revoked = platform_trust(key)
    revoked.revoke(key.keyid, reason="key leaked")
    with pytest.raises(AttestationError, match=rf"key {key.keyid} was revoked .*\(key leaked\)"):
        verify_attestation(written.provenance, model_dir=model_dir, trust=revoked)
    stranger = platform_trust(SigningKey.generate(KeyRole.PLATFORM))
    with pytest.raises(AttestationError, match=rf"key {key.keyid} is not trusted for role 'platform'"):
        verify_attestation(written.provenance, model_dir=model_dir, trust=stranger)


def test_a_tampered_checkpoint_is_not_attested(attested: tuple[Path, Attestation], tmp_path: Path) -> None:
    checkpoint, _ = attested
    copy = copied_checkpoint(checkpoint, tmp_path / "storage")
    flip_byte(copy / "model.safetensors")
    with pytest.raises(
        AttestationError, match="refusing to attest: .*model.safetensors: sha256 does not match"
    ):
        attest(copy)
    assert not (tmp_path / "storage" / "attestations").exists()


def test_every_finished_trial_is_attested_in_the_tracking_store(
    golden_run: GoldenRun, tmp_path: Path
) -> None:
    final = final_checkpoint(golden_run.outcome.run_dir)
    rows = checkpoints(golden_run.store, golden_run.outcome.trial_id)
    row = next(c for c in rows if Path(c.path).resolve() == final.resolve())
    assert row.id is not None
    stored = attestations(golden_run.store, row.id)
    kinds = sorted(
        json.loads(base64.b64decode(json.loads(r.envelope_json)["payload"]))["predicateType"] for r in stored
    )
    # (the run's end attested it; tests that attest the shared golden run again add records)
    assert set(kinds) == {COVERAGE_TYPE, PROVENANCE_TYPE}
    for index, record in enumerate(stored):
        path = tmp_path / f"{index}.dsse.json"
        path.write_text(record.envelope_json)
        verified = verify_attestation(path, model_dir=final, trust=platform_trust(platform_key()))
        assert record.subject_digest == verified.statement["subject"][0]["digest"]["sha256"]


def test_verify_recomputes_the_attested_ledger_from_the_recorded_schedule(
    attested: tuple[Path, Attestation], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint, written = attested
    trust = trust_file(tmp_path, platform_trust(platform_key()))
    command = ["verify", str(written.provenance), "--model-dir", str(checkpoint), "--trust", str(trust)]
    assert main([*command, "--recompute-ledger"]) == 0
    entries = len(statement_of(written.coverage)["predicate"]["ledger"])
    assert f"all {entries} attested entries match" in capsys.readouterr().out


def test_a_validly_signed_ledger_that_the_schedule_does_not_produce_is_refused(
    attested: tuple[Path, Attestation], tmp_path: Path
) -> None:
    """The platform key signed it, every digest matches — but one count is not what the recorded
    schedule and the policy give, and recomputing names it."""
    checkpoint, written = attested
    statement = statement_of(written.coverage)
    entry = next(e for e in statement["predicate"]["ledger"] if e["corpus"] == "digits-writers")
    entry["examples"] += 1
    forged = tmp_path / "forged.coverage.dsse.json"
    forged.write_text(sign_envelope(canonical_json(statement), PAYLOAD_TYPE, platform_key()).to_json())
    trust = platform_trust(platform_key())
    verified = verify_attestation(forged, model_dir=checkpoint, trust=trust)
    expected = rf"digits-writers → {re.escape(entry['tensor'])}: attested {{\"examples\": {entry['examples']}"
    with pytest.raises(AttestationError, match=expected):
        check_attested_ledger(verified.statement, checkpoint, trust)
    command = [
        "verify",
        str(forged),
        "--model-dir",
        str(checkpoint),
        "--trust",
        str(trust_file(tmp_path, trust)),
    ]
    assert main([*command, "--recompute-ledger"]) == AttestationError.exit_code


def test_checkpoint_and_attestation_signatures_record_their_signing_time(
    attested: tuple[Path, Attestation],
) -> None:
    """The record's signed_at equals the moment inside the signed bytes."""
    checkpoint, written = attested
    manifest_envelope = json.loads((checkpoint / "manifest.sig").read_text())
    manifest = json.loads(base64.b64decode(manifest_envelope["payload"]))
    assert manifest_envelope["signatures"][0]["signed_at"] == manifest["signed_at"]
    envelope = json.loads(written.provenance.read_text())
    finished = statement_of(written.provenance)["predicate"]["runDetails"]["metadata"]["finishedOn"]
    assert envelope["signatures"][0]["signed_at"] == finished and finished.endswith("Z")
