"""Parsing tool calls out of model text.

The prompt (see :mod:`agentspec.chat.templates`) asks for ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``. A small model often gets this almost right, so the parser is lenient
about where calls sit and strict about what counts as valid: a call whose JSON does not
parse, has no string name, names an unknown tool, or whose arguments are not an object is
returned as an *invalid* call with the reason, never raised.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: a known tool name and an arguments object."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class InvalidToolCall:
    """A call the model attempted but got wrong; ``error`` says how."""

    raw: str
    error: str
    name: str | None = None
    arguments: str | None = None
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ParsedOutput:
    """Model text split into visible content and tool calls."""

    content: str
    tool_calls: list[ToolCall]
    invalid_tool_calls: list[InvalidToolCall]


def _one(raw: str, known: Collection[str] | None) -> ToolCall | InvalidToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return InvalidToolCall(raw, f"not valid JSON: {exc.msg} at char {exc.pos}")
    if not isinstance(obj, dict):
        return InvalidToolCall(raw, "a tool call must be a JSON object")
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    args_text = args if isinstance(args, str) else json.dumps(args)
    if not isinstance(name, str) or not name:
        return InvalidToolCall(raw, "missing tool name", None, args_text)
    if isinstance(args, str):  # OpenAI style: arguments serialised as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return InvalidToolCall(raw, "arguments are not valid JSON", name, args_text)
    if not isinstance(args, dict):
        return InvalidToolCall(raw, "arguments must be a JSON object", name, args_text)
    if known is not None and name not in known:
        return InvalidToolCall(raw, f"unknown tool {name!r}", name, args_text)
    return ToolCall(name, args)


def parse_tool_calls(text: str, known_tools: Collection[str] | None = None) -> ParsedOutput:
    """Split ``text`` into content and tool calls.

    Args:
        text: The model's output.
        known_tools: Names of the bound tools; calls to other names are invalid. ``None``
            accepts any name.

    Returns:
        Content (text outside the call blocks, stripped) and valid / invalid calls in order.
    """
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for m in _CALL_RE.finditer(text):
        parsed = _one(m.group(1), known_tools)
        (calls if isinstance(parsed, ToolCall) else invalid).append(parsed)  # type: ignore[arg-type]
    content = _CALL_RE.sub("", text).strip() if (calls or invalid) else text
    return ParsedOutput(content, calls, invalid)


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    """Names of OpenAI-style tool schemas."""
    out = []
    for t in tools or []:
        fn = t.get("function", t)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.append(fn["name"])
    return out
