"""The lineage app: a FastAPI app behind a Ray Serve deployment, answering lineage and attestation
questions over HTTP from the tracking store (README, "Lineage over HTTP").

Started by ``govray serve`` or by Serve's own CLI with this module's import path::

    GOVRAY_DATABASE=sqlite:///runs/tracking.db GOVRAY_TRUST=policies/trust.yaml \\
        serve run serve.app:app                      # the user's settings and the environment
    serve run serve.app:app config=serve.yaml        # ... and a YAML file (govray.config.serve)

Endpoints are under ``/api`` (``serve.api`` reads, ``serve.verify`` checks envelopes,
``serve.writes`` registers versions and tags with a bearer token); the lineage page's router
(``serve.page``) is included when present; the OpenAPI document is at ``/openapi.json``.
Reads go through a read-only connection. A request that names something unknown is a 404, a
malformed one a 422, a store that cannot be reached a 503 — each with a ``detail`` message.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve import Application

from govray.config.serve import ServeSettings
from govray.core.errors import GovrayError, TrackingError
from govray.core.runtime import ensure_ray
from govray.queries import NotFoundError, StoreFailure, StoreGeneration, StoreReader, read_only_engine
from govray.queries.errors import LedgerNotStored
from govray.tracking.store import TrackingStore, masked
from govray.train.checkpoints.files import CheckpointError
from serve import api, verify, writes
from serve.cache import ResponseCache
from serve.verify import Unavailable

logger = logging.getLogger(__name__)
TITLE = "govray lineage"
APP_NAME = "govray-lineage"
PAGE_MODULE = "serve.page"  # the lineage page's router, written apart from the API


def create_app(settings: ServeSettings) -> FastAPI:
    """The FastAPI app over the store ``settings`` names (usable without Serve, e.g. in tests)."""
    application = FastAPI(
        title=TITLE,
        description="Which content trained which part of which model, under what policy — "
        "answered from govray's tracking store, with signed attestations to check.",
        version="1",
    )
    engine = read_only_engine(settings.database_url)
    application.state.settings = settings
    application.state.reader = reader = StoreReader(engine)
    application.state.cache = ResponseCache(StoreGeneration(engine), reader.stamps)
    application.state.store = TrackingStore(settings.database_url)  # row lookups and registry writes
    application.state.trust = settings.trust
    for router in (api.router, verify.router, writes.router):
        application.include_router(router)
    if importlib.util.find_spec(PAGE_MODULE) is not None:
        application.include_router(importlib.import_module(PAGE_MODULE).router)
    for error, status in HANDLED:
        application.add_exception_handler(error, _responder(status))
    application.add_exception_handler(RequestValidationError, _malformed)
    return application


HANDLED: list[tuple[type[Exception], int]] = [
    (LedgerNotStored, 409),  # recorded, its ledger not stored: a write stores it (no GET writes)
    (NotFoundError, 404),
    (CheckpointError, 409),  # a checkpoint on storage no longer matches what the store recorded
    (Unavailable, 503),
    (TrackingError, 503),  # the store is unreachable or holds something unreadable
    (StoreFailure, 503),
    (GovrayError, 422),  # anything else govray refused on purpose: the request asked it wrongly
]


def _responder(status: int) -> Any:
    async def respond(request: Request, error: Exception) -> JSONResponse:
        if isinstance(error, StoreFailure):
            logger.warning("tracking store error on %s: %s", request.url.path, error)
            reason = getattr(error, "orig", None) or type(error).__name__
            detail = f"the tracking store cannot answer now ({reason}); try again"
        else:
            detail = str(error)
        return JSONResponse({"detail": detail}, status_code=status)

    return respond


async def _malformed(request: Request, error: Exception) -> JSONResponse:
    """FastAPI's 422 for a request its types refuse, with the offending input made JSON-safe: a body
    such as ``{"attestation_id": NaN}`` (or ``1e999``) echoes a non-finite float, which JSON cannot
    hold, and FastAPI's own handler would fail with a 500 writing it."""
    assert isinstance(error, RequestValidationError)
    return JSONResponse({"detail": _finite(jsonable_encoder(error.errors()))}, status_code=422)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf": what was sent, as text
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


# The replica mostly waits on its database, so it holds no CPU a training run could use.
@serve.deployment(name="LineageApp", max_ongoing_requests=64, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class LineageApp:
    """One replica of the lineage app; its FastAPI app is built on the replica (it opens the
    store there)."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        logger.info("lineage app reading %s", masked(settings.database_url))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.settings)


def app(args: dict[str, str]) -> Application:
    """Serve's application builder (``serve run serve.app:app [config=FILE] [key=value ...]``):
    settings from the environment, a ``config`` YAML, then the other arguments."""
    overrides = {key: value for key, value in args.items() if key != "config"}
    config = Path(args["config"]) if "config" in args else None
    return LineageApp.bind(ServeSettings.load(config, overrides))  # type: ignore[attr-defined]


def start(settings: ServeSettings, *, blocking: bool = False) -> str:
    """Deploy the app on this process's Ray cluster (a local one if none), its HTTP proxy on
    ``settings.host:settings.port``; returns the base URL. ``blocking`` waits for Ctrl-C and
    then shuts Serve down. (Serve's HTTP options are per cluster: where Serve already runs, it
    keeps the host and port it was started with.)"""
    ensure_ray()
    serve.start(http_options={"host": settings.host, "port": settings.port})
    application = LineageApp.bind(settings)  # type: ignore[attr-defined]
    try:
        serve.run(application, name=APP_NAME, route_prefix="/", blocking=blocking)
    finally:
        if blocking:  # interrupted
            serve.shutdown()
    return f"http://{settings.host}:{settings.port}"
