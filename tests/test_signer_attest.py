"""Attestations are made by the platform's signer, never by the process that asks for them: a run's
launch (which imports the trial), ``govray attest`` and ``model register`` load no key. The signer
verifies the checkpoint itself, builds the statements from what verified and signs them; only the
operator's OS users may ask, and a request can name a checkpoint and nothing it would sign."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from threading import Thread

import pytest

from govray.core import keys as keys_module
from govray.core.canonical import file_sha256
from govray.core.errors import AttestationError, SignatureError
from govray.core.keys import KeyType, platform_key
from govray.core.settings import operator_trust
from govray.core.signer_wire import WireError, parse_request
from govray.provenance.model_signature import verify_model_signature
from govray.provenance.verify import verify_attestation
from govray.signer.attesting import attest
from govray.signer.server import SignerServer
from govray.signer.service import Signer
from govray.tracking.lineage import checkpoints
from govray.train.checkpoints.files import verify_checkpoint
from govray.train.checkpoints.manifest import CheckpointError
from govray.train.checkpoints.signer import SignerClient
from tests.helpers.attest import copied_checkpoint
from tests.helpers.golden import GOLDEN_STEPS, GoldenRun, final_checkpoint
from tests.helpers.signing import dev_signer_record


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (a Unix socket's path is at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ga-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def serving(directory: Path, open_uids: frozenset[int] | None = None) -> SignerServer:
    """A signer with this machine's platform keys on a socket in ``directory``, served by a thread."""
    state = dev_signer_record(directory / "state")  # (it attests what the session's signer sealed)
    signer = Signer(platform_key(), state, platform_key(keytype=KeyType.ECDSA))
    server = SignerServer(signer, directory / "s.sock", open_uids)
    Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_asking_process_loads_no_key_and_the_signers_statements_verify(
    golden_run: GoldenRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``attest`` (what the launch, ``govray attest`` and ``model register`` call) with every way to
    a private key in this process made to fail: the signer, another process, makes the statements
    and the model signature, and they verify under the operator's trust."""
    golden = final_checkpoint(golden_run.outcome.run_dir)
    trust = operator_trust()
    row = next(
        c
        for c in checkpoints(golden_run.store, golden_run.outcome.trial_id)
        if Path(c.path).resolve() == golden.resolve()
    )
    checkpoint = copied_checkpoint(golden, tmp_path / "storage")  # (a model signature may add the base file)

    def no_key(*args: object, **kwargs: object) -> None:
        raise AssertionError("the asking process loaded a private key")

    monkeypatch.setattr(keys_module.SigningKey, "load", no_key)
    monkeypatch.setattr(keys_module.SigningKey, "generate", no_key)
    written = attest(
        checkpoint,
        model_signature=True,
        recorded_manifest=row.manifest_digest,
        destination=tmp_path / "attested" / checkpoint.name,
    )
    monkeypatch.undo()
    for path, kind in ((written.provenance, "provenance"), (written.coverage, "coverage")):
        verified = verify_attestation(path, model_dir=checkpoint, trust=trust, expected_kind=kind)
        assert verified.signer == platform_key().keyid
    assert written.model_signature is not None
    trust.add(platform_key(keytype=KeyType.ECDSA).public_key)  # (the model-signing key)
    signed = verify_model_signature(written.model_signature, checkpoint, trust)
    assert signed.signer == platform_key(keytype=KeyType.ECDSA).keyid


def test_only_the_operators_os_users_have_a_checkpoint_attested(
    golden_run: GoldenRun, short_dir: Path
) -> None:
    """The same request: answered for the signer's own OS user, refused for any other (the kernel
    names the peer), nothing written either way but what the asking side writes."""
    checkpoint = str(final_checkpoint(golden_run.outcome.run_dir).resolve())
    own = serving(short_dir / "own")
    try:
        answer = SignerClient(own.path).attest(checkpoint, None, False)
        assert sorted(answer["envelopes"]) == ["coverage", "provenance"]
    finally:
        own.shutdown()
        own.server_close()
    other = serving(short_dir / "other", frozenset({os.getuid() + 1}))
    try:
        with pytest.raises(SignatureError, match=rf"OS user {os.getuid()} may seal .* not attest"):
            SignerClient(other.path).attest(checkpoint, None, False)
    finally:
        other.shutdown()
        other.server_close()


@pytest.mark.parametrize(
    ("request_", "refusal"),
    [
        ({"op": "attest", "checkpoint": "runs/x/checkpoint_00000010"}, None),  # parsed; refused by the signer
        ({"op": "attest", "checkpoint": "/s/ray/run/checkpoint_00000010", "statement": "e30="}, "statement"),
        (
            {"op": "attest", "checkpoint": "/s/ray/run/checkpoint_00000010", "recorded_manifest": "abc"},
            "pattern",
        ),
        ({"op": "attest", "checkpoint": "/s/c", "capability": "x"}, "capability"),
    ],
)
def test_an_attest_request_names_a_checkpoint_and_nothing_the_signer_would_sign(
    request_: dict[str, object], refusal: str | None
) -> None:
    frame = json.dumps(request_).encode()
    if refusal is None:
        assert parse_request(frame).op == "attest"
        return
    with pytest.raises(WireError, match=refusal):
        parse_request(frame)


def test_the_signer_refuses_a_relative_checkpoint_and_a_model_signature_it_holds_no_key_for(
    golden_run: GoldenRun, short_dir: Path
) -> None:
    checkpoint = final_checkpoint(golden_run.outcome.run_dir).resolve()
    signer = Signer(platform_key(), dev_signer_record(short_dir / "state"))  # no model-signing key
    with pytest.raises(SignatureError, match="absolute path"):
        signer.attest(os.path.relpath(checkpoint))
    with pytest.raises(SignatureError, match="no model-signing key"):
        signer.attest(str(checkpoint), model_signature=True)
    assert sorted(signer.attest(str(checkpoint)).envelopes) == ["coverage", "provenance"]


def test_a_tampered_checkpoint_is_refused_by_the_signer_with_its_own_kind(
    golden_run: GoldenRun, tmp_path: Path
) -> None:
    """The refusal crosses the socket as what it is (``AttestationError``: its exit code), and
    nothing is written."""
    storage = tmp_path / "storage"
    copy = copied_checkpoint(final_checkpoint(golden_run.outcome.run_dir), storage)
    model = copy / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 1
    model.write_bytes(bytes(data))
    with pytest.raises(
        AttestationError, match="the signer refused: refusing to attest: .*sha256 does not match"
    ):
        attest(copy)
    assert not (storage / "attestations").exists()


def test_what_is_attested_is_what_verified_not_what_lies_there_a_moment_later(
    golden_run: GoldenRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the signer's verification and its statement, the engineer (who can write the folder)
    plants an adapter and flips a byte of the base: the statement names the files and digests that
    verified, never the planted ones."""
    from govray.provenance import attest as attest_module
    from govray.provenance.attest import sign_attestation

    checkpoint = copied_checkpoint(final_checkpoint(golden_run.outcome.run_dir), tmp_path / "storage")
    verified = attest_module.load_checkpoint

    def then_swapped(directory: Path, trust: object) -> object:
        loaded = verified(directory, trust)  # type: ignore[arg-type]
        (directory / "adapter-planted.safetensors").write_bytes(b"planted")
        model = directory / "model.safetensors"
        data = bytearray(model.read_bytes())
        data[-1] ^= 1
        model.write_bytes(bytes(data))
        return loaded

    monkeypatch.setattr(attest_module, "load_checkpoint", then_swapped)
    listed = json.loads((checkpoint / "manifest.json").read_text())["files"]
    signed = sign_attestation(checkpoint, platform_key(), operator_trust())
    assert "adapter-planted.safetensors" not in signed.subjects
    assert signed.subjects == {name: listed[name] for name in signed.subjects}


def test_the_signer_attests_only_checkpoints_it_sealed_that_still_stand_in_its_record(
    golden_run: GoldenRun, short_dir: Path, tmp_path: Path
) -> None:
    """What verifies under the platform's key is not enough: a checkpoint sealed with that key
    outside this signer (a copy of the key elsewhere, a tool's in-process seal), or one a later
    going-back seal of its run superseded (the trial broke its checkpoint, had the step sealed
    again, then put its kept copy of the old one back), is refused as exit 10; what it sealed and
    still stands is attested."""
    golden = final_checkpoint(golden_run.outcome.run_dir)
    signer = Signer(platform_key(), short_dir / "state")  # a record of its own, empty
    elsewhere = copied_checkpoint(golden, tmp_path / "elsewhere")  # sealed by the dev signer, not by this one
    assert verify_checkpoint(elsewhere, operator_trust())[1] == platform_key().keyid
    with pytest.raises(CheckpointError, match="is not one the platform's signer sealed"):
        signer.attest(str(elsewhere))
    # This signer seals the step itself, in a run of its own.
    folder = copied_checkpoint(golden, tmp_path / "storage")
    capability, _ = signer.open_run(str(folder.parent), file_sha256(folder / "run.json"))
    first = resealed(signer, capability, folder, GOLDEN_STEPS)
    assert sorted(signer.attest(str(folder)).envelopes) == ["coverage", "provenance"]
    kept = Path(shutil.copytree(folder, tmp_path / "kept"))
    shutil.rmtree(folder)  # broken on purpose: the step may be sealed again
    shutil.copytree(kept, folder)
    (folder / "adapter-extra.safetensors").write_bytes(b"changed since")  # no longer stands
    second = resealed(signer, capability, folder, GOLDEN_STEPS)
    assert first != second
    shutil.rmtree(folder)
    shutil.copytree(kept, folder)  # the superseded one put back: it verifies, and is refused
    assert verify_checkpoint(folder, operator_trust())[1] == platform_key().keyid
    with pytest.raises(CheckpointError, match="or a later seal of its run superseded it"):
        signer.attest(str(folder))


def resealed(signer: Signer, capability: str, folder: Path, step: int) -> bytes:
    """``folder`` sealed by ``signer`` at ``step`` (its old manifest and signature replaced)."""
    for name in ("manifest.json", "manifest.sig"):
        (folder / name).unlink(missing_ok=True)
    sealed = signer.seal(capability, str(folder), step, {})
    (folder / "manifest.json").write_bytes(sealed.manifest)
    (folder / "manifest.sig").write_text(sealed.envelope.to_json())
    return sealed.manifest
