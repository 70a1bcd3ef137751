"""What the faces (LangChain, the OpenAI-compatible server) program against: the chat
runtime's contract, the result of one chat completion and the prompt of one request.

:class:`ChatRuntime` is implemented by :class:`agentspec.runtime.Runtime` (agentspec's
engine) and ``adapters.vllm.VLLMRuntime`` (a vLLM engine), both through
:class:`agentspec.chat.base.BaseChatRuntime`; a turn is a
:class:`~agentspec.chat.turn.ChatTurn`, :class:`ChatResult` is what both return (at the
end of a :data:`ChatStream`), :func:`chat_prompt_ids` how both render a request.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agentspec.chat.formats import ToolFormat, format_for
from agentspec.chat.formats.fallback import FallbackFormat
from agentspec.chat.stream import ResultStream
from agentspec.chat.templates import render_prompt
from agentspec.chat.tool_calls import InvalidToolCall, ToolCall, tool_names
from agentspec.chat.turn import ChatTurn, ToolChoice
from agentspec.interfaces import ServedModel, TurnStore
from agentspec.spec import AgentSpec
from agentspec.types import RequestStats

__all__ = [
    "ChatResult", "ChatRuntime", "ChatStream", "ChatTurn", "ToolChoice", "chat_prompt_ids",
    "forced_prefix", "served_dtype",
]


@dataclass
class ChatResult:
    """One chat completion.

    Attributes:
        text: The raw generated text (tool-call markup included).
        content: Text outside tool calls.
        tool_calls: Well-formed calls to bound tools.
        invalid_tool_calls: Calls the model got wrong (bad JSON, unknown tool, ...).
        finish_reason: ``stop``, ``length`` or ``tool_calls``.
        prompt_tokens: Tokens in the rendered prompt.
        completion_tokens: Tokens generated.
        stats: Speculative decoding numbers of the request.
        tokens: Generated token ids.
        tool_format: The tool format the answer was parsed in (faces write invalid calls
            back in it).
        stored: Whether the turn reached the session store (``False``: it could not be
            written and was logged and counted; ``None``: no session or no store).
    """

    text: str
    content: str
    tool_calls: list[ToolCall]
    invalid_tool_calls: list[InvalidToolCall]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: RequestStats = field(default_factory=RequestStats)
    tokens: list[int] = field(default_factory=list)
    tool_format: ToolFormat | None = field(default=None, repr=False, compare=False)
    stored: bool | None = None


    @classmethod
    def build(
        cls,
        text: str,
        tools: Sequence[dict[str, Any]] | None,
        finish_reason: str,
        prompt_tokens: int,
        tokens: list[int],
        stats: RequestStats,
        fmt: ToolFormat | None = None,
    ) -> ChatResult:
        """Parse ``text`` (the whole answer, forced prefix included) into a result.

        Tool calls are parsed in the model's tool format ``fmt`` (default: the fallback)
        against the bound tools' names; without bound tools nothing is parsed. An answer
        that stopped on its own with a well-formed call finishes with ``tool_calls``.
        """
        if tools:
            parsed = (fmt or FallbackFormat()).parse(text, tool_names(list(tools)))
        else:
            parsed = FallbackFormat().parse(text, None)
        finish = finish_reason
        if parsed.tool_calls and finish == "stop":
            finish = "tool_calls"
        return cls(text, parsed.content, parsed.tool_calls, parsed.invalid_tool_calls, finish,
                   prompt_tokens, len(tokens), stats, tokens, fmt)



#: A turn's text deltas, then its :class:`ChatResult` (``stream.result``).
ChatStream = ResultStream[ChatResult]


def chat_prompt_ids(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: ToolChoice = None,
    assistant_prefix: str = "",
    fmt: ToolFormat | None = None,
) -> tuple[list[int], str]:
    """Rendered prompt token ids and the text that opens the assistant turn.

    Args:
        tokenizer: The model's tokenizer (chat template).
        messages: Chat messages.
        tools: Tool schemas rendered into the prompt (not with ``tool_choice="none"``).
        tool_choice: Forces a tool call by writing its opening into the answer.
        assistant_prefix: Text the caller puts at the start of the answer (e.g. a file's
            opening fence), before any forced tool call.
        fmt: The model's tool format (default: the one chosen for ``tokenizer``).

    Returns:
        ``(ids, prefix)``: the prompt with the prefix's tokens appended, and the prefix.
    """
    fmt = fmt or format_for(tokenizer)
    use_tools = None if tool_choice == "none" else tools
    ids = render_prompt(tokenizer, messages, use_tools, fmt)
    prefix = assistant_prefix + forced_prefix(tool_choice, tools, fmt)
    if prefix:
        ids = ids + list(tokenizer.encode(prefix, add_special_tokens=False))
    return ids, prefix


def forced_prefix(
    tool_choice: ToolChoice, tools: Sequence[dict[str, Any]] | None, fmt: ToolFormat | None = None
) -> str:
    """Assistant text that forces a tool call in format ``fmt`` (default: the fallback's
    ``<tool_call>{...}``; ``""`` when nothing is forced).

    ``"any"``/``"required"`` open a call and let the model pick the name; a named tool
    (``"name"`` or ``{"type": "function", "function": {"name": ...}}``) writes the name too.

    Raises:
        ConfigError: a forced choice without tools, or a name that is not bound.
    """
    return (fmt or FallbackFormat()).forced_prefix(tool_choice, tools)


@runtime_checkable
class ChatRuntime(Protocol):
    """A loaded model serving chat requests: what the adapters need from a runtime.

    :class:`agentspec.runtime.Runtime` (agentspec's engine) and
    ``adapters.vllm.VLLMRuntime`` (a vLLM engine) both implement it, so the LangChain chat
    model and the OpenAI-compatible server run on either.

    The attributes are read-only here (properties), so an implementation may hold any
    subtype (``Runtime.target`` is an :class:`~agentspec.targets.hf.HFTarget`).
    """

    @property
    def target(self) -> ServedModel:
        """The served model; its ``name`` is reported to clients."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (chat template, decode)."""
        ...

    @property
    def store(self) -> TurnStore | None:
        """The session store (``None``: no persistence in this process)."""
        ...

    @property
    def default_spec(self) -> AgentSpec:
        """The policy of requests that name no agent spec."""
        ...

    @property
    def tool_format(self) -> ToolFormat:
        """The model's tool-call format, bound to its tokenizer: faces stream, parse and
        write calls back in it (see :mod:`agentspec.chat.formats`)."""
        ...

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """Held while a request decodes (requests are served one at a time)."""
        ...

    def stream_turn(self, turn: ChatTurn) -> ChatStream:
        """Stream one turn: iterate the returned stream for the answer's text deltas, then
        read its ``result``.

        The turn's ``assistant_prefix`` opens the answer (it is part of the prompt; the
        deltas and the result's text start with it), before any call that its
        ``tool_choice`` forces; its ``response_format`` (OpenAI's ``json_object`` /
        ``json_schema``) constrains the answer to a grammar. Its ``cancel``, set from
        another thread, stops the turn with :class:`~agentspec.errors.Cancelled` at the
        runtime's next check (agentspec's runtime checks between prefill chunks and decode
        steps; the server passes one for every request, so a runtime must honour it, and
        may check it only per delta). Closing the stream early stops the turn.
        """
        ...

    def stream_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        **fields: Any,
    ) -> ChatStream:
        """:meth:`stream_turn` of the :class:`~agentspec.chat.turn.ChatTurn` whose fields
        the keywords name."""
        ...

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        **fields: Any,
    ) -> ChatResult:
        """Complete a chat (the keywords of :meth:`stream_chat`)."""
        ...


def served_dtype(runtime: Any) -> str | None:
    """The precision ``runtime``'s model runs in, as its target reports it
    (:attr:`HFTarget.dtype <agentspec.targets.hf.HFTarget>`: ``"auto"`` already resolved,
    e.g. ``"w8a16"``); ``None`` where the runtime's target does not say (a vLLM engine)."""
    dtype = getattr(getattr(runtime, "target", None), "dtype", None)
    return dtype if isinstance(dtype, str) else None
