"""OpenSSF model signatures: what the ``model_signing`` tool (the ``model-signing`` package, v1.x)
verifies, made and checked with that package's own signer and verifier.

A signature is a Sigstore bundle holding a DSSE envelope over an in-toto statement of predicate
type ``https://model_signing/signature/v1.0`` that lists every file of the model directory by
sha256. ``model_signing`` verifies elliptic-curve keys only, so it is signed with the platform's
ECDSA P-256 key (``KeyType.ECDSA``), trusted, rotated and revoked in the trust file under the
platform role like the Ed25519 keys. Anyone verifies it without govray::

    model_signing verify key --signature SIG --public_key platform-ecdsa.pub.pem MODEL_DIR

``verify_model_signature`` does the same and also asks the trust file: the key must be trusted
for the platform role and not revoked — as of the signature's trusted time: where the settings name
a time-stamping authority, the bundle carries its RFC 3161 timestamp of the signature (where a
Sigstore bundle keeps one), so a key revoked as of a moment keeps the model signatures stamped
before it.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import json
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from govray.core.errors import GovrayError, SignatureError
from govray.core.keys import KeyRole, KeyType, PublicKey, SigningKey, TrustConfig
from govray.core.settings import load_settings
from govray.core.timestamps import stamp, stamped_at

PREDICATE_TYPE = "https://model_signing/signature/v1.0"
BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle"  # followed by .v0.3+json (any version)
SIGNATURE_SUFFIX = "model-signing.sig"


class ModelSignatureError(GovrayError):
    """A model signature cannot be made, or does not verify (the message says what broke)."""

    exit_code = 16


@dataclass(frozen=True)
class VerifiedModelSignature:
    signer: str  # the key id (securesystemslib's) of the trusted platform ECDSA key
    files: tuple[str, ...]  # every signed file, relative to the model directory


def sign_model(
    directory: Path,
    signature: Path,
    key: SigningKey,
    expected: Mapping[str, str | None] | None = None,
    optional: Collection[str] = (),
) -> Path:
    """Sign every file of ``directory`` with ``key`` (an ECDSA P-256 platform key, in a file or held
    by a token or a KMS) into ``signature`` (outside the directory: a checkpoint's signed manifest
    admits no extra file). ``model_signing``'s own elliptic-key signer builds the bundle; its
    private-key operations are ``key``'s (the key is never written anywhere). ``expected``: the
    files the folder held when it was verified, by sha256 (None: any bytes): ``model_signing``
    hashes the folder again, and a bundle over other files or other bytes (one swapped after the
    verification) is refused, not returned; ``optional``: those of them the folder may lack (a
    frozen base kept in the run's base store, put in the folder only when it is signed)."""
    if key.public_key.keytype != KeyType.ECDSA or key.role != KeyRole.PLATFORM:
        raise ModelSignatureError(
            f"key {key.keyid} is a {key.role.value} {key.public_key.keytype.value} key; model signatures "
            "take the platform's ecdsa key (model_signing verifies elliptic-curve keys only)"
        )
    signature.parent.mkdir(parents=True, exist_ok=True)
    import model_signing  # Sigstore's stack, ~1 s at import: only where a model is signed

    config = model_signing.signing.Config()
    config._signer = _held_key_signer(key)  # (the one signer model_signing lets a caller choose by key)
    config.sign(directory, signature)
    if expected is not None:
        _refuse_other_files(signature, directory, expected, frozenset(optional))
    authority = load_settings().timestamping.url
    if authority:
        _stamp_bundle(signature, authority)
    return signature


def _refuse_other_files(
    signature: Path, directory: Path, expected: Mapping[str, str | None], optional: frozenset[str]
) -> None:
    statement = json.loads(base64.b64decode(read_bundle(signature)["dsseEnvelope"]["payload"]))
    signed = {str(r["name"]): str(r["digest"]) for r in statement["predicate"]["resources"]}
    differing = sorted(
        name
        for name in set(signed) | set(expected)
        if name not in expected
        or (name not in signed and name not in optional)
        or (name in signed and expected[name] not in (None, signed[name]))
    )
    if differing:
        signature.unlink()
        raise ModelSignatureError(
            f"{directory}: its files changed after it was verified ({', '.join(differing)}): no model "
            "signature is made over them"
        )


def _stamp_bundle(signature: Path, authority: str) -> None:
    """Add the authority's RFC 3161 timestamp of the bundle's signature where a Sigstore bundle
    carries one (``verificationMaterial.timestampVerificationData.rfc3161Timestamps``): the
    signature's trusted time, as a DSSE envelope's ``timestamp`` is (``model_signing`` keeps
    verifying the bundle; ``verify_model_signature`` checks the stamp)."""
    bundle = read_bundle(signature)
    token = stamp(_raw_signature(bundle, signature), authority)
    material = bundle.setdefault("verificationMaterial", {})
    material["timestampVerificationData"] = {
        "rfc3161Timestamps": [{"signedTimestamp": base64.b64encode(token).decode()}]
    }
    signature.write_text(json.dumps(bundle))


def _held_key_signer(key: SigningKey) -> Any:
    """``model_signing``'s elliptic-key signer whose private-key operations are ``key.sign``."""
    from model_signing._signing import sign_ec_key

    class _Operations:  # what that signer asks of a ``cryptography`` private key
        def public_key(self) -> ec.EllipticCurvePublicKey:
            loaded = serialization.load_pem_public_key(key.public_key.public.encode())
            assert isinstance(loaded, ec.EllipticCurvePublicKey)
            return loaded

        def sign(self, data: bytes, algorithm: ec.ECDSA) -> bytes:
            if not isinstance(algorithm.algorithm, hashes.SHA256):
                raise ModelSignatureError(f"a P-256 key signs SHA-256, not {algorithm.algorithm!r}")
            return key.sign(data)

    signer = sign_ec_key.Signer.__new__(sign_ec_key.Signer)  # (its __init__ reads a PEM file)
    signer._private_key = _Operations()  # type: ignore[assignment]
    return signer


def verify_model_signature(signature: Path, model_dir: Path, trust: TrustConfig) -> VerifiedModelSignature:
    """Check ``signature`` with ``model_signing``'s verifier against ``model_dir`` (any changed,
    added or removed file is refused) under a trusted, unrevoked platform ECDSA key."""
    bundle = read_bundle(signature)
    key = _signing_key(bundle, trust, signature, _stamped(bundle, trust, signature))
    with tempfile.TemporaryDirectory() as scratch:
        public = Path(scratch) / "platform.pub.pem"
        public.write_text(key.public)
        import model_signing  # (see sign_model)

        try:
            model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public).verify(
                model_dir, signature
            )
        except Exception as error:  # model_signing refuses with ValueError, protobuf and I/O errors alike
            raise ModelSignatureError(f"model signature {signature} refuses {model_dir}: {error}") from None
    return VerifiedModelSignature(signer=key.keyid, files=signed_files(bundle))


