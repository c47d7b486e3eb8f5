"""Signing keys for the two roles, and the trust file that says which keys count.

Roles: the **policy authority** signs depth policies; the **platform** signs checkpoint manifests
and attestations. Those keys are Ed25519. The platform also holds one ECDSA key (NIST P-256),
because the OpenSSF ``model_signing`` tool verifies elliptic-curve keys only: it signs the model
signatures of registered versions (``govray.provenance.model_signature``).

Key ids are the ones securesystemslib computes (sha256 of the canonical JSON of
``{"keytype", "scheme", "keyval": {"public": ...}}``: hex for Ed25519, PEM for ECDSA), so standard
verifiers find them.

The trust file (YAML) lists trusted public keys per role; rotation is adding a key to the list,
revocation is an entry in ``revoked`` (for either key type)::

    keys:
      - {role: policy-authority, keytype: ed25519, scheme: ed25519, public: 9f2c…, keyid: 4a1b…}
      - {role: platform, keytype: ecdsa, scheme: ecdsa-sha2-nistp256, public: "-----BEGIN…", keyid: …}
    revoked:
      - {keyid: 77de…, revoked_at: 2026-10-01T00:00:00Z, reason: laptop stolen}
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import yaml
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from govray.core.canonical import canonical_json, canonical_text, sha256_hex
from govray.core.errors import SignatureError, describe_validation_error
from govray.core.yaml_files import parse_yaml_mapping, read_text

KEYTYPE = "ed25519"
SCHEME = "ed25519"


class KeyRole(StrEnum):
    POLICY_AUTHORITY = "policy-authority"
    PLATFORM = "platform"


class KeyType(StrEnum):
    """``ed25519`` signs govray's DSSE envelopes; ``ecdsa`` (P-256) signs OpenSSF model signatures."""

    ED25519 = "ed25519"
    ECDSA = "ecdsa"


SCHEMES = {KeyType.ED25519: SCHEME, KeyType.ECDSA: "ecdsa-sha2-nistp256"}


class HeldKey(Protocol):
    """A private key held where it cannot be read (a PKCS#11 token, a cloud KMS): it signs, and
    says its public half. ``sign`` answers what ``cryptography`` would: Ed25519's 64 raw bytes, or
    an ECDSA P-256 signature over SHA-256 of ``data`` in DER."""

    def public_key(self) -> Ed25519PublicKey | ec.EllipticCurvePublicKey: ...

    def sign(self, data: bytes) -> bytes: ...


PrivateKey = Ed25519PrivateKey | ec.EllipticCurvePrivateKey | HeldKey


def compute_keyid(public: str, keytype: KeyType = KeyType.ED25519) -> str:
    """The key id securesystemslib gives this public key (Ed25519: raw key in hex; ECDSA: PEM)."""
    scheme = SCHEMES[keytype]
    description = canonical_text({"keytype": keytype.value, "scheme": scheme, "keyval": {"public": public}})
    # securesystemslib's (OLPC) canonical JSON escapes only '"' and '\\' in strings: a PEM's line
    # breaks stay raw bytes there (a PEM holds no backslash, so this undoes exactly JSON's escapes).
    return sha256_hex(description.replace("\\n", "\n").encode())


class PublicKey(BaseModel):
    """A public key as securesystemslib describes it, plus its role."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: KeyRole
    keytype: KeyType = KeyType.ED25519
    scheme: str = SCHEME
    public: str  # Ed25519: the raw key in hex; ECDSA: SubjectPublicKeyInfo PEM
    keyid: str = Field(pattern=r"^[0-9a-f]{64}$")
    added_at: dt.datetime | None = None

    @model_validator(mode="after")
    def _keyid_matches(self) -> PublicKey:
        if (scheme := SCHEMES[self.keytype]) != self.scheme:
            raise ValueError(f"a {self.keytype.value} key's scheme is {scheme}, not {self.scheme}")
        self._crypto_key()  # a malformed key is refused here, not at its first signature
        expected = compute_keyid(self.public, self.keytype)
        if self.keyid != expected:
            raise ValueError(f"keyid {self.keyid} does not match the public key (expected {expected})")
        return self

    def sslib_dict(self) -> dict[str, Any]:
        """The key in securesystemslib's ``SSlibKey.from_dict`` format."""
        return {"keytype": self.keytype.value, "scheme": self.scheme, "keyval": {"public": self.public}}

    def verify(self, signature: bytes, data: bytes) -> bool:
        key = self._crypto_key()
        try:
            if isinstance(key, Ed25519PublicKey):
                key.verify(signature, data)
            else:
                key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            return False
        return True

    def _crypto_key(self) -> Ed25519PublicKey | ec.EllipticCurvePublicKey:
        if self.keytype == KeyType.ED25519:
            if not re.fullmatch(r"[0-9a-f]{64}", self.public):
                raise ValueError("an ed25519 public key is 64 lowercase hex digits")
            return Ed25519PublicKey.from_public_bytes(bytes.fromhex(self.public))
        loaded = serialization.load_pem_public_key(self.public.encode())
        if not isinstance(loaded, ec.EllipticCurvePublicKey) or loaded.curve.name != "secp256r1":
            raise ValueError("an ecdsa public key is a NIST P-256 (secp256r1) key in PEM")
        return loaded


