"""The FastAPI application: its parts, its lifespan and its error bodies.

:func:`create_app` wires the queue (:mod:`~adapters.openai_server.service`), the metrics,
the error handlers (OpenAI-style bodies for every failure) and the routes
(:mod:`~adapters.openai_server.routes`), which answer through
:mod:`~adapters.openai_server.streaming` (one JSON body or server-sent events).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters.openai_server.config import ServerConfig
from adapters.openai_server.errors import (
    APIError,
    bad_request,
    error_body,
)
from adapters.openai_server.guard import ErrorGuard
from adapters.openai_server.metrics import Metrics
from adapters.openai_server.routes import add_routes
from adapters.openai_server.schemas import now
from adapters.openai_server.service import ChatService
from agentspec.chat.api import ChatRuntime
from agentspec.requests import REQUESTS
from agentspec.storage.health import CountingStore
from agentspec.targets.hf import HFTarget

log = logging.getLogger(__name__)


def _close_store(runtime: Any) -> None:
    """Checkpoint and close the runtime's session store (ends with an empty WAL)."""
    store = getattr(runtime, "store", None)
    close = getattr(store, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # shutdown goes on; the WAL is still replayed on the next open
            log.exception("closing the session store failed")


def create_app(runtime: ChatRuntime, config: ServerConfig | None = None) -> FastAPI:
    """Build the server application around a loaded runtime.

    Args:
        runtime: A :class:`~agentspec.chat.api.ChatRuntime` (agentspec's Runtime, the
            vLLM backend; tests pass fakes with ``stream_turn``, ``default_spec`` and
            ``target.name``).
        config: Keys, limits and served model names (defaults: local-only mode).

    Returns:
        The FastAPI app; serve it with uvicorn. Its ``state`` holds ``config``,
        ``metrics`` and ``service``.
    """
    config = config or ServerConfig()
    model_name = config.model_name or runtime.target.name
    served = [model_name, *config.aliases]
    metrics = Metrics(model_name)
    if isinstance(runtime.target, HFTarget) and runtime.target.prefix_cache is not None:
        metrics.watch_prefix_cache(runtime.target.prefix_cache)
    metrics.watch_requests(REQUESTS)
    turns = getattr(runtime, "turns", None)  # the embedded runtime's store (vLLM: none here)
    if isinstance(turns, CountingStore):
        metrics.watch_store(turns)
    service = ChatService(runtime.stream_turn, config, metrics)
    started = now()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn has stopped accepting connections and given open requests their graceful
        # time; abort what still waits, let the running generation end, then close the store
        # so every acknowledged turn is in the main file, not only in its WAL.
        service.shutdown()
        if config.owns_runtime:
            _close_store(runtime)

    app = FastAPI(title="agentspec", version="0.1.0", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config, app.state.metrics, app.state.service = config, metrics, service
    app.add_middleware(ErrorGuard, metrics=metrics)

    def api_error(exc: APIError) -> JSONResponse:
        metrics.error(exc.status)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return api_error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()))
        return api_error(bad_request(f"{loc}: {first.get('msg', 'invalid request')}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.error(exc.status_code)
        if exc.status_code in (404, 405):  # a route this server does not serve: OpenAI's body
            message = f"Invalid URL ({request.method} {request.url.path})"
            return JSONResponse(error_body(message, "invalid_request_error"),
                                status_code=exc.status_code)
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"),
                            status_code=exc.status_code)

    add_routes(app, runtime, config, metrics, service, served, started)
    return app
