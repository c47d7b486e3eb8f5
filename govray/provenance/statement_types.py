"""The type URIs of govray's attestations: the in-toto statement, its two predicates and the
DSSE payload type. Readers of stored envelopes (the CLI, the lineage queries, the registry) need
them without loading the code that writes attestations (torch, Ray, pyarrow)."""

from __future__ import annotations

import json

from govray.core.dsse import Envelope
from govray.core.errors import SignatureError

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PROVENANCE_TYPE = "https://slsa.dev/provenance/v1"
COVERAGE_TYPE = "https://govray.dev/attestation/coverage/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"


def statement_type(envelope_json: str) -> str | None:
    """The predicate type an envelope claims, read WITHOUT verifying it (to sort envelopes; trust
    only what ``verify_attestation`` returns)."""
    try:
        envelope = Envelope.model_validate_json(envelope_json)
        statement = json.loads(envelope.payload_bytes())
    except (ValueError, SignatureError):
        return None
    kind = statement.get("predicateType") if isinstance(statement, dict) else None
    return kind if isinstance(kind, str) else None
