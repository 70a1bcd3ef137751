"""Request and response bodies of the Chat Completions API, in OpenAI's shapes.

Every parameter OpenAI defines is either honoured or rejected with a 400 naming it
(:mod:`adapters.openai_server.params` holds the table and runs before these models), so
values the server cannot honour (``n > 1``, ``logprobs``, penalties, image content) are
never silently answered with something else.
Responses are the ``openai`` package's own models; they carry one extension field,
``agentspec``: the speculative-decoding numbers of the request, which OpenAI clients keep as
an extra attribute and otherwise ignore.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from openai.types import Model
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatCompletionChunk
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from agentspec.chat.checks import check_stops
from agentspec.errors import ConfigError

# -- requests -----------------------------------------------------------------------------
# Hand-written on purpose: openai ships request params only as TypedDicts, which pydantic
# would not hold to the limits below (ranges, strict ``stream``, unsupported values), and
# those limits are what turn a bad request into a 400 naming the parameter.


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
    # OpenAI's ranges; repetition_penalty is vLLM's extra parameter (> 0, 1 is off).
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None:
            try:
                check_stops(stops)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
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
        return self

    def stop_list(self) -> list[str]:
        """The stop sequences as a list (the validator normalised a single string)."""
        return list(self.stop or [])

    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens


# -- responses ----------------------------------------------------------------------------
# The bodies the server sends are openai's own pydantic models (subclassed below for
# the two with the extension), so their fields and types follow the client library. They are
# sent with ``exclude_unset`` (see :func:`wire`): a field appears only when the server set it,
# which keeps ``content: null``, ``logprobs: null`` and ``system_fingerprint: null`` while
# leaving out what openai's models add for other features (``refusal``, ``audio``,
# ``service_tier``, ...), ``tool_calls`` when there are none (some clients reject a null
# list), and ``usage``/``agentspec`` in the chunks that do not carry them.

FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


def completion_id() -> str:
    """A fresh ``chatcmpl-...`` id."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in seconds, as OpenAI's ``created``."""
    return int(time.time())


def wire(body: BaseModel) -> dict[str, Any]:
    """The JSON-ready dict of a response body: only the fields the server set."""
    return body.model_dump(mode="json", exclude_unset=True)


class ChatCompletion(OpenAIChatCompletion):
    """A ``chat.completion`` object with the ``agentspec`` extension (the request's stats)."""

    agentspec: dict[str, Any] | None = None


class ChatCompletionChunk(OpenAIChatCompletionChunk):
    """A ``chat.completion.chunk`` (one SSE event); ``agentspec`` rides on the finish chunk."""

    agentspec: dict[str, Any] | None = None


class ModelList(BaseModel):
    """The body of ``GET /v1/models`` (openai has a client-side page type, no model for it)."""

    object: Literal["list"] = "list"
    data: list[Model]
