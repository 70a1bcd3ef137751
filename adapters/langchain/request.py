"""One chat call on the runtime, as LangChain results: deltas, chunks, messages, metadata.

:class:`ChatRequest` is everything a call resolved: the runtime, the
:class:`~agentspec.chat.turn.ChatTurn` it runs (messages, tools, session, limits) and what
only LangChain needs (a deadline, retries, the reported model name). The functions here
run it — synchronously, or in a worker thread feeding an ``asyncio`` queue — and turn the
runtime's :class:`~agentspec.chat.api.ChatResult` into an ``AIMessage`` (or a stream of
``AIMessageChunk`` s) with ``usage_metadata`` and ``response_metadata``: model name, finish
reason and the speculative decoding numbers (accepted-length histogram, target forwards
per 1,000 tokens, drafter wins).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import InvalidToolCall, ToolCall
from langchain_core.outputs import ChatGenerationChunk
from langchain_core.runnables import RunnableConfig, ensure_config

from adapters.langchain.messages import VisibleText, to_langchain_tool_calls
from agentspec.chat.api import ChatResult, ChatRuntime, served_dtype
from agentspec.chat.stream import ResultStream
from agentspec.chat.turn import ChatTurn
from agentspec.errors import AgentSpecError, StoreBusyError
from agentspec.spec import AgentSpec
from agentspec.types import check_id


class GenerationTimeoutError(AgentSpecError, TimeoutError):
    """A call ran past its ``timeout``; the partial output is discarded."""


@dataclass
class ChatRequest:
    """A resolved chat call.

    Attributes:
        runtime: The :class:`~agentspec.chat.api.ChatRuntime` that decodes (agentspec's
            Runtime, the vLLM backend).
        turn: The chat turn it runs: rendered-ready dict messages, OpenAI tool schemas
            (``None`` when no tools are offered), ``tool_choice`` (``None``: the model
            decides, ``"any"`` or a tool name), the session (``None``: one-off request),
            the agent's spec (always set here), limits, stop strings and an OpenAI
            ``response_format`` (grammar-constrained JSON).
        model_name: Reported as ``response_metadata["model_name"]``.
        max_retries: Retries after a busy session store, before any output.
        deadline: ``time.monotonic()`` value past which the call fails.
        return_token_ids: Report generated token ids in ``response_metadata``.
    """

    runtime: ChatRuntime
    turn: ChatTurn
    model_name: str
    max_retries: int = 2
    deadline: float | None = None
    return_token_ids: bool = False

    @property
    def spec(self) -> AgentSpec:
        """The agent spec the turn runs under."""
        return self.turn.spec or self.runtime.default_spec


def thread_session(value: Any) -> str:
    """A valid session id for an arbitrary thread id (kept when already valid, else hashed)."""
    text = str(value)
    try:
        return check_id("session", text)
    except ValueError:
        return "thread-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def session_from_config(config: RunnableConfig | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` plus the session id named by the run config, if any.

    Precedence: an explicit ``session_id`` keyword, ``configurable.session_id``,
    ``configurable.thread_id`` (LangGraph), then the same keys in ``metadata``. The effective
    config includes the one inherited from an enclosing runnable (a LangGraph node).
    """
    if kwargs.get("session_id") is not None:
        return kwargs
    cfg = ensure_config(config)
    configurable = cfg.get("configurable") or {}
    metadata = cfg.get("metadata") or {}
    for source in (configurable, metadata):
        if source.get("session_id") is not None:
            return {**kwargs, "session_id": check_id("session", str(source["session_id"]))}
        if source.get("thread_id") is not None:
            return {**kwargs, "session_id": thread_session(source["thread_id"])}
    return kwargs


def session_from_metadata(run_manager: Any) -> str | None:
    """The session id in a run's callback metadata (entry points that bypass ``invoke``)."""
    meta = getattr(run_manager, "metadata", None) or {}
    if meta.get("session_id") is not None:
        return check_id("session", str(meta["session_id"]))
    if meta.get("thread_id") is not None:
        return thread_session(meta["thread_id"])
    return None


def stream_deltas(req: ChatRequest) -> Generator[str, None, ChatResult]:
    """Yield the engine's text deltas, then return the final :class:`ChatResult`
    (wrap it in a :class:`~agentspec.chat.stream.ResultStream` to read it after iterating).

    Raises:
        GenerationTimeoutError: the call passed ``req.deadline``.
        StoreBusyError: the session store stayed locked through every retry.
    """
    attempt = 0
    while True:
        produced = False
        stream = req.runtime.stream_turn(req.turn)
        try:
            for delta in stream:
                if req.deadline is not None and time.monotonic() > req.deadline:
                    raise GenerationTimeoutError(
                        "generation ran past its timeout; raise `timeout` or lower `max_tokens`"
                    )
                produced = True
                yield delta
            return stream.result
        except StoreBusyError:
            # A busy SQLite store is transient; a retry is only safe before any output.
            if produced or attempt >= req.max_retries:
                raise
            attempt += 1
            time.sleep(0.05 * 2**attempt)
        finally:
            stream.close()  # releases the model lock when the caller stops early


