"""Request and response bodies of the Chat Completions API, in OpenAI's shapes.

Every parameter OpenAI defines is either honoured or rejected with a 400 naming it
(:mod:`adapters.openai_server.params` holds the table and runs before these models), so
values the server cannot honour (``n > 1``, ``logprobs``, penalties, image content) are
never silently answered with something else.
Responses carry one extension field, ``agentspec``: the speculative-decoding numbers of the
request, which OpenAI clients keep as an extra attribute and otherwise ignore.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_STOP = 4  # OpenAI's limit on stop sequences


class _Lenient(BaseModel):
    # Unknown fields are dropped: newer clients send fields older servers do not know.
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Lenient):
    """The function part of a tool call: a name and its arguments as a JSON string."""

    name: str
    arguments: str = "{}"


class ToolCallIn(_Lenient):
    """A tool call inside an assistant message of the request history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Lenient):
    """A content part; only ``text`` parts are supported by this text-only model."""

    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    """One message of the conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The message text; content parts are joined (non-text parts are rejected)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content part of type {part.type!r} is not supported")
            texts.append(part.text)
        return "".join(texts)


class FunctionDef(_Lenient):
    """A function a tool exposes (``parameters`` is a JSON schema)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Lenient):
    """A tool the model may call."""

    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Lenient):
    """``stream_options``: ``include_usage`` adds a final chunk with token counts."""

    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    """A ``POST /v1/chat/completions`` body.

    ``temperature`` defaults to the serving agent spec's (greedy, 0) rather than OpenAI's 1:
    agentspec's guarantee is output identical to the model's own greedy decoding.
    """

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # torch seeds a generator from any value in [-2**63, 2**64); larger ones overflowed
    # into a 500. Strict: "stream": "yes" is a client bug, not a request to stream.
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    n: int | None = Field(default=None, ge=1, le=1)
    logprobs: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None:
            if len(stops) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
            if any(not s for s in stops):
                raise ValueError("stop sequences must be non-empty")
        return stops

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, str) and v not in ("none", "auto", "required"):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or a tool object")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs are not supported by this server")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported (it would change greedy output)")
        return self

    def stop_list(self) -> list[str]:
        """The stop sequences as a list (the validator normalised a single string)."""
        return list(self.stop or [])

    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens


# -- responses ----------------------------------------------------------------------------


def completion_id() -> str:
    """A fresh ``chatcmpl-...`` id."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in seconds, as OpenAI's ``created``."""
    return int(time.time())


class ToolCallOut(BaseModel):
    """A tool call in a response: ``arguments`` is a JSON string."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(BaseModel):
    """The assistant message of a non-streaming choice (``content`` is null with calls)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI omits `tool_calls` when there are none (some clients reject a null list).
        data: dict[str, Any] = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class Choice(BaseModel):
    """One choice of a completion (this server always returns exactly one)."""

    index: int = 0
    message: ResponseMessage
    finish_reason: str
    logprobs: None = None


class Usage(BaseModel):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    """A ``chat.completion`` object."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None
    agentspec: dict[str, Any] | None = None


class ToolCallDelta(BaseModel):
    """A tool call inside a streaming delta (sent whole, in one chunk per call)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Delta(BaseModel):
    """What a chunk adds to the message; unset fields are omitted, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _omit_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None}


class ChunkChoice(BaseModel):
    """One choice of a streaming chunk."""

    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """A ``chat.completion.chunk`` object (one SSE event)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    agentspec: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _omit_extras(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # `usage` appears only in the final usage chunk, `agentspec` only in the finish chunk.
        data: dict[str, Any] = handler(self)
        for key in ("usage", "agentspec"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ModelCard(BaseModel):
    """An entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "agentspec"


class ModelList(BaseModel):
    """The body of ``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
