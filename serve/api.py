"""The read endpoints of the lineage app: experiments, trials, metrics, model versions, lineage,
influence, row lookups, audit events and attestations, all under ``/api``.

Every list is a page (``offset`` ≥ 0, 1 ≤ ``limit`` ≤ ``MAX_LIMIT``; the answer holds the
``total``). Answers are computed by ``govray.queries.StoreReader`` on a read-only connection and
kept in the app's ``ResponseCache`` until the store changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi import Path as PathParam
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from govray.core.dsse import Envelope
from govray.core.identifiers import (
    EXACT_INTEGER,
    MAX_ID,
    CorpusId,
    Label,
    ModelName,
    Moment,
    RecordId,
    RowNumber,
    Version,
)
from govray.provenance.row_reach import LineageError, RowReach, row_reach
from govray.queries import DEFAULT_LIMIT, MAX_LIMIT, NotFoundError, Page, StoreReader, Window, changes
from govray.queries.views import (
    AttestationView,
    AuditEventView,
    ExperimentDetail,
    ExperimentView,
    InfluenceItem,
    Lineage,
    MetricView,
    ModelVersionView,
    ModelView,
    TrialDetail,
    TrialView,
)
from govray.tracking.audit import AuditEventType
from govray.tracking.store import TrackingStore
from serve.cache import Reads, ResponseCache, untracked

router = APIRouter(prefix="/api")
Id = Annotated[RecordId, PathParam()]
Name = Annotated[ModelName, PathParam()]
VersionNumber = Annotated[Version, PathParam()]
Corpus = Annotated[CorpusId, PathParam()]
Offset = Annotated[
    int, Query(ge=0, le=MAX_ID, description="Position of the page's first item."), EXACT_INTEGER
]
Limit = Annotated[
    int, Query(ge=1, le=MAX_LIMIT, description=f"Items per page (at most {MAX_LIMIT})."), EXACT_INTEGER
]
Layer = Annotated[Label | None, Query(description="Only this layer: its name, its index, or adapter:NAME.")]
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "Nothing with that id or name."}}
CACHE_HEADER = "X-Govray-Cache"  # hit: the answer was cached, and nothing it read has changed since


async def answer(
    request: Request, ask: Callable[[StoreReader], BaseModel], reads: Reads = untracked
) -> Response:
    """``ask``'s answer as JSON, from the cache while nothing ``reads(answer)`` names has changed
    (``X-Govray-Cache: hit`` says it came from there). A cached answer is sent from the event loop;
    only a miss goes to a worker thread (each hop costs a GIL handoff, which on a busy 2-core node
    cut throughput to 0.6x of an async endpoint's)."""
    reader: StoreReader = request.app.state.reader
    cache: ResponseCache = request.app.state.cache
    key = request_key(request)
    cached = cache.peek(key)
    if cached is None:
        body, hit = await run_in_threadpool(cache.body, key, lambda: ask(reader), reads)
    else:
        body, hit = cached, True
    headers = {CACHE_HEADER: "hit" if hit else "miss"}
    if body.gzipped is None:
        return Response(body.json, media_type="application/json", headers=headers)
    headers["Vary"] = "Accept-Encoding"
    if not accepts_gzip(request.headers.get("accept-encoding", "")):
        return Response(body.json, media_type="application/json", headers=headers)
    headers["Content-Encoding"] = "gzip"
    return Response(body.gzipped, media_type="application/json", headers=headers)


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` header admits gzip: named with a q-value above 0, or else
    ``*`` so (RFC 9110 12.5.3; ``gzip;q=0`` refuses it whatever ``*`` says)."""
    weights: dict[str, float] = {}
    for item in accept_encoding.split(","):
        name, *params = (part.strip() for part in item.split(";"))
        weight = 1.0
        for param in params:
            field, _, value = param.partition("=")
            if field.strip().lower() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
        weights[name.lower()] = weight
    return weights.get("gzip", weights.get("*", 0.0)) > 0


def request_key(request: Request) -> bytes:
    """The request exactly as it came: raw path bytes and raw query string (``request.url`` is
    re-parsed and drops tab, CR and LF, which would hand ``NAME%0A``'s answer to ``NAME``)."""
    scope = request.scope
    path = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
    return bytes(path) + b"?" + bytes(scope.get("query_string", b""))


@router.get("/ping", summary="The empty endpoint (a load test's baseline)")
async def ping() -> dict[str, Any]:
    return {}


@router.get("/experiments", response_model=Page[ExperimentView])
async def experiments(request: Request, offset: Offset = 0, limit: Limit = DEFAULT_LIMIT) -> Response:
    return await answer(request, lambda reader: reader.experiments(Window(offset, limit)))


@router.get("/experiments/{experiment_id}", response_model=ExperimentDetail, responses=NOT_FOUND)
async def experiment(request: Request, experiment_id: Id) -> Response:
    return await answer(request, lambda reader: reader.experiment(experiment_id))


@router.get("/experiments/{experiment_id}/trials", response_model=Page[TrialView], responses=NOT_FOUND)
async def trials(
    request: Request, experiment_id: Id, offset: Offset = 0, limit: Limit = DEFAULT_LIMIT
) -> Response:
    return await answer(request, lambda reader: reader.trials(experiment_id, Window(offset, limit)))


@router.get("/trials/{trial_id}", response_model=TrialDetail, responses=NOT_FOUND)
async def trial(request: Request, trial_id: Id) -> Response:
    return await answer(request, lambda reader: reader.trial(trial_id))


@router.get("/trials/{trial_id}/metrics", response_model=Page[MetricView], responses=NOT_FOUND)
async def metrics(
    request: Request,
    trial_id: Id,
    name: Annotated[Label | None, Query(description="Only this metric.")] = None,
    offset: Offset = 0,
    limit: Limit = DEFAULT_LIMIT,
) -> Response:
    return await answer(request, lambda reader: reader.metrics(trial_id, Window(offset, limit), name))


@router.get("/models", response_model=Page[ModelView])
async def models(request: Request, offset: Offset = 0, limit: Limit = DEFAULT_LIMIT) -> Response:
    return await answer(request, lambda reader: reader.models(Window(offset, limit)))


@router.get("/models/{name}/versions", response_model=Page[ModelVersionView], responses=NOT_FOUND)
async def versions(
    request: Request, name: Name, offset: Offset = 0, limit: Limit = DEFAULT_LIMIT
) -> Response:
    return await answer(request, lambda reader: reader.versions(name, Window(offset, limit)))


@router.get("/models/{name}/versions/{version}", response_model=ModelVersionView, responses=NOT_FOUND)
async def version(request: Request, name: Name, version: VersionNumber) -> Response:
    return await answer(request, lambda reader: reader.version(name, version))


@router.get(
    "/models/{name}/versions/{version}/lineage",
    response_model=Lineage,
    responses=NOT_FOUND,
    summary="Which corpora directly reached each layer of a model version",
)
async def version_lineage(
    request: Request, name: Name, version: VersionNumber, layer: Layer = None
) -> Response:
    return await answer(
        request,
        lambda reader: reader.version_lineage(name, version, layer),
        changes.lineage_reads,
    )


@router.get(
    "/checkpoints/{checkpoint_id}/lineage",
    response_model=Lineage,
    responses=NOT_FOUND,
    summary="Which corpora directly reached each layer of a checkpoint",
)
async def checkpoint_lineage(request: Request, checkpoint_id: Id, layer: Layer = None) -> Response:
    return await answer(
        request,
        lambda reader: reader.checkpoint_lineage(checkpoint_id, layer),
        changes.lineage_reads,
    )


@router.get(
    "/trials/{trial_id}/lineage",
    response_model=Lineage,
    responses=NOT_FOUND,
    summary="Which corpora directly reached each layer of a trial so far (as of its latest checkpoint)",
)
async def trial_lineage(request: Request, trial_id: Id, layer: Layer = None) -> Response:
    return await answer(
        request,
        lambda reader: reader.trial_lineage(trial_id, layer),
        changes.lineage_reads,
    )


@router.get(
    "/corpora/{corpus_id}/influence",
    response_model=Page[InfluenceItem],
    responses=NOT_FOUND,
    summary="Every checkpoint, model version and layer a corpus reached",
)
async def influence(
    request: Request, corpus_id: Corpus, offset: Offset = 0, limit: Limit = DEFAULT_LIMIT
) -> Response:
    return await answer(
        request,
        lambda reader: reader.influence(corpus_id, Window(offset, limit)),
        lambda page: changes.influence_reads(corpus_id, page),
    )


@router.get(
    "/corpora/{corpus_id}/rows/{row}",
    response_model=RowReach,
    responses=NOT_FOUND,
    summary="Which trials, steps, checkpoints and tensors one row reached (from the schedule)",
)
async def row(request: Request, corpus_id: Corpus, row: Annotated[RowNumber, PathParam()]) -> Response:
    store: TrackingStore = request.app.state.store

    def lookup(_: StoreReader) -> RowReach:
        try:
            return row_reach(store, corpus_id, row)
        except LineageError as error:  # an unknown corpus, or a row outside it
            raise NotFoundError(str(error)) from None

    return await answer(request, lookup, changes.row_reads)


@router.get("/audit", response_model=Page[AuditEventView])
async def audit(
    request: Request,
    experiment_id: Annotated[RecordId | None, Query()] = None,
    event_type: AuditEventType | None = None,
    since: Annotated[Moment | None, Query(description="At or after (ISO 8601; UTC without a zone).")] = None,
    until: Annotated[Moment | None, Query(description="Before (ISO 8601; UTC without a zone).")] = None,
    offset: Offset = 0,
    limit: Limit = DEFAULT_LIMIT,
) -> Response:
    kind = event_type.value if event_type is not None else None
    window = Window(offset, limit)
    return await answer(
        request, lambda reader: reader.audit_events(window, experiment_id, kind, since, until)
    )


@router.get(
    "/checkpoints/{checkpoint_id}/attestations", response_model=Page[AttestationView], responses=NOT_FOUND
)
async def attestations(
    request: Request, checkpoint_id: Id, offset: Offset = 0, limit: Limit = DEFAULT_LIMIT
) -> Response:
    return await answer(request, lambda reader: reader.attestations(checkpoint_id, Window(offset, limit)))


@router.get(
    "/attestations/{attestation_id}",
    response_model=Envelope,
    responses=NOT_FOUND,
    summary="The DSSE envelope, byte for byte as stored",
)
def attestation(request: Request, attestation_id: Id) -> Response:
    reader: StoreReader = request.app.state.reader
    record = reader.attestation(attestation_id)
    return Response(record.envelope_json, media_type="application/json")