def usage(result: ChatResult) -> UsageMetadata:
    """LangChain token usage of a result; ``input_token_details["cache_read"]`` counts the
    prompt tokens whose KV was reused from earlier requests (prefix reuse)."""
    return UsageMetadata(
        input_tokens=result.prompt_tokens, output_tokens=result.completion_tokens,
        total_tokens=result.prompt_tokens + result.completion_tokens,
        input_token_details=InputTokenDetails(cache_read=result.stats.cached_prompt_tokens),
    )


def response_metadata(req: ChatRequest, result: ChatResult) -> dict[str, Any]:
    """Model name, finish reason and the request's speculative decoding numbers, with the
    precision the model ran in (``dtype``: ``auto`` resolved, e.g. ``w8a16``; ``None``
    where the runtime does not say)."""
    stats = result.stats.to_dict()
    # String keys: checkpointers (JSON, msgpack) persist messages, and JSON has no int keys.
    stats["accepted_histogram"] = {str(k): v for k, v in stats["accepted_histogram"].items()}
    stats["drafting_method"] = req.spec.drafting.method
    stats["dtype"] = served_dtype(req.runtime)
    session = req.turn.session
    stats["session_id"] = session.session_id if session else None
    meta: dict[str, Any] = {
        "model_name": req.model_name, "finish_reason": result.finish_reason,
        "speculative": stats,
    }
    if req.return_token_ids:
        meta["token_ids"] = list(result.tokens)
    return meta


def result_message(req: ChatRequest, result: ChatResult) -> AIMessage:
    """The ``AIMessage`` of a finished call (tool calls parsed only when tools were bound)."""
    if not req.turn.tools_active:
        return AIMessage(content=result.text, usage_metadata=usage(result),
                         response_metadata=response_metadata(req, result))
    calls, invalid = to_langchain_tool_calls(result.tool_calls, result.invalid_tool_calls)
    return AIMessage(
        content=result.content, tool_calls=calls, invalid_tool_calls=invalid,
        usage_metadata=usage(result), response_metadata=response_metadata(req, result),
    )


def final_chunk(req: ChatRequest, result: ChatResult) -> AIMessageChunk:
    """The last chunk of a stream: tool calls, usage and metadata, no new text."""
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    if req.turn.tools_active:
        calls, invalid = to_langchain_tool_calls(result.tool_calls, result.invalid_tool_calls)
    return AIMessageChunk(
        content="", tool_calls=calls, invalid_tool_calls=invalid, usage_metadata=usage(result),
        response_metadata=response_metadata(req, result), chunk_position="last",
    )


def stream_chunks(req: ChatRequest) -> Generator[ChatGenerationChunk, None, None]:
    """Chunks of a call: one per visible text delta, then :func:`final_chunk`.

    With tools bound, tool-call markup is not streamed as text: it arrives parsed, in the
    final chunk, exactly as ``invoke`` returns it.
    """
    visible = VisibleText(req.runtime.tool_format) if req.turn.tools_active else None
    deltas = ResultStream(stream_deltas(req))
    for delta in deltas:
        text = visible.feed(delta) if visible is not None else delta
        if text:
            yield ChatGenerationChunk(message=AIMessageChunk(content=text))
    if visible is not None and (tail := visible.flush()):
        yield ChatGenerationChunk(message=AIMessageChunk(content=tail))
    result = deltas.result
    yield ChatGenerationChunk(message=final_chunk(req, result),
                              generation_info={"finish_reason": result.finish_reason})


async def agen_chunks(req: ChatRequest) -> AsyncIterator[ChatGenerationChunk]:
    """:func:`stream_chunks` decoded in a worker thread, delivered through a queue.

    If the consumer stops early the worker is told to stop: it closes the stream after the
    current decode step, which releases the model for the next request.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancelled = threading.Event()

    def put(item: tuple[str, Any]) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            cancelled.set()

    def produce() -> None:
        gen = stream_chunks(req)
        try:
            for chunk in gen:
                if cancelled.is_set():
                    break
                put(("chunk", chunk))
            put(("done", None))
        except BaseException as exc:  # handed to the consumer, re-raised there
            put(("error", exc))
        finally:
            gen.close()

    loop.run_in_executor(None, produce)
    try:
        while True:
            kind, item = await queue.get()
            if kind == "chunk":
                yield item
            elif kind == "error":
                raise item
            else:
                return
    finally:
        cancelled.set()
