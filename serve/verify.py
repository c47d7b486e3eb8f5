"""``POST /api/verify``: check an attestation envelope against model files, under the server's
trust file, the way ``govray verify`` does.

The body names the envelope (inline, or a stored attestation's id) and the files (a checkpoint id
or a model version ``NAME:VERSION``; by default the ones the stored attestation is about). A
verification that fails is an answer, not an error: 200 with ``ok: false`` and the reason.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from govray.config.serve import ServeSettings
from govray.core.dsse import Envelope
from govray.core.errors import AttestationError, GovrayError, SignatureError
from govray.core.identifiers import ModelRef, RecordId
from govray.core.keys import TrustConfig, load_trust
from govray.platform.registry.versions import RegistryError, parse_ref, resolve
from govray.provenance.verify import verify_attestation
from govray.queries import NotFoundError, QueryError, StoreReader
from govray.tracking.store import TrackingStore

router = APIRouter(prefix="/api")


class Unavailable(GovrayError):
    """The server cannot answer this request as it is configured (an HTTP 503)."""


class VerifyRequest(BaseModel):
    """What to verify: one envelope, against one set of model files."""

    model_config = ConfigDict(extra="forbid")

    envelope: Envelope | None = Field(default=None, description="A DSSE envelope, as JSON.")
    attestation_id: RecordId | None = Field(
        default=None, description="A stored attestation instead of an inline envelope."
    )
    checkpoint_id: RecordId | None = Field(default=None, description="Check the files of this checkpoint.")
    model: ModelRef | None = Field(
        default=None, description="Check the files of this model version (NAME:VERSION, or NAME: the latest)."
    )

    @model_validator(mode="after")
    def _one_of_each(self) -> VerifyRequest:
        if (self.envelope is None) == (self.attestation_id is None):
            raise ValueError("give exactly one of 'envelope' and 'attestation_id'")
        if self.checkpoint_id is not None and self.model is not None:
            raise ValueError("give at most one of 'checkpoint_id' and 'model'")
        if self.attestation_id is None and self.checkpoint_id is None and self.model is None:
            raise ValueError("an inline envelope needs 'checkpoint_id' or 'model' (whose files to check)")
        return self


class Subject(BaseModel):
    name: str
    sha256: str


class VerifyResult(BaseModel):
    ok: bool
    reason: str | None = Field(description="What broke, when ok is false.")
    signer: str | None = Field(description="Key id of the platform key that signed it.")
    predicate_type: str | None
    subjects: list[Subject]
    model_dir: str = Field(description="The directory whose files were checked.")


@router.post(
    "/verify",
    response_model=VerifyResult,
    responses={400: {"description": "The body is not JSON."}, 404: {"description": "Unknown id or model."}},
)
def verify(request: Request, body: VerifyRequest) -> VerifyResult:
    """Verify an attestation envelope against model files under the server's trust file; a failed
    verification is a 200 with ``ok: false`` and the reason."""
    settings: ServeSettings = request.app.state.settings
    if settings.trust is None:
        raise Unavailable("this server verifies nothing: it has no trust file (set GOVRAY_TRUST)")
    envelope_json, directory = _what_to_verify(request.app.state.reader, request.app.state.store, body)
    try:
        trust = load_trust(settings.trust)  # read each time: a key revoked a minute ago counts
    except SignatureError as error:
        raise Unavailable(f"the server's trust file is unusable: {error}") from None
    return check_envelope(envelope_json, directory, trust)


def check_envelope(
    envelope_json: str, directory: Path, trust: TrustConfig, name: str = "the attestation"
) -> VerifyResult:
    """Verify an envelope (JSON text) against the model files in ``directory`` under ``trust``,
    as ``govray verify`` does; a failure is a result naming what broke (``name`` stands for the
    envelope in the reason)."""
    with tempfile.TemporaryDirectory(prefix="govray-verify-") as scratch:
        path = Path(scratch) / "envelope.dsse.json"
        path.write_text(envelope_json)
        try:
            verified = verify_attestation(path, model_dir=directory, trust=trust)
        except (AttestationError, OSError) as error:
            reason = str(error).replace(f"attestation {path}", name).replace(str(path), name)
            return VerifyResult(
                ok=False,
                reason=reason,
                signer=None,
                predicate_type=None,
                subjects=[],
                model_dir=str(directory),
            )
    statement: dict[str, Any] = verified.statement
    return VerifyResult(
        ok=True,
        reason=None,
        signer=verified.signer,
        predicate_type=statement.get("predicateType"),
        subjects=[Subject(name=s["name"], sha256=s["digest"]["sha256"]) for s in statement["subject"]],
        model_dir=str(directory),
    )


def _what_to_verify(reader: StoreReader, store: TrackingStore, body: VerifyRequest) -> tuple[str, Path]:
    """The envelope's JSON and the directory holding the model files to check it against."""
    checkpoint_id, model = body.checkpoint_id, body.model
    if body.envelope is not None:
        envelope_json = body.envelope.to_json()
    else:
        assert body.attestation_id is not None
        record = reader.attestation(body.attestation_id)
        envelope_json = record.envelope_json
        if checkpoint_id is None and model is None:
            if record.model_version_id is not None:
                found = reader.version_by_id(record.model_version_id)
                model = f"{found.model_name}:{found.version}"
            elif record.checkpoint_id is not None:
                checkpoint_id = record.checkpoint_id
            else:
                raise QueryError(
                    f"attestation {record.id} names no checkpoint: give 'checkpoint_id' or 'model'"
                )
    if model is not None:
        try:
            parse_ref(model)
        except RegistryError as error:
            raise QueryError(str(error)) from None
        try:
            return envelope_json, resolve(store, model).directory
        except RegistryError as error:  # well formed, so: no such model or version
            raise NotFoundError(str(error)) from None
    assert checkpoint_id is not None
    return envelope_json, Path(reader.checkpoint(checkpoint_id).path)