def _public_text(public: Ed25519PublicKey | ec.EllipticCurvePublicKey) -> str:
    if isinstance(public, Ed25519PublicKey):
        return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


class SigningKey:
    """A private key of one role: Ed25519, or (the platform's model-signing key) ECDSA P-256.
    Stored as PKCS#8 PEM (mode 0600) beside a ``.pub`` (and, for ECDSA, a ``.pub.pem`` that
    ``model_signing verify key --public_key`` reads) — or held by a token or a KMS
    (:class:`HeldKey`: it signs there and is never written anywhere)."""

    def __init__(self, private: PrivateKey, role: KeyRole) -> None:
        self._private = private
        self.role = role
        held_public = private.public_key()
        if isinstance(held_public, ec.EllipticCurvePublicKey) and held_public.curve.name != "secp256r1":
            raise SignatureError(f"an ecdsa key is a NIST P-256 key, not {held_public.curve.name}")
        keytype = KeyType.ED25519 if isinstance(held_public, Ed25519PublicKey) else KeyType.ECDSA
        public = _public_text(held_public)
        self.public_key = PublicKey(
            role=role,
            keytype=keytype,
            scheme=SCHEMES[keytype],
            public=public,
            keyid=compute_keyid(public, keytype),
            added_at=dt.datetime.now(dt.UTC).replace(microsecond=0),
        )

    @property
    def keyid(self) -> str:
        return self.public_key.keyid

    @classmethod
    def generate(cls, role: KeyRole, keytype: KeyType = KeyType.ED25519) -> SigningKey:
        if keytype == KeyType.ECDSA:
            return cls(ec.generate_private_key(ec.SECP256R1()), role)
        return cls(Ed25519PrivateKey.generate(), role)

    @property
    def held(self) -> bool:
        """Whether the private key is held by a token or a KMS (it cannot be saved nor read)."""
        return not isinstance(self._private, Ed25519PrivateKey | ec.EllipticCurvePrivateKey)

    def sign(self, data: bytes) -> bytes:
        if isinstance(self._private, Ed25519PrivateKey):
            return self._private.sign(data)
        if isinstance(self._private, ec.EllipticCurvePrivateKey):
            return self._private.sign(data, ec.ECDSA(hashes.SHA256()))
        return self._private.sign(data)

    def save(self, prefix: Path, passphrase: bytes | None = None) -> tuple[Path, Path]:
        """Write ``PREFIX.key`` (private, 0600; encrypted under ``passphrase`` when given: the
        signer's key file) and ``PREFIX.pub`` (public, YAML; an ECDSA key also ``PREFIX.pub.pem``);
        refuse to overwrite."""
        if self.held:
            raise SignatureError(f"key {self.keyid} is held by a token or a KMS: never written to a file")
        private_path = prefix.with_suffix(".key")
        if private_path.exists():
            raise SignatureError(f"{private_path} exists; refusing to overwrite a key")
        assert isinstance(self._private, Ed25519PrivateKey | ec.EllipticCurvePrivateKey)
        pem = self._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption(),
        )
        public_path = self.save_public(prefix)
        header = f"# govray {self.role.value} key {self.keyid}\n".encode()
        descriptor = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(header + pem)
        return private_path, public_path

    def save_public(self, prefix: Path) -> Path:
        """Write the public half only: ``PREFIX.pub`` (YAML; an ECDSA key also ``PREFIX.pub.pem``,
        what ``model_signing verify key`` reads); refuse to overwrite."""
        public_path, pem_path = prefix.with_suffix(".pub"), prefix.with_suffix(".pub.pem")
        for path in (public_path, pem_path):
            if path.exists():
                raise SignatureError(f"{path} exists; refusing to overwrite a key")
        prefix.parent.mkdir(parents=True, exist_ok=True)
        public_path.write_text(yaml.safe_dump(self.public_key.model_dump(mode="json"), sort_keys=True))
        if self.public_key.keytype == KeyType.ECDSA:
            pem_path.write_text(self.public_key.public)
        return public_path

    @classmethod
    def load(cls, path: Path, passphrase: bytes | None = None) -> SigningKey:
        """Load ``PATH`` (a ``.key`` file written by :meth:`save`; an encrypted one needs its
        ``passphrase``, and a wrong or missing one is refused)."""
        try:
            text = path.read_bytes()
        except OSError as error:
            raise SignatureError(f"cannot read private key {path}: {error.strerror}") from None
        role = _role_from_header(text, path)
        pem = b"\n".join(line for line in text.splitlines() if not line.startswith(b"#"))
        try:
            private = serialization.load_pem_private_key(pem, password=passphrase or None)
        except TypeError:  # encrypted without a passphrase given, or a passphrase for a plain key
            state = "encrypted: its passphrase is needed" if passphrase is None else "not encrypted"
            raise SignatureError(f"{path}: the key is {state}") from None
        except ValueError as error:
            raise SignatureError(
                f"{path} is not a PEM private key (or the passphrase is wrong): {error}"
            ) from None
        if isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp256r1":
            return cls(private, role)
        if not isinstance(private, Ed25519PrivateKey):
            raise SignatureError(f"{path} is neither an Ed25519 nor an ECDSA P-256 key")
        return cls(private, role)


