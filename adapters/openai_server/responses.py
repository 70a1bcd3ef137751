"""ChatResult -> OpenAI response bodies: the whole completion, or its SSE chunks.

Tool calls: well-formed calls to bound tools become ``tool_calls`` (arguments as a JSON
string, ``finish_reason="tool_calls"``). Calls the model got wrong are not an error; they
stay in ``content`` as the model wrote them, so the agent (or a person) can see what
happened. Without bound tools nothing is parsed: the text is the content.

Streaming: content is sent as it is generated, except text from where the model's tool
format says a call opens (Hermes' ``<tool_call>``, Mistral's ``[TOOL_CALLS]``, an answer
that opens with ``{``; also a tail that could still become one, or trailing whitespace that
the final content may strip); at the end the remaining content, each tool call whole in
one chunk, the finish chunk, the optional usage chunk and ``data: [DONE]`` follow.
Concatenated deltas equal the non-streaming content. Events are
:class:`~sse_starlette.ServerSentEvent` objects framed as OpenAI frames them
(``data: <json>`` and a blank line, ``\\n`` line ends); the app
streams them with :class:`~sse_starlette.EventSourceResponse`.
"""

from __future__ import annotations

import json
from typing import Any, cast

from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import (
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
)
from openai.types.chat.chat_completion_message_tool_call import (
    ChatCompletionMessageToolCall,
    Function,
)
from openai.types.completion_usage import PromptTokensDetails
from sse_starlette import ServerSentEvent

from adapters.openai_server.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    FinishReason,
    completion_id,
    now,
)
from agentspec.chat.api import ChatResult
from agentspec.chat.formats import ToolFormat
from agentspec.chat.formats.fallback import FallbackFormat

SEP = "\n"  # OpenAI ends SSE lines with "\n" (sse-starlette's default is "\r\n")
DONE = ServerSentEvent("[DONE]", sep=SEP)


def content_of(result: ChatResult, tools_active: bool) -> str | None:
    """The ``content`` of the assistant message (``None`` when only tool calls remain)."""
    if not tools_active or not result.tool_calls:
        return result.text
    fmt = result.tool_format or FallbackFormat()
    parts = [result.content, *(fmt.raw_call_text(c.raw) for c in result.invalid_tool_calls)]
    return "\n".join(p for p in parts if p) or None


def tool_calls_of(result: ChatResult, tools_active: bool) -> list[ChatCompletionMessageToolCall]:
    """The well-formed tool calls, arguments serialised as JSON strings."""
    if not tools_active:
        return []
    return [
        ChatCompletionMessageToolCall(
            id=c.id, type="function",
            function=Function(name=c.name, arguments=json.dumps(c.arguments)),
        )
        for c in result.tool_calls
    ]


def finish_reason_of(result: ChatResult, tools_active: bool) -> FinishReason:
    """``tool_calls`` only for parsed calls to bound tools; else the runtime's reason."""
    if result.finish_reason == "tool_calls" and not tool_calls_of(result, tools_active):
        return "stop"
    if tools_active and result.tool_calls and result.finish_reason == "stop":
        return "tool_calls"
    # The runtime reports "stop" or "length"; the response models validate it at runtime.
    return cast(FinishReason, result.finish_reason)


def usage_of(result: ChatResult) -> CompletionUsage:
    """Prompt and completion token counts; ``prompt_tokens_details.cached_tokens`` are the
    prompt tokens whose KV was reused from earlier requests of the tenant."""
    return CompletionUsage(
        prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
        total_tokens=result.prompt_tokens + result.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=result.stats.cached_prompt_tokens),
    )


def stats_of(result: ChatResult, session_id: str | None) -> dict[str, Any]:
    """The ``agentspec`` extension: the request's speculative-decoding numbers, and whether
    its turn reached the session store (``stored``: ``False`` when it could not be written,
    ``None`` with no session or no store)."""
    return {"session_id": session_id, "stored": result.stored, **result.stats.to_dict()}


def completion(
    result: ChatResult, model: str, tools_active: bool, session_id: str | None
) -> ChatCompletion:
    """A whole ``chat.completion``."""
    calls = tool_calls_of(result, tools_active)
    message = ChatCompletionMessage(role="assistant", content=content_of(result, tools_active))
    if calls:  # left unset otherwise, so the body has no `tool_calls` key
        message.tool_calls = list(calls)
    choice = Choice(index=0, message=message, logprobs=None,
                    finish_reason=finish_reason_of(result, tools_active))
    return ChatCompletion(
        id=completion_id(), object="chat.completion", created=now(), model=model,
        choices=[choice], usage=usage_of(result), system_fingerprint=None,
        agentspec=stats_of(result, session_id),
    )


