"""The FastAPI application: routes, authentication, body limits and error bodies.

Routes: ``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``, ``GET /health``,
``GET /metrics``. The request body is read and validated here rather than by FastAPI's
parameter binding, so an oversized body is cut off while it is read (413) and every bad
input gets an OpenAI-style error body instead of FastAPI's own shape.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from openai.types import Model
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters.openai_server import responses
from adapters.openai_server.config import ServerConfig, is_loopback
from adapters.openai_server.errors import (
    APIError,
    bad_request,
    body_timeout,
    error_body,
    from_exception,
    model_not_found,
    too_large,
)
from adapters.openai_server.guard import ErrorGuard
from adapters.openai_server.metrics import Metrics
from adapters.openai_server.params import check_params
from adapters.openai_server.schemas import ChatCompletionRequest, ModelList, now, wire
from adapters.openai_server.service import ChatService, Generation, Job, build_job
from adapters.openai_server.validation import check_conversation, parse_json
from agentspec.chat.api import ChatRuntime

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
AGENT_HEADER = "x-agent-id"


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), (loc[0] if loc else None)


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):  # a body that never arrives: 408, not a hang
            async for chunk in request.stream():  # chunked uploads have no content-length
                body.extend(chunk)
                if len(body) > limit:
                    raise too_large(limit)
    except TimeoutError:
        raise body_timeout(timeout_s) from None
    return bytes(body)


async def _cancel_on_disconnect(request: Request, gen: Generation) -> None:
    """Cancel ``gen`` when the client hangs up (a queued job is then skipped)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gen.cancel()
            return


