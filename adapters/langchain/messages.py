"""LangChain messages and tools <-> agentspec's plain dict messages and OpenAI tool schemas.

The runtime speaks OpenAI-style dicts (``{"role": ..., "content": ...}``, tool schemas as
``{"type": "function", "function": {...}}``); LangChain speaks ``BaseMessage`` objects and
accepts tools as ``BaseTool``s, pydantic models, functions or dicts. This module converts
both ways and fails early, with an :class:`~agentspec.errors.ConfigError`, on what the
embedded text-only model cannot take (images, audio, legacy function messages, schemas that
are not JSON, arguments that cannot be serialised).

Tool calls of earlier assistant turns are re-rendered as compact JSON in the model's own key
order (``ensure_ascii=False``), the same form the model writes them in, so a transcript
re-reads its own calls as the token sequences the session cache already holds.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import InvalidToolCall, ToolCall, invalid_tool_call, tool_call
from langchain_core.utils.function_calling import convert_to_openai_tool

from agentspec.chat.checks import check_tool_replies
from agentspec.chat.formats import ToolFormat
from agentspec.chat.formats.fallback import FallbackFormat
from agentspec.chat.tool_calls import InvalidToolCall as RawInvalidCall
from agentspec.chat.tool_calls import ToolCall as RawCall
from agentspec.errors import ConfigError

log = logging.getLogger(__name__)


class MessageConversionError(ConfigError):
    """A LangChain message the embedded model cannot take (wrong type, non-text content)."""


class ToolSchemaError(ConfigError):
    """A tool could not be turned into a valid, JSON-serialisable function schema."""


# Roles of ChatMessage accepted as aliases of the runtime's four roles.
_ROLE_ALIASES = {
    "system": "system", "developer": "system", "user": "user", "human": "user",
    "assistant": "assistant", "ai": "assistant", "tool": "tool",
}
# Content blocks that carry no text for the model: tool calls travel in ``tool_calls`` and
# reasoning is not fed back.
_SKIPPED_BLOCKS = {
    "tool_use", "tool_call", "tool_call_chunk", "server_tool_call", "reasoning", "thinking",
    "redacted_thinking", "invalid_tool_call",
}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_CALL_NAME_RE = re.compile(r'"name"\s*:\s*"([^"]+)"')


def content_text(content: str | list[Any], where: str) -> str:
    """The text of a message's content (a string or a list of content blocks).

    Raises:
        MessageConversionError: a block that is not text (image, audio, file, ...).
    """
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
            continue
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind in _SKIPPED_BLOCKS:
            continue
        else:
            raise MessageConversionError(
                f"{where} has a {kind!r} content block; the embedded model reads text only "
                "(supported blocks: plain strings and {'type': 'text'})"
            )
    return "".join(parts)


def _arguments_json(call: ToolCall, where: str) -> str:
    try:
        return json.dumps(call["args"], ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise MessageConversionError(
            f"{where}: arguments of tool call {call.get('name')!r} are not JSON-serialisable "
            f"({exc}); pass plain dicts, lists, strings, numbers, booleans or None"
        ) from exc


def _check_replies(messages: Sequence[BaseMessage]) -> None:
    """Each ToolMessage must answer a (valid or invalid) call of an earlier AIMessage."""
    shadow: list[dict[str, Any]] = []
    for msg in messages:
        if isinstance(msg, AIMessage):
            # Malformed calls are answered too (an error result tells the model what failed).
            calls = [*msg.tool_calls, *msg.invalid_tool_calls]
            shadow.append({"role": "assistant", "tool_calls": [{"id": c.get("id")} for c in calls]})
        elif isinstance(msg, ToolMessage):
            shadow.append({"role": "tool", "tool_call_id": msg.tool_call_id})
        else:
            shadow.append({"role": "other"})
    try:
        check_tool_replies(shadow)
    except ConfigError as exc:
        raise MessageConversionError(f"{exc} (ToolMessage.tool_call_id)") from None


def to_agentspec_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """Convert LangChain messages to the runtime's dict messages.

    Args:
        messages: System, human, AI, tool or chat messages (roles system / user /
            assistant / tool and their aliases).

    Returns:
        Dicts with ``role`` and ``content``; assistant turns carry OpenAI-style
        ``tool_calls`` whose arguments are JSON strings.

    Raises:
        MessageConversionError: an unsupported message type or role, non-text content,
            tool-call arguments that are not JSON-serialisable, or a ``ToolMessage`` that
            answers no earlier tool call.
    """
    out: list[dict[str, Any]] = []
    _check_replies(messages)
    for i, msg in enumerate(messages):
        where = f"message {i} ({type(msg).__name__})"
        text = content_text(msg.content, where) if isinstance(msg, BaseMessage) else ""
        if isinstance(msg, SystemMessage):
            out.append({"role": "system", "content": text})
        elif isinstance(msg, HumanMessage):
            out.append({"role": "user", "content": text})
        elif isinstance(msg, AIMessage):
            turn: dict[str, Any] = {"role": "assistant", "content": text}
            if msg.tool_calls:
                turn["tool_calls"] = [
                    {"id": c.get("id"), "type": "function",
                     "function": {"name": c["name"], "arguments": _arguments_json(c, where)}}
                    for c in msg.tool_calls
                ]
            out.append(turn)
        elif isinstance(msg, ToolMessage):
            if msg.status == "error" and not text.lower().startswith("error"):
                # Say so explicitly: the prompt has no status field, only the text.
                text = f"Error: {text}"
            out.append({"role": "tool", "content": text})
        elif isinstance(msg, ChatMessage) and msg.role.lower() in _ROLE_ALIASES:
            out.append({"role": _ROLE_ALIASES[msg.role.lower()], "content": text})
        else:
            kind = msg.role if isinstance(msg, ChatMessage) else type(msg).__name__
            raise MessageConversionError(
                f"{where}: unsupported message type or role {kind!r}; use SystemMessage, "
                "HumanMessage, AIMessage or ToolMessage"
            )
    return out


def convert_tools(tools: Sequence[Any], strict: bool | None = None) -> list[dict[str, Any]]:
    """Convert LangChain tools, pydantic models, functions or dicts to OpenAI tool schemas.

    Args:
        tools: Anything :func:`convert_to_openai_tool` accepts.
        strict: Passed to :func:`convert_to_openai_tool`.

    Returns:
        ``{"type": "function", "function": {"name", "description", "parameters"}}`` dicts,
        one per tool name (a name given twice keeps its first schema).

    Raises:
        ToolSchemaError: a tool that cannot be converted, a missing or invalid name,
            duplicate names, parameters that are not an object schema, or a schema that is
            not JSON-serialisable.
    """
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        try:
            schema = convert_to_openai_tool(tool, strict=strict)
        except Exception as exc:  # the converter raises ValueError, TypeError, KeyError, ...
            raise ToolSchemaError(
                f"tool {i} ({type(tool).__name__}) is not a valid tool: {exc}"
            ) from exc
        fn = schema.get("function")
        if not isinstance(fn, dict):
            raise ToolSchemaError(f"tool {i} did not convert to a function schema: {schema!r}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ToolSchemaError(
                f"tool {i} has invalid name {name!r}: use 1-64 characters of [A-Za-z0-9_.:-]"
            )
        if name in seen:
            # The same tool given twice (a pydantic model and its JSON schema, say): the
            # prompt can only name it once, so the first definition wins.
            log.debug("tool %r bound more than once; keeping the first schema", name)
            continue
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolSchemaError(f"tool {name!r}: parameters must be a JSON object schema")
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise ToolSchemaError(
                f"tool {name!r}: schema is not JSON-serialisable ({exc})"
            ) from exc
        seen.add(name)
        out.append(schema)
    return out


def normalise_tool_choice(choice: Any, tools: Sequence[dict[str, Any]]) -> str | None:
    """Map LangChain's ``tool_choice`` spellings to the runtime's.

    ``"any"``, ``"required"`` and ``True`` force some call; with exactly one bound tool that
    is the same as naming it, which also lets the runtime write the name for the model.
    A tool name or ``{"type": "function", "function": {"name": ...}}`` forces that tool;
    ``"auto"``/``None``/``False`` leave the choice to the model; ``"none"`` hides the tools.

    Raises:
        ConfigError: a choice that names no bound tool, or forcing without tools.
    """
    names = [t["function"]["name"] for t in tools]
    if choice in (None, False, "auto"):
        return None
    if choice == "none":
        return "none"
    if choice in (True, "any", "required"):
        if not names:
            raise ConfigError(f"tool_choice={choice!r} needs at least one bound tool")
        return names[0] if len(names) == 1 else "any"
    if isinstance(choice, dict):
        choice = (choice.get("function") or {}).get("name") or choice.get("name")
    if isinstance(choice, str) and choice in names:
        return choice
    raise ConfigError(f"tool_choice {choice!r} names no bound tool; bound tools: {names}")


def to_langchain_tool_calls(
    calls: Sequence[RawCall], invalid: Sequence[RawInvalidCall]
) -> tuple[list[ToolCall], list[InvalidToolCall]]:
    """The runtime's parsed calls as LangChain ``tool_calls`` / ``invalid_tool_calls``.

    An invalid call keeps what could be read of it: its name (recovered from the raw text
    when the JSON did not parse), its raw arguments text and the parser's reason.
    """
    good = [tool_call(name=c.name, args=dict(c.arguments), id=c.id) for c in calls]
    bad: list[InvalidToolCall] = []
    for c in invalid:
        name = c.name
        if name is None and (m := _CALL_NAME_RE.search(c.raw)):
            name = m.group(1)
        bad.append(invalid_tool_call(
            name=name, args=c.arguments if c.arguments is not None else c.raw, id=c.id,
            error=c.error,
        ))
    return good, bad


class VisibleText:
    """Streams the text outside tool-call markup, in the model's tool format.

    Deltas pass through until a call opens (Hermes' ``<tool_call>``, Mistral's
    ``[TOOL_CALLS]``, an answer that opens with ``{``: :meth:`ToolFormat.hold_from`); from
    then on everything is held (the calls arrive parsed, in the final chunk). A tail that
    could still grow into an opening is held back until it cannot.

    Args:
        fmt: The model's tool format (default: the fallback's ``<tool_call>``).
    """

    def __init__(self, fmt: ToolFormat | None = None) -> None:
        self._fmt = fmt or FallbackFormat()
        self._text = ""
        self._sent = 0

    def feed(self, delta: str) -> str:
        """Add a delta; return the text that is now certainly visible."""
        self._text += delta
        safe = max(self._fmt.hold_from(self._text), self._sent)
        out, self._sent = self._text[self._sent:safe], safe
        return out

    def flush(self) -> str:
        """The held-back tail, once the stream has ended without opening a call."""
        if self._fmt.parse(self._text[self._sent:]).tool_calls or self._opened():
            return ""
        tail, self._sent = self._text[self._sent:], len(self._text)
        return tail

    def _opened(self) -> bool:
        # Text held because a call opened (not just a tail that might have): never shown.
        rest = self._text[self._sent:]
        return any(tag and tag in rest for tag in self._fmt.tags[:1])
