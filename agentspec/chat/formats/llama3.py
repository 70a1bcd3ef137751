"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (``--tool-call-parser llama3_json`` in vLLM).

The template declares the tools (by default in the first user turn) and asks for a reply
that is one JSON object, ``{"name": <function name>, "parameters": {...}}``, with no tag;
a tool result is rendered under the ``ipython`` role. The template stamps "Today Date" from
the clock unless ``date_string`` is given: it is pinned, so a conversation renders to the
same tokens every day (a session cache would otherwise miss on every new date).
Some Llama 3.x answers prefix the call with ``<|python_tag|>``; it is accepted and dropped.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from agentspec.chat.formats.base import (
    ParsedOutput,
    ToolCall,
    ToolFormat,
    check_choice,
    forced_call_prefix,
    json_rule,
    parse_call_object,
)
from agentspec.chat.formats.hermes import call_schema, parse_bare

PYTHON_TAG = "<|python_tag|>"
#: The date every Llama 3.x prompt is rendered with (the templates' own default).
PINNED_DATE = "26 Jul 2024"


class Llama3JsonFormat(ToolFormat):
    """A whole answer ``{"name": ..., "parameters": {...}}``; see the module docstring."""

    name = "llama3_json"
    tags = (PYTHON_TAG,)

    def template_kwargs(self) -> dict[str, Any]:
        return {"date_string": PINNED_DATE}

    def forced_prefix(self, tool_choice: Any, tools: Sequence[dict[str, Any]] | None) -> str:
        return forced_call_prefix(tools, tool_choice, "", args_key="parameters")

    def parse(self, text: str, known_tools: Collection[str] | None = None) -> ParsedOutput:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].strip()
        if not body.startswith("{"):
            return ParsedOutput(text, [], [])
        # Several calls may come separated by ";" (vLLM's llama3_json parser accepts that).
        parts = [p for p in body.split(";") if p.strip()] if ";" in body else [body]
        bare = parse_bare("\n".join(parts), known_tools, ("parameters", "arguments"))
        if bare:
            return ParsedOutput("", bare, [])
        parsed = parse_call_object(body, known_tools, ("parameters", "arguments"))
        if isinstance(parsed, ToolCall):
            return ParsedOutput("", [parsed], [])
        return ParsedOutput("", [], [parsed])

    def grammar(self, tools: Sequence[dict[str, Any]] | None, tool_choice: Any) -> str | None:
        if not tools:
            check_choice(tools, tool_choice)
            return None
        if tool_choice == "none":  # no call: the answer may not open with "{"
            return "start: PROSE\n" + r"PROSE: /(?s:.*)/ & ~/\s*\{(?s:.*)/"
        name = check_choice(tools, tool_choice)
        call = "call: " + json_rule(call_schema(tools, name, args_key="parameters"))
        if tool_choice not in (None, "auto"):
            return f"start: call\n{call}"
        # The answer is a call if it opens with "{" (the trigger), else prose.
        return "\n".join(["start: PROSE | call", r"PROSE: /(?s:.*)/ & ~/\s*\{(?s:.*)/", call])

    def call_example(self, name: str = "<tool>", arguments: str = "{...}") -> str:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": {arguments}}}'

    def hold_from(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped[0] == "{" or PYTHON_TAG.startswith(stripped[:14]):
            return 0
        return len(text)


__all__ = ["PINNED_DATE", "Llama3JsonFormat"]
