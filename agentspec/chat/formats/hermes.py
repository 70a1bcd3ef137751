"""Hermes-style tool calls (Qwen2.5, Hermes 2/3 and their templates).

The template declares the tools inside ``<tools></tools>`` and shows a call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call (parallel calls are consecutive blocks); tool results come back as role
``tool`` and the template wraps them in ``<tool_response>``. In Qwen2.5's vocabulary
``<tool_call>`` and ``</tool_call>`` are single added tokens (151657, 151658).

Small Qwen2.5-Coder models often answer with the call body alone, without the tags
(``{"name": "get_weather", "arguments": {...}}``, sometimes in a ```` ```json ```` fence),
as llama.cpp notes for Qwen 2.5 Coder. The parser takes such an answer as a call when it is
exactly one JSON object (or a list of them) naming a bound tool; the ``auto`` grammar
triggers on either opening: the ``<tool_call>`` tag, or an answer that starts with ``{``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from typing import Any

from agentspec.chat.formats.base import (
    InvalidToolCall,
    ParsedOutput,
    ToolCall,
    ToolFormat,
    check_choice,
    forced_call_prefix,
    function_of,
    hold_for_tag,
    json_rule,
    parameters_schema,
    parse_call_object,
    tool_names,
    unfence,
)
from agentspec.errors import GrammarError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
#: Prose that does not open a call: no leading "{" (a bare call), and no tag (a tag that is
#: a token cannot be matched by text anyway; one spelled as text is excluded).
_NO_CALL = r"PROSE: /(?s:.*)/ & ~/\s*\{(?s:.*)/ & ~/(?s:.*<tool_call>.*)/"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse_tagged_calls(text: str, known_tools: Collection[str] | None) -> ParsedOutput | None:
    """The ``<tool_call>`` blocks of ``text`` (an unclosed last one included) as calls, the
    content without them; ``None`` when ``text`` holds no block."""
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for m in _BLOCK.finditer(text):
        parsed = parse_call_object(m.group(1), known_tools)
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            invalid.append(parsed)
    if calls or invalid:
        return ParsedOutput(_BLOCK.sub("", text).strip(), calls, invalid)
    return None


def call_schema(tools: Sequence[dict[str, Any]], only: str | None = None,
                args_key: str = "arguments") -> dict[str, Any]:
    """JSON schema of a call body ``{"name": ..., "<args_key>": {...}}`` to one of ``tools``
    (or to the tool named ``only``), each name paired with its own parameter schema."""
    options = []
    for tool in tools:
        name = function_of(tool).get("name")
        if not isinstance(name, str) or (only is not None and name != only):
            continue
        options.append({
            "type": "object",
            "properties": {"name": {"const": name}, args_key: parameters_schema(tool)},
            "required": ["name", args_key],
            "additionalProperties": False,
        })
    if not options:
        raise GrammarError(f"no bound tool named {only!r}" if only else "no tools to call")
    return options[0] if len(options) == 1 else {"anyOf": options}


def parse_bare(text: str, known: Collection[str] | None, args_keys: Sequence[str]
               ) -> list[ToolCall] | None:
    """Calls written as bare JSON (the whole answer: one object, a list of objects, or one
    object per line, optionally fenced) naming bound tools; ``None`` if it is not that."""
    body = unfence(text)
    if not body.startswith(("{", "[")):
        return None
    try:
        value = json.loads(body)
        items = value if isinstance(value, list) else [value]
    except json.JSONDecodeError:
        try:
            items = [json.loads(line) for line in body.splitlines() if line.strip()]
        except json.JSONDecodeError:
            return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not any(k in item for k in args_keys):
            return None
        call = parse_call_object(json.dumps(item, ensure_ascii=False), known, args_keys)
        if not isinstance(call, ToolCall):
            return None
        calls.append(call)
    return calls or None


class HermesFormat(ToolFormat):
    """``<tool_call>\\n{json}\\n</tool_call>`` blocks; see the module docstring."""

    name = "hermes"
    tags = (OPEN, CLOSE)
    #: Between the tag and the body, and the body and the closing tag, as the template writes.
    sep = "\n"

    def forced_prefix(self, tool_choice: Any, tools: Sequence[dict[str, Any]] | None) -> str:
        return forced_call_prefix(tools, tool_choice, OPEN + self.sep)

    def parse(self, text: str, known_tools: Collection[str] | None = None) -> ParsedOutput:
        parsed = parse_tagged_calls(text, known_tools)
        if parsed is not None:
            return parsed
        if known_tools is not None:
            bare = parse_bare(text, known_tools, ("arguments", "parameters"))
            if bare:
                return ParsedOutput("", bare, [])
        return ParsedOutput(text, [], [])

    def _block(self) -> list[str]:
        return [f'block: {self.tag(OPEN)} "{self._esc_sep}" call "{self._esc_sep}" '
                f"{self.tag(CLOSE)}"]

    @property
    def _esc_sep(self) -> str:
        return json.dumps(self.sep)[1:-1]

    def grammar(self, tools: Sequence[dict[str, Any]] | None, tool_choice: Any) -> str | None:
        if not tools:
            check_choice(tools, tool_choice)
            return None
        if tool_choice == "none":
            # No call: neither opening. Small Qwen2.5-Coder models otherwise answer a tool
            # result with the same call again, even with no tools in the prompt.
            return "start: PROSE\n" + _NO_CALL
        name = check_choice(tools, tool_choice)
        call = "call: " + json_rule(call_schema(tools, name))
        if tool_choice not in (None, "auto"):
            # One call: a small model given room for more invents further calls.
            return "\n".join(["start: block", *self._block(), call])
        # auto: prose, or prose then call blocks, or (Qwen2.5-Coder's habit) the call body
        # alone. Prose may not start with "{": an answer that opens with one is a call.
        lines = [f"start: PROSE | PROSE {self.tag(OPEN)} rest | call",
                 f'rest: "{self._esc_sep}" call "{self._esc_sep}" {self.tag(CLOSE)} '
                 '("\\n" block)*',
                 *self._block(), call]
        if OPEN in self.tag_ids:
            # The tag is a token no text lexeme can match: prose ends where it comes.
            lines.append(_NO_CALL)
        else:
            lines[0] = "start: PROSE | OPEN rest | call"
            lines.append(f"OPEN: /(?s:.*){re.escape(OPEN)}/ & ~/(?s:.*{re.escape(OPEN)}.+)/ & "
                         r"~/\s*\{(?s:.*)/")
            lines.append(f"PROSE: /(?s:.*)/ & ~/(?s:.*{re.escape(OPEN)}.*)/ & "
                         r"~/\s*\{(?s:.*)/")
        return "\n".join(lines)

    def hold_from(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped[0] in "{[`":
            return 0  # may be a bare call: held until the answer is parsed
        return hold_for_tag(text, OPEN)

    def raw_call_text(self, raw: str) -> str:
        return f"{OPEN}{self.sep}{raw}{self.sep}{CLOSE}"


__all__ = ["CLOSE", "OPEN", "HermesFormat", "call_schema", "parse_bare", "parse_tagged_calls",
           "tool_names"]