def is_model_signature(path: Path) -> bool:
    """Whether ``path`` holds a Sigstore bundle (what ``model_signing`` writes), not a DSSE envelope."""
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(document, dict) and str(document.get("mediaType", "")).startswith(BUNDLE_MEDIA_TYPE)


def read_bundle(path: Path) -> dict[str, Any]:
    """The bundle as JSON, read WITHOUT verifying it (``verify_model_signature`` verifies)."""
    try:
        document = json.loads(path.read_text())
    except OSError as error:
        raise ModelSignatureError(f"cannot read {path}: {error.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelSignatureError(f"{path}: not a JSON Sigstore bundle: {error}") from None
    if not isinstance(document, dict) or not isinstance(document.get("dsseEnvelope"), dict):
        raise ModelSignatureError(f"{path}: not a Sigstore bundle with a DSSE envelope")
    return document


def signed_files(bundle: dict[str, Any]) -> tuple[str, ...]:
    """The file names the bundle's statement lists (read from the payload, not verified)."""
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    return tuple(resource["name"] for resource in statement["predicate"]["resources"])


def key_hint(key: PublicKey) -> str:
    """What ``model_signing`` records to name its key: sha256 of the SubjectPublicKeyInfo PEM."""
    loaded = serialization.load_pem_public_key(key.public.encode())
    pem = loaded.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def _raw_signature(bundle: dict[str, Any], path: Path) -> bytes:
    try:
        return base64.b64decode(bundle["dsseEnvelope"]["signatures"][0]["sig"], validate=True)
    except (KeyError, IndexError, TypeError, binascii.Error):
        raise ModelSignatureError(f"{path}: its DSSE envelope holds no readable signature") from None


def _stamped(bundle: dict[str, Any], trust: TrustConfig, path: Path) -> dt.datetime | None:
    """The trusted time of the bundle's signature: its RFC 3161 timestamp's, checked (None: it
    carries none). A stamp that does not verify is refused, never taken as no stamp."""
    material = bundle.get("verificationMaterial")
    timestamps = material.get("timestampVerificationData") if isinstance(material, dict) else None
    if not timestamps:
        return None
    try:
        (entry,) = timestamps["rfc3161Timestamps"]
        token = base64.b64decode(entry["signedTimestamp"], validate=True)
    except (KeyError, TypeError, ValueError, binascii.Error):
        raise ModelSignatureError(
            f"model signature {path}: its timestamp is not one readable stamp"
        ) from None
    try:
        return stamped_at(token, _raw_signature(bundle, path), trust.timestamp_authorities)
    except SignatureError as error:
        raise ModelSignatureError(f"model signature {path}: {error}") from None


def _signing_key(
    bundle: dict[str, Any], trust: TrustConfig, path: Path, stamped: dt.datetime | None
) -> PublicKey:
    hint = bundle.get("verificationMaterial", {}).get("publicKey", {}).get("hint", "")
    for candidate in trust.keys:
        if candidate.keytype == KeyType.ECDSA and key_hint(candidate) == hint:
            try:
                return trust.trusted_key(candidate.keyid, KeyRole.PLATFORM, stamped)
            except SignatureError as error:
                raise ModelSignatureError(f"model signature {path}: {error}") from None
    raise ModelSignatureError(
        f"model signature {path}: its key (hint {hint or 'none'}) is no ecdsa key in the trust file"
    )