def _close_store(runtime: Any) -> None:
    """Checkpoint and close the runtime's session store (ends with an empty WAL)."""
    store = getattr(runtime, "store", None)
    close = getattr(store, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # shutdown goes on; the WAL is still replayed on the next open
            log.exception("closing the session store failed")


class _ClientGone(Exception):
    """The generation ended because its client disconnected."""


def create_app(runtime: ChatRuntime, config: ServerConfig | None = None) -> FastAPI:
    """Build the server application around a loaded runtime.

    Args:
        runtime: A :class:`~agentspec.chat.api.ChatRuntime` (agentspec's Runtime, the
            vLLM backend; tests pass fakes with ``stream_chat``, ``default_spec`` and
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
    service = ChatService(runtime.stream_chat, config, metrics)
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

    def tenant_of(request: Request) -> str:
        if config.local_only and not is_loopback(request.client.host if request.client else None):
            # Defence in depth: the CLI binds loopback in this mode, but an app mounted
            # behind some other server must not serve remote clients without keys either.
            raise APIError(403, "This server is in local-only mode (no API keys configured) "
                                "and answers loopback clients only.", "permission_error")
        return config.keys.tenant_for(request.headers.get("authorization"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "waiting": metrics.waiting,
                "running": metrics.running}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card(model_id: str) -> Model:
        return Model(id=model_id, object="model", created=started, owned_by="agentspec")

    # exclude_none: openai's Model has optional fields (shutdown_date) this server never sets.
    @app.get("/v1/models", response_model_exclude_none=True)
    async def models(request: Request) -> ModelList:
        tenant_of(request)
        return ModelList(data=[card(m) for m in served])

    @app.get("/v1/models/{model_id:path}", response_model_exclude_none=True)
    async def model(model_id: str, request: Request) -> Model:
        tenant_of(request)
        if model_id not in served:
            raise model_not_found(model_id, served)
        return card(model_id)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        tenant = tenant_of(request)
        raw = await _read_body(request, config.max_request_bytes, config.body_timeout_s)
        data = parse_json(raw)
        if not isinstance(data, dict):
            raise bad_request("request body must be a JSON object")
        check_params(data)  # 400 for any parameter the server would otherwise ignore
        try:
            req = ChatCompletionRequest.model_validate(data)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise bad_request(message, param) from None
        if req.model not in served:
            raise model_not_found(req.model, served)
        check_conversation(data["messages"], data.get("tools") if req.tools else None)
        job = build_job(
            req, data.get("tools") if req.tools else None, tenant=tenant,
            session_header=request.headers.get(SESSION_HEADER),
            agent_header=request.headers.get(AGENT_HEADER),
            base_spec=runtime.default_spec, config=config,
        )
        gen = service.submit(job)
        headers = {"X-Session-Id": job.session.session_id} if job.session else {}
        # Until the answer (or a stream's first event) exists, watch for the client leaving:
        # a departed client's job is skipped or stopped, and its turn is never stored.
        # A started stream is watched by Starlette itself, so the watcher ends before that.
        watcher = asyncio.create_task(_cancel_on_disconnect(request, gen))
        try:
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                return await _stream(gen, job, include_usage, headers)
            return await _complete(gen, job, headers)
        finally:
            watcher.cancel()

    async def _first(gen: Generation) -> tuple[str, Any]:
        try:
            kind, payload = await gen.next()
        except BaseException:
            gen.cancel()  # the client went away while queued
            raise
        if kind == "cancelled":
            raise _ClientGone
        if kind == "error":
            err = from_exception(payload)
            if err.status >= 500:
                log.error("generation failed", exc_info=payload)
            raise err
        return kind, payload

    async def _complete(gen: Generation, job: Job, headers: dict[str, str]) -> Response:
        try:
            kind, payload = await _first(gen)
            while kind == "delta":
                kind, payload = await _first(gen)
        except _ClientGone:  # nobody is listening: no answer, and no turn was stored
            metrics.aborted()
            return Response(status_code=499)
        sid = job.session.session_id if job.session else None
        metrics.finished(payload.stats, responses.finish_reason_of(payload, job.tools_active),
                         time.perf_counter() - gen.submitted)
        body = responses.completion(payload, model_name, job.tools_active, sid)
        return JSONResponse(wire(body), headers=headers)

    async def _stream(
        gen: Generation, job: Job, include_usage: bool, headers: dict[str, str]
    ) -> Response:
        # Wait for the first event before answering: a bad prompt (too long, bad
        # tool_choice) is then still a proper HTTP 400 rather than an error inside a 200.
        try:
            first = await _first(gen)
        except _ClientGone:
            metrics.aborted()
            return Response(status_code=499)
        writer = responses.ChunkWriter(model_name, job.tools_active, include_usage)
        sid = job.session.session_id if job.session else None

        async def events() -> AsyncIterator[ServerSentEvent]:
            kind, payload = first
            yield writer.start()
            metrics.first_token(time.perf_counter() - gen.submitted)
            finished = False
            try:
                while True:
                    if kind == "delta":
                        event = writer.delta(payload)
                        if event is not None:
                            yield event
                    elif kind == "done":
                        metrics.finished(payload.stats,
                                         responses.finish_reason_of(payload, job.tools_active),
                                         time.perf_counter() - gen.submitted)
                        finished = True
                        for event in writer.finish(payload, sid):
                            yield event
                        return
                    elif kind == "cancelled":
                        return
                    else:  # an error after the response started: report it in-band
                        finished = True
                        err = from_exception(payload)
                        metrics.error(err.status)
                        yield responses.sse(err.body())
                        yield responses.DONE
                        return
                    kind, payload = await gen.next()
            finally:
                gen.cancel()  # no-op after "done"; stops the worker if the client left
                if not finished:
                    metrics.aborted()

        # sse-starlette, set up so the body is byte for byte what the former hand framing sent
        # with StreamingResponse (measured; only the headers "Connection: keep-alive" and
        # "X-Accel-Buffering: no" are new): "\n" line ends, no ping comments (ping=0), and no
        # cutting of open streams at shutdown. By default it cancels them as soon as uvicorn
        # begins to exit (SIGTERM with 3 streams in flight: all 3 cut within 0.3 s, where
        # StreamingResponse drained all 3); an endless grace period leaves that to uvicorn's
        # graceful-shutdown timeout again, so streams in flight are drained, not cut.
        return EventSourceResponse(events(), sep=responses.SEP, ping=0,
                                   shutdown_grace_period=math.inf,
                                   headers={**headers, "Cache-Control": "no-cache"})

    return app
