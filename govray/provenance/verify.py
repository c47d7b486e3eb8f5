"""Verifying an attestation without govray's database: the signature, the statement, the files.

``verify_attestation`` checks the envelope's signature (a trusted, unrevoked platform key), that
its payload is an in-toto Statement v1 of one of govray's predicate types
(:mod:`govray.provenance.attest` writes them), and every subject's digest against the files of a
model directory — a missing, changed or unlisted model file is refused by name::

    verified = verify_attestation(envelope, model_dir=checkpoint_dir, trust=trust)
    verified.statement["predicate"]["buildDefinition"]["externalParameters"]["policy"]

securesystemslib's DSSE verifies the same envelopes (a verifier govray did not write).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from govray.core.canonical import file_sha256
from govray.core.dsse import read_envelope, verify_envelope
from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, TrustConfig
from govray.provenance.attest import AttestationError, model_subjects
from govray.provenance.statement_types import COVERAGE_TYPE, PAYLOAD_TYPE, PROVENANCE_TYPE, STATEMENT_TYPE


@dataclass(frozen=True)
class VerifiedAttestation:
    statement: dict[str, Any]
    signer: str  # the platform key id that signed it


def verify_attestation(
    envelope_path: Path,
    *,
    model_dir: Path,
    trust: TrustConfig,
    policy: Path | None = None,
    expected_kind: str | None = None,
) -> VerifiedAttestation:
    """Check the envelope's signature (a trusted, unrevoked platform key), the statement, that
    ``model_dir``'s model files are exactly the subjects, digest for digest, and (given a
    provenance statement and ``policy``) that the policy file is the one attested."""
    try:
        envelope = read_envelope(envelope_path)
        payload, signer = verify_envelope(
            envelope, trust, KeyRole.PLATFORM, expected_type=PAYLOAD_TYPE, what=f"attestation {envelope_path}"
        )
    except SignatureError as error:
        raise AttestationError(str(error)) from None
    try:
        statement = json.loads(payload)
    except json.JSONDecodeError as error:
        raise AttestationError(f"{envelope_path}: the signed payload is not JSON: {error}") from None
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        raise AttestationError(f"{envelope_path}: not an in-toto Statement v1")
    kind = {PROVENANCE_TYPE: "provenance", COVERAGE_TYPE: "coverage"}.get(statement.get("predicateType", ""))
    if kind is None or (expected_kind is not None and kind != expected_kind):
        raise AttestationError(
            f"{envelope_path}: predicate type {statement.get('predicateType')!r} is not expected"
        )
    subjects = {s.get("name"): s.get("digest", {}).get("sha256") for s in statement.get("subject", [])}
    present = {s["name"]: s["digest"]["sha256"] for s in model_subjects(model_dir, trust)}
    for name, digest in sorted(subjects.items()):
        if name not in present:
            raise AttestationError(f"{model_dir / str(name)}: attested but missing")
        if present[name] != digest:
            raise AttestationError(f"{model_dir / name}: sha256 differs from the attested digest (tampered)")
    if extra := sorted(set(present) - set(subjects)):
        raise AttestationError(f"{model_dir}: {', '.join(extra)} not among the attested subjects")
    if policy is not None:
        if kind != "provenance":
            raise AttestationError(f"{envelope_path}: only a provenance statement attests the policy")
        attested = statement["predicate"]["buildDefinition"]["externalParameters"]["policy"]
        if file_sha256(policy) != attested.get("sha256"):
            raise AttestationError(
                f"{policy}: sha256 differs from the attested policy '{attested.get('name')}' "
                f"v{attested.get('version')} (a changed policy)"
            )
    return VerifiedAttestation(statement=statement, signer=signer)
