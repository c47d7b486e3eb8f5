"""DSSE envelopes (https://github.com/secure-systems-lab/dsse), signed with Ed25519.

govray signs every document a third party must check — policy signatures now, manifests and
attestations later — as a DSSE envelope: the signature covers the pre-authentication encoding
``PAE(payloadType, payload)``, so securesystemslib's ``Envelope.verify`` accepts govray's
envelopes without govray's code.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from govray.core.errors import SignatureError, describe_validation_error
from govray.core.keys import KeyRole, SigningKey, TrustConfig
from govray.core.timestamps import stamp, stamped_at


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


class EnvelopeSignature(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keyid: str
    sig: str  # base64
    # When it was signed (UTC). Every payload govray signs holds the same moment inside the signed
    # bytes (a policy signature's and a manifest's signed_at, a statement's finishedOn); this copy
    # is for readers and standard tools (securesystemslib keeps it as an unrecognised field).
    signed_at: dt.datetime | None = None
    # An RFC 3161 timestamp of ``sig`` (base64 DER TimeStampResponse) from the time-stamping
    # authority the signer's settings name: the signature's trusted time (``govray.core.timestamps``).
    timestamp: str | None = None


class Envelope(BaseModel):
    """A DSSE envelope as JSON: ``{"payload", "payloadType", "signatures"}``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    payload: str  # base64
    payload_type: str = Field(alias="payloadType")
    signatures: list[EnvelopeSignature]

    def payload_bytes(self) -> bytes:
        try:
            return base64.b64decode(self.payload, validate=True)
        except binascii.Error as error:
            raise SignatureError(f"envelope payload is not base64: {error}") from None

    def to_json(self) -> str:
        document = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        return json.dumps(document, indent=2, sort_keys=True) + "\n"


def signing_time() -> dt.datetime:
    """Now, in UTC, to the second: the signing time recorded in payloads and signature records."""
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def sign_envelope(
    payload: bytes, payload_type: str, key: SigningKey, signed_at: dt.datetime | None = None
) -> Envelope:
    """Sign ``payload`` (its PAE) with ``key``; the record carries ``signed_at`` (default: now)
    and, when the settings name a time-stamping authority (``timestamping.url``), its RFC 3161
    timestamp of the signature (``SignatureError`` when it cannot be had: nothing is signed
    without the trusted time the operator asked for)."""
    from govray.core.settings import load_settings

    signature = key.sign(pae(payload_type, payload))
    authority = load_settings().timestamping.url
    record = EnvelopeSignature(
        keyid=key.keyid,
        sig=base64.b64encode(signature).decode(),
        signed_at=signed_at if signed_at is not None else signing_time(),
        timestamp=base64.b64encode(stamp(signature, authority)).decode() if authority else None,
    )
    return Envelope(payload=base64.b64encode(payload).decode(), payloadType=payload_type, signatures=[record])


def verify_envelope(
    envelope: Envelope, trust: TrustConfig, role: KeyRole, *, expected_type: str, what: str
) -> tuple[bytes, str]:
    """Return (payload, keyid) if a signature verifies under a trusted, unrevoked ``role`` key.

    ``what`` names the document in errors ("signature of policy 'digits' v3").
    """
    if envelope.payload_type != expected_type:
        raise SignatureError(f"{what}: payload type '{envelope.payload_type}', expected '{expected_type}'")
    if not envelope.signatures:
        raise SignatureError(f"{what}: the envelope holds no signature")
    payload = envelope.payload_bytes()
    message = pae(envelope.payload_type, payload)
    problems = []
    for entry in envelope.signatures:
        try:
            raw = base64.b64decode(entry.sig, validate=True)
        except binascii.Error:
            problems.append(f"signature by key {entry.keyid} is not base64")
            continue
        try:
            key = trust.trusted_key(entry.keyid, role, _stamped(entry, raw, trust))
        except SignatureError as error:
            problems.append(str(error))
            continue
        if key.verify(raw, message):
            return payload, entry.keyid
        problems.append(f"signature by key {entry.keyid} does not verify (tampered signature or payload)")
    raise SignatureError(f"{what}: " + "; ".join(problems))


def _stamped(entry: EnvelopeSignature, raw: bytes, trust: TrustConfig) -> dt.datetime | None:
    """The trusted time of a signature: its timestamp's, checked (None: it carries none).
    ``SignatureError`` for a timestamp that does not verify: a signature with a forged or
    borrowed stamp is refused, not taken as unstamped."""
    if entry.timestamp is None:
        return None
    try:
        token = base64.b64decode(entry.timestamp, validate=True)
    except binascii.Error:
        raise SignatureError(f"signature by key {entry.keyid}: its timestamp is not base64") from None
    try:
        return stamped_at(token, raw, trust.timestamp_authorities)
    except SignatureError as error:
        raise SignatureError(f"signature by key {entry.keyid}: {error}") from None


def read_envelope(path: Path) -> Envelope:
    try:
        raw: Any = json.loads(path.read_text())
    except OSError as error:
        raise SignatureError(f"cannot read {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise SignatureError(f"{path}: not a JSON DSSE envelope: {error}") from None
    try:
        return Envelope.model_validate(raw)
    except ValidationError as error:
        raise SignatureError(f"{path}: not a DSSE envelope: {describe_validation_error(error)}") from None
