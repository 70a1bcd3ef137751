"""The routes: ``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``.

The request body is read and validated here rather than by FastAPI's parameter binding,
so an oversized body is cut off while it is read (413) and every bad input gets an
OpenAI-style error body instead of FastAPI's own shape.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from openai.types import Model
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from adapters.openai_server.config import ServerConfig, is_loopback
from adapters.openai_server.errors import (
    APIError,
    bad_request,
    body_timeout,
    model_not_found,
    too_large,
)
from adapters.openai_server.metrics import Metrics
from adapters.openai_server.params import check_params
from adapters.openai_server.schemas import ChatCompletionRequest, ModelList
from adapters.openai_server.service import ChatService, Ticket, build_job
from adapters.openai_server.streaming import Answers
from adapters.openai_server.validation import check_conversation, parse_json
from agentspec.chat.api import ChatRuntime, served_dtype

__all__ = ["AGENT_HEADER", "SESSION_HEADER", "add_routes"]

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


async def _cancel_on_disconnect(request: Request, gen: Ticket) -> None:
    """Cancel ``gen`` when the client hangs up (a queued job leaves the queue at once)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gen.cancel()
            return


def _with_headers(exc: APIError, metrics: Metrics) -> Response:
    """Answer an error that carries headers (a full queue's ``Retry-After``) here, headers
    included; any other error goes on to the app's handler."""
    if not exc.headers:
        raise exc
    metrics.error(exc.status)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def add_routes(
    app: FastAPI,
    runtime: ChatRuntime,
    config: ServerConfig,
    metrics: Metrics,
    service: ChatService,
    served: list[str],
    started: int,
) -> None:
    """Register the routes on ``app``.

    Args:
        app: The application.
        runtime: The runtime whose ``default_spec`` requests start from.
        config: Keys, limits and the local-only rule.
        metrics: The server's counters.
        service: The queue the chat completions are submitted to.
        served: Model names this server answers to (the first is the model's own).
        started: Unix time the server started (the models' ``created``).
    """
    answers = Answers(metrics, served[0], runtime.tool_format)

    def tenant_of(request: Request) -> str:
        if config.local_only and not is_loopback(request.client.host if request.client else None):
            # Defence in depth: the CLI binds loopback in this mode, but an app mounted
            # behind some other server must not serve remote clients without keys either.
            raise APIError(403, "This server is in local-only mode (no API keys configured) "
                                "and answers loopback clients only.", "permission_error")
        return config.keys.tenant_for(request.headers.get("authorization"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": served[0], "waiting": metrics.waiting,
                "running": metrics.running}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # The precision the model runs in (``--dtype auto`` resolved: "w8a16", "float32", ...),
    # an extra field of the model card (omitted where the runtime does not say).
    dtype = served_dtype(runtime)

    def card(model_id: str) -> Model:
        extra: dict[str, Any] = {"dtype": dtype} if dtype is not None else {}
        return Model(id=model_id, object="model", created=started, owned_by="agentspec",
                     **extra)

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
        try:
            gen = service.submit(job)
        except APIError as exc:  # 503 queue full, 429 over the tenant's share
            return _with_headers(exc, metrics)
        headers = {"X-Session-Id": job.session_id} if job.session_id else {}
        # Until the answer (or a stream's first event) exists, watch for the client leaving:
        # a departed client's job leaves the queue or is stopped, and its turn is never
        # stored.
        # A started stream is watched by Starlette itself, so the watcher ends before that.
        watcher = asyncio.create_task(_cancel_on_disconnect(request, gen))
        try:
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                return await answers.stream(gen, job, include_usage, headers)
            return await answers.complete(gen, job, headers)
        except APIError as exc:  # e.g. a 503 for a request that waited too long
            return _with_headers(exc, metrics)
        finally:
            watcher.cancel()
