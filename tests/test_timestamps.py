"""Trusted time: every signature carries an RFC 3161 timestamp from the time-stamping authority the
settings name (``openssl ts`` answers here, behind a local HTTP server), so revoking a key as of
the moment it leaked keeps its earlier signatures valid and refuses later ones. A stamp from an
authority the trust does not list, one moved from another signature, or a signature made when
the authority cannot be reached: refused, never taken for trusted time. OpenSSF model signatures
(Sigstore bundles) carry the same stamp."""

from __future__ import annotations

import base64
import datetime as dt
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from securesystemslib.dsse import Envelope as SslibEnvelope
from securesystemslib.signer import SSlibKey

from govray.cli import main
from govray.core.dsse import Envelope, sign_envelope, verify_envelope
from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, KeyType, SigningKey, TrustConfig, load_trust, save_trust
from govray.core.timestamps import stamped_at
from govray.provenance.model_signature import ModelSignatureError, sign_model, verify_model_signature
from govray.signer.service import Signer
from govray.train.checkpoints.manifest import MANIFEST_TYPE
from tests.helpers.ports import free_port
from tests.helpers.tsa import LocalTsa

KEY = SigningKey.generate(KeyRole.PLATFORM)
TYPE = "application/vnd.govray.test+json"


@pytest.fixture(scope="module")
def tsa(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTsa]:
    with LocalTsa(tmp_path_factory.mktemp("tsa")) as authority:
        yield authority


@pytest.fixture
def stamping(tsa: LocalTsa, monkeypatch: pytest.MonkeyPatch) -> LocalTsa:
    """The settings name the local authority: every signature made here is stamped."""
    monkeypatch.setenv("GOVRAY_TSA_URL", tsa.url)
    return tsa


def trust_with(tsa: LocalTsa, *revocations: tuple[str, dt.datetime]) -> TrustConfig:
    trust = TrustConfig(keys=[KEY.public_key], timestamp_authorities=[tsa.root_pem])
    for keyid, moment in revocations:
        trust.revoke(keyid, reason="leaked", at=moment)
    return trust


def moment_of(envelope: Envelope, trust: TrustConfig) -> dt.datetime:
    entry = envelope.signatures[0]
    assert entry.timestamp is not None
    return stamped_at(
        base64.b64decode(entry.timestamp), base64.b64decode(entry.sig), trust.timestamp_authorities
    )


def test_every_signature_carries_a_timestamp_its_authority_vouches_for(stamping: LocalTsa) -> None:
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    envelope = sign_envelope(b'{"a": 1}', TYPE, KEY)
    after = dt.datetime.now(dt.UTC)
    trust = trust_with(stamping)
    assert verify_envelope(envelope, trust, KeyRole.PLATFORM, expected_type=TYPE, what="test") == (
        b'{"a": 1}',
        KEY.keyid,
    )
    assert before - dt.timedelta(seconds=1) <= moment_of(envelope, trust) <= after + dt.timedelta(seconds=1)
    # Standard tools still read the envelope (the stamp is a field they keep, unrecognised).
    sslib = SslibEnvelope.from_dict(json.loads(envelope.to_json()))
    assert KEY.keyid in sslib.verify([SSlibKey.from_dict(KEY.keyid, KEY.public_key.sslib_dict())], 1)


def test_the_signers_checkpoint_manifests_are_stamped_too(stamping: LocalTsa, tmp_path: Path) -> None:
    signer = Signer(KEY, tmp_path / "state", check_ledgers=False)  # (a bare step's state: stamping only)
    run_dir = tmp_path / "ray" / "run-a"
    capability, _ = signer.open_run(str(run_dir))
    folder = run_dir / "checkpoint_00000010"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "state.json").write_text('{"step": 10}')  # (the signer seals a state of that step only)
    sealed = signer.seal(capability, str(folder), 10, {})
    assert sealed.envelope.signatures[0].timestamp is not None
    verify_envelope(
        sealed.envelope, trust_with(stamping), KeyRole.PLATFORM, expected_type=MANIFEST_TYPE, what="m"
    )


def test_a_revoked_keys_signatures_stamped_before_the_revocation_verify_and_later_ones_are_refused(
    stamping: LocalTsa, monkeypatch: pytest.MonkeyPatch
) -> None:
    earlier = sign_envelope(b"before the leak", TYPE, KEY)
    leaked_at = moment_of(earlier, trust_with(stamping)) + dt.timedelta(seconds=1)
    while dt.datetime.now(dt.UTC) < leaked_at + dt.timedelta(seconds=1):
        time.sleep(0.1)
    later = sign_envelope(b"after the leak", TYPE, KEY)
    monkeypatch.delenv("GOVRAY_TSA_URL")
    unstamped = sign_envelope(b"no trusted time", TYPE, KEY)
    assert unstamped.signatures[0].timestamp is None
    revoked = trust_with(stamping, (KEY.keyid, leaked_at))
    payload, _ = verify_envelope(earlier, revoked, KeyRole.PLATFORM, expected_type=TYPE, what="earlier")
    assert payload == b"before the leak"
    with pytest.raises(
        SignatureError,
        match=rf"key {KEY.keyid} was revoked at .*\(leaked\), and this signature was stamped at .*, not bef",
    ):
        verify_envelope(later, revoked, KeyRole.PLATFORM, expected_type=TYPE, what="later")
    with pytest.raises(SignatureError, match="carries no trusted timestamp from before then"):
        verify_envelope(unstamped, revoked, KeyRole.PLATFORM, expected_type=TYPE, what="unstamped")


