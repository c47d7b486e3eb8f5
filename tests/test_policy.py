"""Signed depth policies: what loads, what is refused, and that the refusal names the culprit."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from securesystemslib.dsse import Envelope as SslibEnvelope
from securesystemslib.signer import SSlibKey

from govray.core.errors import PolicyError, SignatureError
from govray.core.keys import KeyRole, SigningKey, TrustConfig, compute_keyid, load_trust, save_trust
from govray.governance.credentials import Credential
from govray.governance.policy import load_verified_policy, parse_policy
from tests.helpers.builders import BASE_CREDENTIAL, write_signed_policy

POLICY: dict[str, Any] = {
    "name": "test",
    "version": 2,
    "adapters": {"pii-lora": {"targets": ["hidden"], "rank": 2}},
    "rules": [
        {"name": "public", "match": {"license_class": ["public-domain", "permissive"]}, "route": "all"},
        {"name": "licensed", "match": {"license_class": "licensed"}, "route": {"depth": {"min": -2}}},
        {"name": "pii", "match": {"sensitivity": "pii"}, "route": {"adapter": "pii-lora"}},
    ],
}


def credential(**fields: Any) -> Credential:
    return Credential.model_validate({**BASE_CREDENTIAL, "corpus_id": "c1", **fields})


@pytest.fixture
def signed(tmp_path: Path, authority_key: SigningKey) -> Path:
    return write_signed_policy(tmp_path, POLICY, authority_key)


def test_signed_policy_verifies_and_names_signer(
    signed: Path, trust: TrustConfig, authority_key: SigningKey
) -> None:
    verified = load_verified_policy(signed, signed.with_name("policy.yaml.sig"), trust)
    assert verified.signature is not None
    assert verified.signature.keyid == authority_key.keyid
    assert verified.signature.policy_version == 2
    assert verified.policy.routes()["licensed"].depth.min == -2  # type: ignore[union-attr]


def test_unsigned_policy_is_refused_unless_allowed(tmp_path: Path, trust: TrustConfig) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(POLICY))
    with pytest.raises(SignatureError, match=r"policy 'test' v2 .* is unsigned"):
        load_verified_policy(path, path.with_name("policy.yaml.sig"), trust)
    allowed = load_verified_policy(path, path.with_name("policy.yaml.sig"), trust, allow_unsigned=True)
    assert allowed.signature is None


def test_tampered_policy_is_refused(signed: Path, trust: TrustConfig) -> None:
    signed.write_text(signed.read_text().replace("min: -2", "min: 0"))
    with pytest.raises(SignatureError, match="policy.yaml .* does not match its signature"):
        load_verified_policy(signed, signed.with_name("policy.yaml.sig"), trust)


def test_tampered_signature_is_refused(signed: Path, trust: TrustConfig) -> None:
    signature_path = signed.with_name("policy.yaml.sig")
    envelope = json.loads(signature_path.read_text())
    raw = bytearray(base64.b64decode(envelope["signatures"][0]["sig"]))
    raw[0] ^= 0x01
    envelope["signatures"][0]["sig"] = base64.b64encode(bytes(raw)).decode()
    signature_path.write_text(json.dumps(envelope))
    with pytest.raises(SignatureError, match="does not verify"):
        load_verified_policy(signed, signature_path, trust)


def test_rewritten_signature_payload_is_refused(signed: Path, trust: TrustConfig) -> None:
    """A tamperer who edits the policy and the digest inside the envelope still fails."""
    signature_path = signed.with_name("policy.yaml.sig")
    envelope = json.loads(signature_path.read_text())
    payload = json.loads(base64.b64decode(envelope["payload"]))
    payload["policy_version"] = 99
    envelope["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    signature_path.write_text(json.dumps(envelope))
    with pytest.raises(SignatureError, match="does not verify"):
        load_verified_policy(signed, signature_path, trust)


def test_untrusted_key_is_refused(tmp_path: Path, trust: TrustConfig) -> None:
    stranger = SigningKey.generate(KeyRole.POLICY_AUTHORITY)
    path = write_signed_policy(tmp_path, POLICY, stranger)
    with pytest.raises(
        SignatureError, match=f"key {stranger.keyid} is not trusted for role 'policy-authority'"
    ):
        load_verified_policy(path, path.with_name("policy.yaml.sig"), trust)


def test_platform_key_cannot_stand_in_for_the_policy_authority(tmp_path: Path) -> None:
    platform = SigningKey.generate(KeyRole.PLATFORM)
    authority_like = SigningKey(platform._private, KeyRole.POLICY_AUTHORITY)  # same key material
    path = write_signed_policy(tmp_path, POLICY, authority_like)
    trust = TrustConfig(keys=[platform.public_key])  # trusted, but only as platform
    with pytest.raises(SignatureError, match="not trusted for role 'policy-authority'"):
        load_verified_policy(path, path.with_name("policy.yaml.sig"), trust)


def test_revoked_key_is_refused(
    signed: Path, trust: TrustConfig, authority_key: SigningKey, tmp_path: Path
) -> None:
    revoked = trust.model_copy(deep=True)
    revoked.revoke(authority_key.keyid, reason="laptop stolen")
    trust_path = tmp_path / "trust-revoked.yaml"
    save_trust(revoked, trust_path)
    with pytest.raises(SignatureError, match=rf"key {authority_key.keyid} was revoked at .*laptop stolen"):
        load_verified_policy(signed, signed.with_name("policy.yaml.sig"), load_trust(trust_path))


def test_rotation_keeps_old_and_new_keys_trusted(tmp_path: Path, trust: TrustConfig) -> None:
    successor = SigningKey.generate(KeyRole.POLICY_AUTHORITY)
    rotated = trust.model_copy(deep=True)
    rotated.add(successor.public_key)
    path = write_signed_policy(tmp_path, POLICY, successor, name="next")
    assert load_verified_policy(path, path.with_name("next.yaml.sig"), rotated).signature is not None


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"name": "p", "version": 1, "rules": []}, r"rules should have at least 1 item"),
        (
            {"name": "p", "version": 1, "rules": [{"name": "r1", "match": {}}]},
            r"rule 'r1' \(rules.0\) has no route",
        ),
        (
            {
                "name": "p",
                "version": 1,
                "rules": [{"name": "r1", "match": {"colour": "red"}, "route": "all"}],
            },
            r"cannot match on 'colour'",
        ),
        (
            {
                "name": "p",
                "version": 1,
                "rules": [{"name": "r1", "match": {"license_class": "publik"}, "route": "all"}],
            },
            r"'publik' is not a valid license_class",
        ),
        (
            {"name": "p", "version": 1, "rules": [{"name": "r1", "route": {"adapter": "lora"}}]},
            r"route 'r1' names adapter 'lora', not declared",
        ),
        (
            {"name": "p", "version": 1, "rules": [{"name": "r1", "route": {}}]},
            r"needs 'params' globs and/or a 'depth' range",
        ),
        (
            {
                "name": "p",
                "version": 1,
                "rules": [{"name": "a", "route": "all"}, {"name": "a", "route": "all"}],
            },
            r"rule names must be unique: a",
        ),
        ({"name": "p", "rules": [{"name": "a", "route": "all"}]}, r"version is required"),
    ],
)
def test_malformed_policies_are_refused_with_the_culprit_named(policy: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy(yaml.safe_dump(policy), source="bad.yaml")


def test_first_matching_rule_wins_and_unmatched_credentials_are_refused() -> None:
    policy = parse_policy(yaml.safe_dump(POLICY), source="p.yaml")
    # Licensed *and* pii: the licensed rule comes first.
    assert policy.route_key_for(credential(license_class="licensed", sensitivity="pii")) == "licensed"
    assert policy.route_key_for(credential(license_class="copyleft", sensitivity="pii")) == "pii"
    with pytest.raises(PolicyError, match=r"corpus 'c1' \(row 17\) matches no rule in policy 'test' v2"):
        policy.route_key_for(credential(license_class="copyleft"), where=" (row 17)")
    with_default = parse_policy(
        yaml.safe_dump({**POLICY, "default": {"params": ["head.*"]}}), source="p.yaml"
    )
    assert with_default.route_key_for(credential(license_class="copyleft")) == "default"


def test_key_ids_are_the_ones_securesystemslib_computes(authority_key: SigningKey) -> None:
    public = authority_key.public_key
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    crypto_key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public.public))
    assert SSlibKey.from_crypto(crypto_key).keyid == public.keyid == compute_keyid(public.public)


def test_policy_signature_verifies_with_securesystemslib(signed: Path, authority_key: SigningKey) -> None:
    """A third party with securesystemslib alone can check the policy signature."""
    envelope = SslibEnvelope.from_dict(json.loads(signed.with_name("policy.yaml.sig").read_text()))
    key = SSlibKey.from_dict(authority_key.keyid, authority_key.public_key.sslib_dict())
    verified = envelope.verify([key], threshold=1)
    assert authority_key.keyid in verified
    import hashlib

    statement = json.loads(envelope.pae()[envelope.pae().index(b"{") :])
    assert statement["policy_sha256"] == hashlib.sha256(signed.read_bytes()).hexdigest()


def test_signing_requires_the_policy_authority_role(tmp_path: Path) -> None:
    platform = SigningKey.generate(KeyRole.PLATFORM)
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(POLICY))
    with pytest.raises(SignatureError, match="policies need a policy-authority key"):
        write_signed_policy(tmp_path, POLICY, platform)


def test_key_files_round_trip_and_refuse_overwrite(tmp_path: Path) -> None:
    key = SigningKey.generate(KeyRole.PLATFORM)
    private, _public = key.save(tmp_path / "keys" / "platform")
    assert private.stat().st_mode & 0o777 == 0o600
    loaded = SigningKey.load(private)
    assert loaded.keyid == key.keyid and loaded.role == KeyRole.PLATFORM
    with pytest.raises(SignatureError, match="refusing to overwrite"):
        key.save(tmp_path / "keys" / "platform")


def test_the_signature_record_carries_the_signing_time_the_signed_payload_holds(signed: Path) -> None:
    envelope = json.loads(signed.with_name(signed.name + ".sig").read_text())
    payload = json.loads(base64.b64decode(envelope["payload"]))
    assert envelope["signatures"][0]["signed_at"].replace("Z", "+00:00") == payload["signed_at"].replace(
        "Z", "+00:00"
    )
