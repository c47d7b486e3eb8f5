"""The write endpoints: register a checkpoint as a model version, replace a version's tags, store
a recorded checkpoint's ledger that could not be stored when it was recorded (no GET writes: a
lineage request for such a checkpoint answers 409 naming this endpoint).

Registry writes go through ``govray.platform.registry.register`` (which verifies, attests and
audits). Every write requires ``Authorization: Bearer TOKEN`` with the server's configured token:
no token is a 401, a wrong one (or a server configured without one) a 403.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi import Path as PathParam
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from govray.config.serve import ServeSettings
from govray.core.identifiers import Description, ModelName, RecordId, TagKey, TagValue, Version
from govray.core.keys import load_trust
from govray.platform.registry import register as registry
from govray.platform.run.ledgers import store_checkpoint_ledger
from govray.queries import StoreReader
from govray.queries.views import ModelVersionView
from govray.tracking.store import TrackingStore

bearer = HTTPBearer(auto_error=False, description="The server's write token (GOVRAY_SERVE_TOKEN).")


def writer(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> TrackingStore:
    """The store to write to, for a request that carries the server's token."""
    settings: ServeSettings = request.app.state.settings
    if credentials is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "this endpoint writes: send 'Authorization: Bearer TOKEN'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if settings.token is None:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, "writes are disabled: the server has no token configured"
        )
    if not secrets.compare_digest(
        credentials.credentials.encode(), settings.token.get_secret_value().encode()
    ):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "the bearer token is not this server's write token")
    store: TrackingStore = request.app.state.store
    return store


router = APIRouter(
    prefix="/api",
    responses={
        400: {"description": "The body is not JSON."},
        401: {"description": "No bearer token."},
        403: {"description": "Wrong token."},
    },
)
Writer = Annotated[TrackingStore, Depends(writer)]
Name = Annotated[ModelName, PathParam()]
Tags = Annotated[dict[TagKey, TagValue], Field(max_length=256)]


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint_id: RecordId = Field(description="A checkpoint the store recorded.")
    description: Description = ""
    tags: Tags = Field(default_factory=dict)


class StoredLedger(BaseModel):
    checkpoint_id: int
    rows: int = Field(description="Ledger rows written (0: they were stored already).")


class TagsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tags: Tags = Field(description="The version's tags from now on (all others are removed).")


@router.post("/models/{name}/versions", response_model=ModelVersionView, status_code=status.HTTP_201_CREATED)
def register(request: Request, store: Writer, name: Name, body: RegisterRequest) -> ModelVersionView:
    """Register a checkpoint as the next version of model ``name`` (verified and attested)."""
    reader: StoreReader = request.app.state.reader
    checkpoint = reader.checkpoint(body.checkpoint_id)
    made = registry.register(store, name, Path(checkpoint.path), description=body.description, tags=body.tags)
    return reader.version(made.model, made.version)


@router.post("/checkpoints/{checkpoint_id}/ledger", response_model=StoredLedger)
def store_ledger(
    request: Request, store: Writer, checkpoint_id: Annotated[RecordId, PathParam()]
) -> StoredLedger:
    """Store the ledger of recorded checkpoint ``checkpoint_id`` from its ``state.json`` and the
    routing of its ``run.json``, both checked against the manifest the store recorded when it was
    sealed (and its signature, under the server's trust); 409 when they do not check out."""
    settings: ServeSettings = request.app.state.settings
    trust = load_trust(settings.trust) if settings.trust is not None else None  # else: the store vouches
    rows = store_checkpoint_ledger(store, checkpoint_id, trust)
    return StoredLedger(checkpoint_id=checkpoint_id, rows=rows)


@router.put("/models/{name}/versions/{version}/tags", response_model=ModelVersionView)
def replace_tags(
    request: Request,
    store: Writer,
    name: Name,
    version: Annotated[Version, PathParam()],
    body: TagsRequest,
) -> ModelVersionView:
    """Replace the tags of a model version."""
    reader: StoreReader = request.app.state.reader
    current = reader.version(name, version)  # 404 for an unknown model or version
    removed = [tag for tag in current.tags if tag not in body.tags]
    registry.set_tags(store, f"{name}:{version}", body.tags, removed)
    return reader.version(name, version)