def _role_from_header(text: bytes, path: Path) -> KeyRole:
    first = text.split(b"\n", 1)[0].decode(errors="replace").split()
    if len(first) >= 3 and first[:2] == ["#", "govray"]:
        try:
            return KeyRole(first[2])
        except ValueError:
            pass
    raise SignatureError(f"{path}: missing '# govray ROLE key KEYID' header naming the key's role")


class Revocation(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keyid: str = Field(pattern=r"^[0-9a-f]{64}$")
    revoked_at: dt.datetime  # a moment without a zone (a hand-written trust file) is UTC
    reason: str = ""

    @field_validator("revoked_at")
    @classmethod
    def _in_utc(cls, moment: dt.datetime) -> dt.datetime:
        return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)


# What a refusal by an untrusted key tells the user to do about it.
_HOW_TO_TRUST = {
    KeyRole.PLATFORM: "to trust the platform keys of the machine that signed it, run "
    "`govray keys trust-platform --trust TRUST_FILE` there",
    KeyRole.POLICY_AUTHORITY: "sign the policy with a policy-authority key of the trust file; "
    "`govray keys list --trust TRUST_FILE` lists them",
}


class TrustConfig(BaseModel):
    """Which public keys are trusted for which role, and which are revoked."""

    model_config = ConfigDict(extra="forbid")

    keys: list[PublicKey] = Field(default_factory=list)
    revoked: list[Revocation] = Field(default_factory=list)
    # PEM root certificates of the RFC 3161 time-stamping authorities whose timestamps give a
    # signature its trusted time (what tells a signature made before a key's revocation from one
    # made after it).
    timestamp_authorities: list[str] = Field(default_factory=list)

    def trusted_key(self, keyid: str, role: KeyRole, stamped: dt.datetime | None = None) -> PublicKey:
        """The trusted key ``keyid`` for ``role``; ``SignatureError`` if unknown, or revoked as of a
        moment at or before ``stamped`` (the trusted time of the signature: its RFC 3161
        timestamp; None, a signature without one, is refused once its key is revoked at all)."""
        for revocation in self.revoked:
            if revocation.keyid == keyid and (stamped is None or stamped >= revocation.revoked_at):
                reason = f" ({revocation.reason})" if revocation.reason else ""
                when = (
                    "and this signature carries no trusted timestamp from before then"
                    if stamped is None
                    else f"and this signature was stamped at {stamped.isoformat()}, not before then"
                )
                raise SignatureError(
                    f"key {keyid} was revoked at {revocation.revoked_at.isoformat()}{reason}, {when}"
                )
        for key in self.keys:
            if key.keyid == keyid and key.role == role:
                return key
        raise SignatureError(f"key {keyid} is not trusted for role '{role.value}' ({_HOW_TO_TRUST[role]})")

    def add(self, key: PublicKey) -> None:
        if any(existing.keyid == key.keyid for existing in self.keys):
            return
        self.keys.append(key)

    def revoke(self, keyid: str, reason: str = "", at: dt.datetime | None = None) -> None:
        """Revoke ``keyid`` as of ``at`` (default now): signatures stamped before it stay valid."""
        if not any(key.keyid == keyid for key in self.keys):
            raise SignatureError(f"key {keyid} is not in the trust file")
        if not any(entry.keyid == keyid for entry in self.revoked):
            moment = at if at is not None else dt.datetime.now(dt.UTC).replace(microsecond=0)
            self.revoked.append(Revocation(keyid=keyid, revoked_at=moment, reason=reason))


