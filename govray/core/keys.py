"""Ed25519 keys for the two signing roles, and the trust file that says which keys count.

Roles: the **policy authority** signs depth policies; the **platform** signs checkpoint manifests
and attestations. Key ids are the ones securesystemslib computes (sha256 of the canonical JSON of
``{"keytype", "scheme", "keyval": {"public": hex}}``), so standard verifiers find them.

The trust file (YAML) lists trusted public keys per role; rotation is adding a key to the list,
revocation is an entry in ``revoked``::

    keys:
      - {role: policy-authority, keytype: ed25519, scheme: ed25519, public: 9f2c…, keyid: 4a1b…}
    revoked:
      - {keyid: 77de…, revoked_at: 2026-10-01T00:00:00Z, reason: laptop stolen}
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from govray.core.canonical import canonical_json, sha256_hex
from govray.core.documents import parse_yaml_mapping, read_text
from govray.core.errors import SignatureError, describe_validation_error

KEYTYPE = "ed25519"
SCHEME = "ed25519"


class KeyRole(StrEnum):
    POLICY_AUTHORITY = "policy-authority"
    PLATFORM = "platform"


def compute_keyid(public_hex: str) -> str:
    """The key id securesystemslib gives an Ed25519 key with this raw public key (hex)."""
    return sha256_hex(
        canonical_json({"keytype": KEYTYPE, "scheme": SCHEME, "keyval": {"public": public_hex}})
    )


class PublicKey(BaseModel):
    """A public Ed25519 key as securesystemslib describes it, plus its role."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: KeyRole
    keytype: str = KEYTYPE
    scheme: str = SCHEME
    public: str = Field(pattern=r"^[0-9a-f]{64}$")
    keyid: str = Field(pattern=r"^[0-9a-f]{64}$")
    added_at: dt.datetime | None = None

    @model_validator(mode="after")
    def _keyid_matches(self) -> PublicKey:
        if self.keytype != KEYTYPE or self.scheme != SCHEME:
            raise ValueError(f"only {KEYTYPE}/{SCHEME} keys are supported")
        expected = compute_keyid(self.public)
        if self.keyid != expected:
            raise ValueError(f"keyid {self.keyid} does not match the public key (expected {expected})")
        return self

    def sslib_dict(self) -> dict[str, Any]:
        """The key in securesystemslib's ``SSlibKey.from_dict`` format."""
        return {"keytype": self.keytype, "scheme": self.scheme, "keyval": {"public": self.public}}

    def verify(self, signature: bytes, data: bytes) -> bool:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(self.public))
        try:
            key.verify(signature, data)
        except InvalidSignature:
            return False
        return True


class SigningKey:
    """A private Ed25519 key of one role. Stored as PKCS#8 PEM (mode 0600) beside a ``.pub``."""

    def __init__(self, private: Ed25519PrivateKey, role: KeyRole) -> None:
        self._private = private
        self.role = role
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_key = PublicKey(
            role=role,
            public=raw.hex(),
            keyid=compute_keyid(raw.hex()),
            added_at=dt.datetime.now(dt.UTC).replace(microsecond=0),
        )

    @property
    def keyid(self) -> str:
        return self.public_key.keyid

    @classmethod
    def generate(cls, role: KeyRole) -> SigningKey:
        return cls(Ed25519PrivateKey.generate(), role)

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)

    def save(self, prefix: Path) -> tuple[Path, Path]:
        """Write ``PREFIX.key`` (private, 0600) and ``PREFIX.pub`` (public, YAML); refuse to overwrite."""
        private_path, public_path = prefix.with_suffix(".key"), prefix.with_suffix(".pub")
        for path in (private_path, public_path):
            if path.exists():
                raise SignatureError(f"{path} exists; refusing to overwrite a key")
        prefix.parent.mkdir(parents=True, exist_ok=True)
        pem = self._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        header = f"# govray {self.role.value} key {self.keyid}\n".encode()
        descriptor = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(header + pem)
        public_path.write_text(yaml.safe_dump(self.public_key.model_dump(mode="json"), sort_keys=True))
        return private_path, public_path

    @classmethod
    def load(cls, path: Path) -> SigningKey:
        """Load ``PATH`` (a ``.key`` file written by :meth:`save`)."""
        try:
            text = path.read_bytes()
        except OSError as error:
            raise SignatureError(f"cannot read private key {path}: {error.strerror}") from None
        role = _role_from_header(text, path)
        pem = b"\n".join(line for line in text.splitlines() if not line.startswith(b"#"))
        try:
            private = serialization.load_pem_private_key(pem, password=None)
        except ValueError as error:
            raise SignatureError(f"{path} is not a PEM private key: {error}") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise SignatureError(f"{path} is not an Ed25519 key")
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
    revoked_at: dt.datetime
    reason: str = ""


class TrustConfig(BaseModel):
    """Which public keys are trusted for which role, and which are revoked."""

    model_config = ConfigDict(extra="forbid")

    keys: list[PublicKey] = Field(default_factory=list)
    revoked: list[Revocation] = Field(default_factory=list)

    def trusted_key(self, keyid: str, role: KeyRole) -> PublicKey:
        """The trusted key ``keyid`` for ``role``; ``SignatureError`` if unknown or revoked."""
        for revocation in self.revoked:
            if revocation.keyid == keyid:
                reason = f" ({revocation.reason})" if revocation.reason else ""
                raise SignatureError(
                    f"key {keyid} was revoked at {revocation.revoked_at.isoformat()}{reason}"
                )
        for key in self.keys:
            if key.keyid == keyid and key.role == role:
                return key
        raise SignatureError(f"key {keyid} is not trusted for role '{role.value}'")

    def add(self, key: PublicKey) -> None:
        if any(existing.keyid == key.keyid for existing in self.keys):
            return
        self.keys.append(key)

    def revoke(self, keyid: str, reason: str = "") -> None:
        if not any(key.keyid == keyid for key in self.keys):
            raise SignatureError(f"key {keyid} is not in the trust file")
        if not any(entry.keyid == keyid for entry in self.revoked):
            now = dt.datetime.now(dt.UTC).replace(microsecond=0)
            self.revoked.append(Revocation(keyid=keyid, revoked_at=now, reason=reason))


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


def govray_home() -> Path:
    """Where this machine keeps govray's own keys: ``$GOVRAY_HOME`` or ``~/.govray``."""
    return Path(os.environ.get("GOVRAY_HOME", "~/.govray")).expanduser()


def platform_key_path(home: Path | None = None) -> Path:
    """``HOME/keys/platform.key``: where the platform's private key lives on every node."""
    return (home or govray_home()) / "keys" / "platform.key"


def platform_key(home: Path | None = None) -> SigningKey:
    """The platform's signing key, created on first use at :func:`platform_key_path`.

    On a cluster, provision the same file on every node (it signs checkpoints on rank 0).
    """
    private = platform_key_path(home)
    prefix = private.with_suffix("")
    if not private.exists():
        with contextlib.suppress(SignatureError):  # another process created it first
            SigningKey.generate(KeyRole.PLATFORM).save(prefix)
    key = SigningKey.load(private)
    if key.role != KeyRole.PLATFORM:
        raise SignatureError(f"{private} is a {key.role.value} key, not the platform key")
    return key


def platform_trust(key: SigningKey, extra: TrustConfig | None = None) -> TrustConfig:
    """Trust for the platform role: this platform key plus any platform keys in ``extra``."""
    trust = TrustConfig(keys=[key.public_key], revoked=list(extra.revoked) if extra else [])
    for public in extra.keys if extra else []:
        if public.role == KeyRole.PLATFORM:
            trust.add(public)
    return trust