def test_a_stamp_from_an_untrusted_authority_or_moved_from_another_signature_is_refused(
    stamping: LocalTsa, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trust = trust_with(stamping)
    first, second = sign_envelope(b"first", TYPE, KEY), sign_envelope(b"second", TYPE, KEY)
    moved = second.model_copy(
        update={
            "signatures": [
                second.signatures[0].model_copy(update={"timestamp": first.signatures[0].timestamp})
            ]
        }
    )
    with pytest.raises(SignatureError, match="its timestamp does not verify under a trusted authority"):
        verify_envelope(moved, trust, KeyRole.PLATFORM, expected_type=TYPE, what="moved")
    with LocalTsa(tmp_path / "other", name="someone else's authority") as other:
        monkeypatch.setenv("GOVRAY_TSA_URL", other.url)
        foreign = sign_envelope(b"stamped elsewhere", TYPE, KEY)
    with pytest.raises(SignatureError, match="its timestamp does not verify under a trusted authority"):
        verify_envelope(foreign, trust, KeyRole.PLATFORM, expected_type=TYPE, what="foreign")
    with pytest.raises(SignatureError, match="the trust lists no time-stamping authority"):
        verify_envelope(
            first, TrustConfig(keys=[KEY.public_key]), KeyRole.PLATFORM, expected_type=TYPE, what="f"
        )


def test_nothing_is_signed_when_the_authority_cannot_be_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOVRAY_TSA_URL", f"http://127.0.0.1:{free_port()}/")
    with pytest.raises(
        SignatureError, match="the time-stamping authority at http://127.0.0.1:.* did not answer"
    ):
        sign_envelope(b"payload", TYPE, KEY)


def test_the_cli_trusts_an_authority_and_revokes_a_key_as_of_a_moment(tsa: LocalTsa, tmp_path: Path) -> None:
    trust = tmp_path / "trust.yaml"
    save_trust(TrustConfig(keys=[KEY.public_key]), trust)
    root = tmp_path / "root.pem"
    root.write_text(tsa.root_pem)
    assert main(["keys", "trust-tsa", str(root), "--trust", str(trust)]) == 0
    assert load_trust(trust).timestamp_authorities == [tsa.root_pem]
    args = ["keys", "revoke", KEY.keyid, "--trust", str(trust), "--reason", "laptop stolen"]
    assert main([*args, "--at", "2026-11-01T08:00:00"]) == 0
    (revocation,) = load_trust(trust).revoked
    assert revocation.revoked_at == dt.datetime(2026, 11, 1, 8, tzinfo=dt.UTC)
    assert yaml.safe_load(trust.read_text())["revoked"][0]["reason"] == "laptop stolen"
    (tmp_path / "not-a-certificate.pem").write_text("-----BEGIN CERTIFICATE-----\nnope\n")
    assert main(["keys", "trust-tsa", str(tmp_path / "not-a-certificate.pem"), "--trust", str(trust)]) != 0


def test_model_signatures_are_stamped_and_a_revoked_keys_earlier_ones_still_verify(
    stamping: LocalTsa, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The OpenSSF model signature (a Sigstore bundle) carries the authority's timestamp where a
    bundle keeps one; ``model_signing`` still verifies it, and govray checks the stamp: a model
    signature stamped before its key's revocation verifies, a later one is refused, a stamp taken
    from another bundle is refused, and an unstamped one is refused once the key is revoked."""
    model_key = SigningKey.generate(KeyRole.PLATFORM, keytype=KeyType.ECDSA)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    earlier = sign_model(model, tmp_path / "earlier.sig", model_key)
    timestamps = json.loads(earlier.read_text())["verificationMaterial"]["timestampVerificationData"]
    token = base64.b64decode(timestamps["rfc3161Timestamps"][0]["signedTimestamp"])
    leaked_at = stamped_at(token, _bundle_signature(earlier), [stamping.root_pem]) + dt.timedelta(seconds=1)
    while dt.datetime.now(dt.UTC) < leaked_at + dt.timedelta(seconds=1):
        time.sleep(0.1)
    later = sign_model(model, tmp_path / "later.sig", model_key)
    monkeypatch.delenv("GOVRAY_TSA_URL")
    unstamped = sign_model(model, tmp_path / "unstamped.sig", model_key)
    assert "timestampVerificationData" not in json.loads(unstamped.read_text())["verificationMaterial"]
    public = tmp_path / "platform-ecdsa.pub.pem"
    public.write_text(model_key.public_key.public)
    tool = [
        "model_signing",
        "verify",
        "key",
        "--signature",
        str(earlier),
        "--public_key",
        str(public),
        str(model),
    ]
    assert subprocess.run(tool, capture_output=True, text=True).returncode == 0
    trust = TrustConfig(keys=[model_key.public_key], timestamp_authorities=[stamping.root_pem])
    assert verify_model_signature(later, model, trust).signer == model_key.keyid
    trust.revoke(model_key.keyid, reason="leaked", at=leaked_at)
    assert verify_model_signature(earlier, model, trust).files == ("model.safetensors",)
    with pytest.raises(ModelSignatureError, match="was revoked at .*stamped at .*not before then"):
        verify_model_signature(later, model, trust)
    with pytest.raises(ModelSignatureError, match="carries no trusted timestamp from before then"):
        verify_model_signature(unstamped, model, trust)
    moved = json.loads(later.read_text())
    moved["verificationMaterial"]["timestampVerificationData"] = timestamps
    (tmp_path / "moved.sig").write_text(json.dumps(moved))
    with pytest.raises(ModelSignatureError, match="its timestamp does not verify under a trusted authority"):
        verify_model_signature(tmp_path / "moved.sig", model, trust)


def _bundle_signature(bundle: Path) -> bytes:
    return base64.b64decode(json.loads(bundle.read_text())["dsseEnvelope"]["signatures"][0]["sig"])