def trust_root(trust: TrustConfig) -> bytes:
    """The public trust root ``trust`` is: canonical JSON of its keys (role, type, scheme, public
    key, keyid; not when each was added), revocations and time-stamping authorities, each list in a
    fixed order. ``govray keys export-root`` writes these bytes; an attestation cites their
    sha256 (``trust_root_sha256``), so a third party checks it verifies against the same root.
    The bytes are a trust file ``load_trust`` reads."""
    keys = sorted(
        (key.model_dump(mode="json", exclude={"added_at"}) for key in trust.keys),
        key=lambda entry: (entry["keyid"], entry["role"]),
    )
    revoked = sorted((entry.model_dump(mode="json") for entry in trust.revoked), key=canonical_text)
    return canonical_json(
        {"keys": keys, "revoked": revoked, "timestamp_authorities": sorted(trust.timestamp_authorities)}
    )


def trust_root_sha256(trust: TrustConfig) -> str:
    """The digest attestations cite of the root they were made under (``trust_root``)."""
    return sha256_hex(trust_root(trust))


def load_trust(path: Path) -> TrustConfig:
    text = read_text(path, SignatureError, "trust file")
    raw = parse_yaml_mapping(
        text, str(path), SignatureError, "a trust file is a mapping with 'keys' and 'revoked'"
    )
    try:
        return TrustConfig.model_validate(raw)
    except ValidationError as error:
        raise SignatureError(f"{path}: invalid trust file: {describe_validation_error(error)}") from None


def save_trust(trust: TrustConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(trust.model_dump(mode="json"), sort_keys=False))


def govray_home(environ: Mapping[str, str] | None = None) -> Path:
    """Where this machine keeps govray's own files (keys, settings, logs): ``$GOVRAY_HOME`` or
    ``~/.govray``."""
    environ = os.environ if environ is None else environ
    return Path(environ.get("GOVRAY_HOME") or "~/.govray").expanduser()


def platform_key_path(home: Path | None = None, keytype: KeyType = KeyType.ED25519) -> Path:
    """``HOME/keys/platform.key`` (Ed25519) or ``HOME/keys/platform-ecdsa.key`` (the model-signing
    key): where the platform's private keys live on every node."""
    name = "platform.key" if keytype == KeyType.ED25519 else "platform-ecdsa.key"
    return (home or govray_home()) / "keys" / name


def platform_key(home: Path | None = None, keytype: KeyType = KeyType.ED25519) -> SigningKey:
    """This machine's platform private key of ``keytype`` (:func:`platform_key_path`): what the
    development signer signs with (a deployment's signer holds its own: ``govray signer init``).
    Never created on use: ``govray keys init`` creates it (:func:`init_platform_keys`)."""
    private = platform_key_path(home, keytype)
    if not private.exists():
        raise SignatureError(
            f"no platform key at {private}: create this machine's platform keys once with "
            "`govray keys init` (or name a deployed signer in the settings: signer.socket)"
        )
    key = SigningKey.load(private)
    if key.role != KeyRole.PLATFORM:
        raise SignatureError(f"{private} is a {key.role.value} key, not the platform key")
    if key.public_key.keytype != keytype:
        raise SignatureError(f"{private} is a {key.public_key.keytype.value} key, not {keytype.value}")
    return key


def platform_public_key(home: Path | None = None, keytype: KeyType = KeyType.ED25519) -> PublicKey | None:
    """This machine's platform public key of ``keytype`` (``HOME/keys/platform.pub``), or None:
    all that verifying needs (a verifier never reads a private key)."""
    public = platform_key_path(home, keytype).with_suffix(".pub")
    if not public.is_file():
        return None
    try:
        text = read_text(public, SignatureError, "public key")
        document = parse_yaml_mapping(text, str(public), SignatureError, "a public key")
        key = PublicKey.model_validate(document)
    except ValidationError as error:
        raise SignatureError(f"{public}: not a public key ({describe_validation_error(error)})") from None
    if key.role != KeyRole.PLATFORM or key.keytype != keytype:
        raise SignatureError(
            f"{public} is a {key.role.value} {key.keytype.value} key, not the platform's {keytype.value}"
        )
    return key


def platform_trust(key: SigningKey | PublicKey | None, extra: TrustConfig | None = None) -> TrustConfig:
    """Trust for the platform role: this platform key (its public half; None: none of this
    machine's) plus any platform keys in ``extra`` (and its revocations and time-stamping
    authorities)."""
    public = key.public_key if isinstance(key, SigningKey) else key
    trust = TrustConfig(
        keys=[public] if public is not None else [],
        revoked=list(extra.revoked) if extra else [],
        timestamp_authorities=list(extra.timestamp_authorities) if extra else [],
    )
    for public in extra.keys if extra else []:
        if public.role == KeyRole.PLATFORM:
            trust.add(public)
    return trust
