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
    """Sign ``payload`` (its PAE) with ``key``; the record carries ``signed_at`` (default: now)."""
    signature = key.sign(pae(payload_type, payload))
    record = EnvelopeSignature(
        keyid=key.keyid,
        sig=base64.b64encode(signature).decode(),
        signed_at=signed_at if signed_at is not None else signing_time(),
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
            key = trust.trusted_key(entry.keyid, role)
        except SignatureError as error:
            problems.append(str(error))
            continue
        try:
            raw = base64.b64decode(entry.sig, validate=True)
        except binascii.Error:
            problems.append(f"signature by key {entry.keyid} is not base64")
            continue
        if key.verify(raw, message):
            return payload, entry.keyid
        problems.append(f"signature by key {entry.keyid} does not verify (tampered signature or payload)")
    raise SignatureError(f"{what}: " + "; ".join(problems))


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
