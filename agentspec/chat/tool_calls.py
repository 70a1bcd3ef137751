"""Parsing tool calls out of model text, in the model's tool format.

The parsers live with their formats (:mod:`agentspec.chat.formats`); this module keeps the
shared result types and the historical entry point. Parsers are lenient about where calls
sit and strict about what counts as valid: a call whose JSON does not parse, has no string
name, names an unknown tool, or whose arguments are not an object is returned as an
*invalid* call with the reason, never raised.
"""

from __future__ import annotations

from collections.abc import Collection

from agentspec.chat.formats import ToolFormat
from agentspec.chat.formats.base import InvalidToolCall, ParsedOutput, ToolCall, tool_names
from agentspec.chat.formats.fallback import FallbackFormat

__all__ = ["InvalidToolCall", "ParsedOutput", "ToolCall", "parse_tool_calls", "tool_names"]


def parse_tool_calls(
    text: str, known_tools: Collection[str] | None = None, fmt: ToolFormat | None = None
) -> ParsedOutput:
    """Split ``text`` into content and tool calls.

    Args:
        text: The model's output.
        known_tools: Names of the bound tools; calls to other names are invalid. ``None``
            accepts any name.
        fmt: The model's tool format (default: the fallback's ``<tool_call>{...}</tool_call>``).

    Returns:
        Content (text outside the calls, stripped) and valid / invalid calls in order.
    """
    return (fmt or FallbackFormat()).parse(text, known_tools)
