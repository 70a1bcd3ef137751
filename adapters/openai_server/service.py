"""Turning a validated request into a runtime call, and running it off the event loop.

The runtime serves one request at a time (the target holds one KV cache), so generations
run on a single worker thread in arrival order while the event loop keeps answering
``/health``, ``/metrics`` and new connections. A generation streams its deltas into an
``asyncio.Queue``; the whole generator runs on that one thread because the runtime's lock is
an ``RLock`` held inside the generator, which only its owning thread may release. A client
that disconnects cancels its generation at the next delta (closing the generator releases
the lock, and the unfinished turn is never stored); a request that is still queued is
skipped when its turn comes. Either way the handle receives one final ``cancelled`` event,
so no handler waits forever.

Shutdown (:meth:`ChatService.shutdown`) refuses new work with a 503, answers every queued
request with a 503 at once (their clients retry elsewhere) and waits for the running
generation, which ends at its next delta if its client has gone.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from adapters.openai_server.config import ServerConfig
from adapters.openai_server.errors import bad_request, overloaded, shutting_down
from adapters.openai_server.metrics import Metrics
from adapters.openai_server.params import check_structured
from adapters.openai_server.schemas import ChatCompletionRequest
from agentspec.chat.api import ChatResult
from agentspec.spec import AgentSpec, VerifierPolicy
from agentspec.types import SessionRef, check_id

# ("delta", str) | ("done", ChatResult) | ("error", BaseException) | ("cancelled", None)
Event = tuple[str, Any]


@dataclass
class Job:
    """A request resolved into the arguments of :meth:`Runtime.stream_chat`.

    Attributes:
        messages: Role/content dicts (OpenAI shapes, tool calls included).
        tools: The request's tool schemas as sent (``None``: no tools).
        tool_choice: As sent.
        session: Cache scope of the request; ``None`` for an anonymous request.
        spec: Agent spec with the request's sampling settings.
        max_tokens: Completion token limit.
        stop: Stop sequences.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None
    session: SessionRef | None
    spec: AgentSpec
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    response_format: dict[str, Any] | None = None

    @property
    def tools_active(self) -> bool:
        """True when tools are bound and not switched off by ``tool_choice="none"``."""
        return bool(self.tools) and self.tool_choice != "none"


def _message_dict(msg: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        # The chat template knows no "developer" role; it is OpenAI's newer name for system.
        "role": "system" if msg.role == "developer" else msg.role,
        "content": msg.text(),
    }
    if msg.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in msg.tool_calls]
    return out


def session_id_for(request: ChatCompletionRequest, header: str | None) -> str | None:
    """The session id of a request: ``X-Session-Id``, else ``prompt_cache_key``, else ``user``.

    ``user`` is free text in OpenAI's API, so one that is not a valid id is hashed into one
    (stable: the same user keeps one session); an invalid header is the client's error.

    Raises:
        APIError: 400 for an invalid ``X-Session-Id`` or ``prompt_cache_key``.
    """
    # The header's surrounding blanks are HTTP's optional whitespace; a body field is taken
    # as sent, so "sess\n" is a 400 rather than quietly becoming "sess".
    for value, param in ((header.strip() if header is not None else None, "X-Session-Id"),
                         (request.prompt_cache_key, "prompt_cache_key")):
        if value is not None:
            try:
                return check_id("session", value)
            except ValueError as exc:
                raise bad_request(str(exc), param) from None
    if request.user:
        try:
            return check_id("session", request.user)
        except ValueError:
            return "user-" + hashlib.sha256(request.user.encode("utf-8")).hexdigest()[:32]
    return None


def _spec_for(base: AgentSpec, request: ChatCompletionRequest) -> AgentSpec:
    updates = {
        k: v for k, v in (("temperature", request.temperature), ("top_p", request.top_p),
                          ("seed", request.seed),
                          ("frequency_penalty", request.frequency_penalty),
                          ("presence_penalty", request.presence_penalty),
                          ("repetition_penalty", request.repetition_penalty)) if v is not None
    }
    if not updates:
        return base
    try:
        verifier = VerifierPolicy.model_validate({**base.verifier.model_dump(), **updates})
    except ValidationError as exc:
        # e.g. temperature > 0 under an approximate-greedy (budgeted) agent spec
        err = exc.errors()[0]
        raise bad_request(str(err.get("msg", exc)).removeprefix("Value error, "),
                          "temperature" if "temperature" in str(exc) else None) from None
    return base.model_copy(update={"verifier": verifier})


