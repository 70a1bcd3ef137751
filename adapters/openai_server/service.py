"""Turning a validated request into a runtime call, and running it off the event loop.

The runtime serves one request at a time (the target holds one KV cache), so generations
run on a single worker thread while the event loop keeps answering ``/health``,
``/metrics`` and new connections. A generation streams its deltas into an
``asyncio.Queue``; the whole generator runs on that one thread because the runtime's lock is
an ``RLock`` held inside the generator, which only its owning thread may release.

Fairness and bounds (:class:`~adapters.openai_server.queue.FairQueue`): each tenant waits in
its own FIFO and the worker serves tenants round-robin, so one tenant's backlog delays
another tenant's request by at most one generation per tenant ahead of it. At most
``max_waiting`` requests wait in all (more: 503 ``queue_full``) and at most
``tenant_share`` of them per tenant (more: 429 ``rate_limit_exceeded``), both with a
``Retry-After`` header. A request that waited longer than ``max_queue_wait_s`` when its turn
comes is answered with a 503 ``queue_timeout`` without running. A generation that runs
longer than ``max_generation_s`` stops at its next delta and is answered with what it has,
``finish_reason="length"``; like every generation closed early, its turn is not stored
(the session cache misses it; the client's next request, which carries the answer in its
history, is prefilled as usual), and its usage counts completion tokens only as far as the
runtime's tokenizer re-reads them from the text, with no prompt tokens (the runtime reports
those when a generation finishes).

Cancellation: a client that disconnects while queued gives its slot back at once (the
handle leaves the queue, its counters drop); one that disconnects while its request runs
stops it at the runtime's next check (the turn's ``cancel`` event: between
prefill chunks and decode steps; a cold prefill is one forward and runs to its end), or at
the next delta. Either way the unfinished turn is never stored, and the handle receives one
final ``cancelled`` event, so no handler waits forever.

Shutdown (:meth:`ChatService.shutdown`) refuses new work with a 503, answers every queued
request with a 503 at once (their clients retry elsewhere) and waits for the running
generation, which ends at its next check if its client has gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from adapters.openai_server.config import ServerConfig
from adapters.openai_server.errors import (
    bad_request,
    over_tenant_share,
    overloaded,
    queue_timeout,
    shutting_down,
)
from adapters.openai_server.metrics import Metrics
from adapters.openai_server.params import check_structured
from adapters.openai_server.queue import FairQueue, Ticket
from adapters.openai_server.schemas import ChatCompletionRequest
from agentspec.chat.api import ChatResult, ChatStream
from agentspec.chat.formats import ToolFormat
from agentspec.chat.turn import ChatTurn
from agentspec.errors import Cancelled
from agentspec.spec import AgentSpec, VerifierPolicy
from agentspec.types import RequestStats, SessionRef, check_id

__all__ = ["ChatService", "Job", "Ticket", "build_job", "session_id_for"]


@dataclass(frozen=True)
class Job:
    """A request resolved into the chat turn the runtime runs, and the queue it waits in.

    Attributes:
        turn: The runtime's request: the messages (OpenAI shapes, tool calls included),
            the tool schemas, ``tool_choice``, ``stop`` and ``response_format`` as sent,
            the session (``None`` for an anonymous request), the agent spec with the
            request's sampling settings and the completion token limit. Its ``cancel`` is
            the running handle's, added when the job runs.
        tenant: The API key's tenant: the queue the request waits in (``None``: the
            session's tenant, else one shared anonymous queue).
    """

    turn: ChatTurn
    tenant: str | None = None

    @property
    def session_id(self) -> str | None:
        """The session the client can name again (``None`` for a one-off request, whose
        ephemeral ref is never stored and never reported)."""
        session = self.turn.session
        if session is None or session.ephemeral:
            return None
        return session.session_id

    @property
    def tools_active(self) -> bool:
        """True when tools are bound and not switched off by ``tool_choice="none"``."""
        return self.turn.tools_active

    @property
    def queue_key(self) -> str:
        """The tenant whose FIFO the job waits in (``""``: the anonymous one)."""
        if self.tenant is not None:
            return self.tenant
        session = self.turn.session
        return session.tenant if session is not None else ""


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
        session = SessionRef(f"anon-{uuid.uuid4().hex}", tenant=tenant, agent=agent,
                             ephemeral=True)
    # Under session scope an anonymous request uses its own request index only (session
    # None): a random id would draft exactly the same but leave an orphan row in the store.
    check_structured(request, raw_tools)
    turn = ChatTurn(messages, raw_tools, request.tool_choice, session, spec, limit,
                    request.stop_list(), response_format=request.response_format or None)
    return Job(turn, tenant)


def _runtime_part(stream_turn: Callable[[ChatTurn], ChatStream], name: str) -> Any:
    # `stream_turn` is normally a bound method of a ChatRuntime, which has a tokenizer and
    # a tool format; a bare function has neither.
    return getattr(getattr(stream_turn, "__self__", None), name, None)


class ChatService:
    """Runs jobs on the runtime, one at a time, on a dedicated worker thread, taking them
    from per-tenant queues round-robin (see the module docstring for the bounds).

    Args:
        stream_turn: The runtime's ``stream_turn`` (or a fake with its signature).
        config: Server settings (queue bounds, waiting and generation time limits).
        metrics: Where queue and finish numbers go.
        tool_format: Parses the tool calls of an answer cut at the generation deadline
            (default: the format of the runtime ``stream_turn`` is bound to).
        count_tokens: Counts the completion tokens of such an answer (default: the length
            of the runtime's tokenizer's encoding; 0 without a tokenizer).
    """

    def __init__(
        self, stream_turn: Callable[[ChatTurn], ChatStream], config: ServerConfig,
        metrics: Metrics, *,
        tool_format: ToolFormat | None = None,
        count_tokens: Callable[[str], int] | None = None,
    ) -> None:
        self._stream_turn = stream_turn
        self._config = config
        self._metrics = metrics
        self._tool_format = tool_format or _runtime_part(stream_turn, "tool_format")
        tokenizer = _runtime_part(stream_turn, "tokenizer")
        self._count_tokens = count_tokens or (
            (lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
            if tokenizer is not None else (lambda _: 0))
        # Every submit queues one executor task that serves whichever job is next, so the
        # single worker thread takes jobs in the fair queue's order, not in arrival order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentspec-gen")
        self._lock = threading.Lock()
        self._queue: FairQueue[Ticket] = FairQueue(config.max_waiting, config.tenant_share)
        self._closing = False

    @property
    def closing(self) -> bool:
        """True once :meth:`shutdown` began: new requests get a 503."""
        return self._closing

    @property
    def waiting(self) -> int:
        """Requests queued now (cancelled ones leave at once)."""
        with self._lock:
            return len(self._queue)

    def submit(self, job: Job) -> Ticket:
        """Queue a job; its events arrive on the returned handle.

        Raises:
            APIError: 503 when ``config.max_waiting`` requests are already queued or the
                server is shutting down; 429 when the job's tenant already has its share
                (``config.tenant_share``) queued.
        """
        gen = Ticket(asyncio.get_running_loop(), job, self._withdraw)
        with self._lock:  # the waiting gauge moves with the queue, under its lock
            refused = "shutdown" if self._closing else self._queue.offer(gen.tenant, gen)
            waiting = len(self._queue)
            if refused is None:
                self._metrics.queued(+1)
        if refused is not None:
            self._metrics.rejected(refused)
            if refused == "shutdown":
                raise shutting_down()
            if refused == "tenant_share":
                raise over_tenant_share(self._queue.max_per_tenant)
            raise overloaded(waiting)
        # RuntimeError: shutdown began after the offer; it drained the queue and answered gen.
        with contextlib.suppress(RuntimeError):
            self._executor.submit(self._serve_next)
        return gen

    def _withdraw(self, gen: Ticket) -> None:
        """A queued handle whose client left: off the queue now, its slot free for others.
        A handle already taken by the worker (or answered by shutdown) is left to them."""
        with self._lock:
            removed = self._queue.remove(gen.tenant, gen)
            if removed:
                self._metrics.queued(-1)
        if removed:
            self._metrics.cancelled("queued")
            gen.emit("cancelled", None)

    def _serve_next(self) -> None:
        """Run the next job of the fair queue (nothing when cancellations emptied it)."""
        with self._lock:
            gen = self._queue.pop()
            if gen is not None:
                self._metrics.queued(-1)
        if gen is None:
            return
        if gen.cancelled:  # its client left just as its turn came: no work, nothing stored
            self._metrics.cancelled("queued")
            gen.emit("cancelled", None)
            return
        waited = time.perf_counter() - gen.submitted
        if waited > self._config.max_queue_wait_s:
            self._metrics.rejected("queue_timeout")
            gen.emit("error", queue_timeout(waited, self._config.max_queue_wait_s))
            return
        self._run(gen)

    def _run(self, gen: Ticket) -> None:
        """Generate ``gen``'s job, handing each delta and one final event to its loop."""
        job = gen.job
        self._metrics.started(+1)
        limit = self._config.max_generation_s
        deadline = time.perf_counter() + limit if limit else math.inf
        text: list[str] = []
        stream: ChatStream | None = None
        try:
            stream = self._stream_turn(dataclasses.replace(job.turn, cancel=gen.cancel_event))
            for delta in stream:
                if gen.cancelled:
                    raise Cancelled("the client left")
                gen.emit("delta", delta)
                text.append(delta)
                if time.perf_counter() > deadline:
                    stream.close()  # nothing stored, as for any generation closed early
                    self._metrics.deadline_stop()
                    gen.emit("done", self._cut_short(job, "".join(text)))
                    return
            gen.emit("done", stream.result)
        except Cancelled:  # the runtime (or this loop) saw the client leave mid-generation
            self._metrics.cancelled("running")
            gen.emit("cancelled", None)
        except BaseException as exc:  # handed to the client as an error body, not lost
            gen.emit("error", exc)
        finally:
            if stream is not None:
                stream.close()  # on this thread: releases the runtime's lock if still held
            self._metrics.started(-1)

    def _cut_short(self, job: Job, text: str) -> ChatResult:
        """The answer of a generation stopped at the deadline: its text so far, finish
        reason ``length``; usage counts the completion tokens only (see module docstring)."""
        n = self._count_tokens(text)
        result = ChatResult.build(text, job.turn.tools if job.tools_active else None, "length",
                                  0, [], RequestStats(generated_tokens=n), self._tool_format)
        return dataclasses.replace(result, completion_tokens=n)

    def shutdown(self) -> None:
        """Refuse new work, answer queued requests with a 503, wait for the running one.

        Called by the app's lifespan after the HTTP server stopped accepting connections
        and gave open requests its graceful-shutdown time.
        """
        with self._lock:
            self._closing = True
            queued = self._queue.drain()
            self._metrics.queued(-len(queued))
        for gen in queued:
            self._metrics.rejected("shutdown")
            gen.cancel_event.set()  # off the queue already: nothing to withdraw
            gen.emit("error", shutting_down())
        self._executor.shutdown(wait=True, cancel_futures=True)