def sse(payload: ChatCompletionChunk | dict[str, Any]) -> ServerSentEvent:
    """One server-sent event carrying a JSON payload (``data: <json>\\n\\n`` on the wire)."""
    body = (payload.model_dump_json(exclude_unset=True)
            if isinstance(payload, ChatCompletionChunk) else json.dumps(payload))
    return ServerSentEvent(body, sep=SEP)


class ToolTextFilter:
    """Decides how much of the generated text is safe to stream as content so far."""

    def __init__(self, tools_active: bool, fmt: ToolFormat | None = None) -> None:
        self.tools_active = tools_active
        self.fmt = fmt or FallbackFormat()
        self.text = ""
        self.sent = ""

    def feed(self, delta: str) -> str:
        """Add a delta; return the new content that can be sent now."""
        self.text += delta
        if not self.tools_active:
            new, self.sent = self.text[len(self.sent):], self.text
            return new
        # From where a call opens (or may be opening) nothing is content until the end.
        safe = self.fmt.hold_from(self.text)
        # Content around tool calls is stripped at the end, so trailing whitespace waits.
        candidate = self.text[:safe].rstrip()
        if len(candidate) <= len(self.sent) or not candidate.startswith(self.sent):
            return ""
        new, self.sent = candidate[len(self.sent):], candidate
        return new

    @property
    def blocked(self) -> bool:
        """Whether text is being held back because a call opens (or may open) in it."""
        return self.tools_active and self.fmt.hold_from(self.text) < len(self.text)

    def rest(self, final: str | None) -> str:
        """What remains to send so the streamed content equals ``final``."""
        final = final or ""
        if not final.startswith(self.sent):
            return ""  # only whitespace can differ (a reply that starts with a blank)
        rest, self.sent = final[len(self.sent):], final
        return rest


class ChunkWriter:
    """Writes the SSE events of one streamed completion.

    Args:
        model: The model id echoed in every chunk.
        tools_active: Whether tool calls are parsed (see the module docstring).
        include_usage: Send a final chunk with ``usage`` (``stream_options``).
        fmt: The model's tool format (default: the fallback's ``<tool_call>``).
    """

    def __init__(self, model: str, tools_active: bool, include_usage: bool,
                 fmt: ToolFormat | None = None) -> None:
        self.id, self.created, self.model = completion_id(), now(), model
        self.tools_active = tools_active
        self.include_usage = include_usage
        self.filter = ToolTextFilter(tools_active, fmt)

    def _chunk(self, delta: ChoiceDelta, finish: FinishReason | None = None,
               agentspec: dict[str, Any] | None = None) -> ServerSentEvent:
        chunk = self._base([ChunkChoice(index=0, delta=delta, finish_reason=finish,
                                        logprobs=None)])
        if agentspec is not None:  # left unset otherwise, so the key is absent
            chunk.agentspec = agentspec
        return sse(chunk)

    def _base(self, choices: list[ChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, object="chat.completion.chunk",
                                   created=self.created, model=self.model, choices=choices,
                                   system_fingerprint=None)

    def start(self) -> ServerSentEvent:
        """The first chunk: the assistant role with empty content."""
        return self._chunk(ChoiceDelta(role="assistant", content=""))

    def delta(self, text: str) -> ServerSentEvent | None:
        """A content chunk for a generated delta (``None`` when nothing is safe to send yet)."""
        new = self.filter.feed(text)
        return self._chunk(ChoiceDelta(content=new)) if new else None

    def finish(self, result: ChatResult, session_id: str | None) -> list[ServerSentEvent]:
        """The closing events: remaining content, tool calls, finish, usage, ``[DONE]``."""
        out = []
        rest = self.filter.rest(content_of(result, self.tools_active))
        if rest:
            out.append(self._chunk(ChoiceDelta(content=rest)))
        for i, call in enumerate(tool_calls_of(result, self.tools_active)):
            function = ChoiceDeltaToolCallFunction(name=call.function.name,
                                                   arguments=call.function.arguments)
            out.append(self._chunk(ChoiceDelta(tool_calls=[
                ChoiceDeltaToolCall(index=i, id=call.id, type="function", function=function)
            ])))
        out.append(self._chunk(ChoiceDelta(), finish_reason_of(result, self.tools_active),
                               agentspec=stats_of(result, session_id)))
        if self.include_usage:
            usage = self._base([])
            usage.usage = usage_of(result)
            out.append(sse(usage))
        out.append(DONE)
        return out