def build_job(
    request: ChatCompletionRequest,
    raw_tools: list[dict[str, Any]] | None,
    *,
    tenant: str,
    session_header: str | None,
    agent_header: str | None,
    base_spec: AgentSpec,
    config: ServerConfig,
) -> Job:
    """Resolve a request into a :class:`Job`.

    ``raw_tools`` are the tool schemas exactly as the client sent them: the runtime renders
    them into the prompt, and the same bytes every turn are what the session cache drafts
    from.

    Raises:
        APIError: 400 for bad message content, ids or limits.
    """
    try:
        messages = [_message_dict(m) for m in request.messages]
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    limit = request.token_limit() or config.default_max_tokens
    if limit > config.max_tokens_limit:
        raise bad_request(
            f"max_tokens={limit} exceeds this server's limit of {config.max_tokens_limit}",
            "max_tokens",
        )
    try:
        agent = check_id("agent", agent_header.strip()) if agent_header else "default"
    except ValueError as exc:
        raise bad_request(str(exc), "X-Agent-Id") from None
    sid = session_id_for(request, session_header)
    spec = _spec_for(base_spec, request)
    session: SessionRef | None = None
    if sid is not None:
        session = SessionRef(sid, tenant=tenant, agent=agent)
    elif spec.drafting.scope != "session":
        # A one-off request still shares (and feeds) its agent's or tenant's history
        # under those scopes; a fresh id keeps it out of every other session.
        session = SessionRef(f"anon-{uuid.uuid4().hex}", tenant=tenant, agent=agent)
    # Under session scope an anonymous request uses its own request index only (session
    # None): a random id would draft exactly the same but leave an orphan row in the store.
    check_structured(request, raw_tools)
    return Job(messages, raw_tools, request.tool_choice, session, spec, limit,
               request.stop_list(), request.response_format)


class Generation:
    """A handle on one queued or running generation; read its events with :meth:`next`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.submitted = time.perf_counter()

    def emit(self, kind: str, payload: Any) -> None:
        """Hand an event to the event loop (called from the worker thread)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, payload))
        except RuntimeError:
            self._cancelled.set()  # the loop is gone (shutdown): stop generating

    async def next(self) -> Event:
        """The next event: ``delta``, then one final ``done`` or ``error``."""
        return await self._queue.get()

    def cancel(self) -> None:
        """Stop the generation at its next delta (or skip it if still queued)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""
        return self._cancelled.is_set()


class ChatService:
    """Runs jobs on the runtime, one at a time, on a dedicated worker thread.

    Args:
        stream_chat: The runtime's ``stream_chat`` (or a fake with its signature).
        config: Server settings (queue limit).
        metrics: Where queue and finish numbers go.
    """

    def __init__(
        self, stream_chat: Callable[..., Any], config: ServerConfig, metrics: Metrics
    ) -> None:
        self._stream_chat = stream_chat
        self._config = config
        self._metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentspec-gen")
        self._lock = threading.Lock()
        self._queued: set[Generation] = set()
        self._closing = False

    @property
    def closing(self) -> bool:
        """True once :meth:`shutdown` began: new requests get a 503."""
        return self._closing

    def submit(self, job: Job) -> Generation:
        """Queue a job; its events arrive on the returned handle.

        Raises:
            APIError: 503 when ``config.max_waiting`` requests are already queued, or the
                server is shutting down.
        """
        gen = Generation(asyncio.get_running_loop())
        with self._lock:
            if self._closing:
                raise shutting_down()
            if len(self._queued) >= self._config.max_waiting:
                raise overloaded(len(self._queued))
            self._queued.add(gen)
        self._metrics.queued(+1)
        self._executor.submit(self._work, job, gen)
        return gen

    def _dequeue(self, gen: Generation) -> bool:
        """Take ``gen`` off the queue; False if shutdown already answered it."""
        with self._lock:
            if gen not in self._queued:
                return False
            self._queued.discard(gen)
        self._metrics.queued(-1)
        return True

    def _work(self, job: Job, gen: Generation) -> None:
        if not self._dequeue(gen):
            return
        if gen.cancelled:  # its client left while it waited: no work, nothing stored
            gen.emit("cancelled", None)
            return
        self._metrics.started(+1)
        out: list[ChatResult] = []
        stream = self._stream_chat(
            job.messages, job.tools, tool_choice=job.tool_choice, session=job.session,
            spec=job.spec, max_tokens=job.max_tokens, stop=job.stop, result=out,
            **({"response_format": job.response_format} if job.response_format else {}),
        )
        try:
            for delta in stream:
                if gen.cancelled:
                    gen.emit("cancelled", None)
                    return
                gen.emit("delta", delta)
            gen.emit("done", out[0])
        except BaseException as exc:  # handed to the client as an error body, not lost
            gen.emit("error", exc)
        finally:
            stream.close()  # on this thread: releases the runtime's lock if still held
            self._metrics.started(-1)

    def shutdown(self) -> None:
        """Refuse new work, answer queued requests with a 503, wait for the running one.

        Called by the app's lifespan after the HTTP server stopped accepting connections
        and gave open requests its graceful-shutdown time.
        """
        with self._lock:
            self._closing = True
            queued, self._queued = list(self._queued), set()
        for gen in queued:
            self._metrics.queued(-1)
            gen.cancel()
            gen.emit("error", shutting_down())
        self._executor.shutdown(wait=True, cancel_futures=True)

