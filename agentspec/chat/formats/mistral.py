"""Mistral tool calls: the v3 tokenizer's JSON list and the v11 tokenizer's name + ``[ARGS]``.

Both declare the tools in ``[AVAILABLE_TOOLS]`` and open calls with ``[TOOL_CALLS]`` (a
control token of their vocabularies, dropped by a plain ``decode``):

* v3 (Mistral 7B v0.3, Nemo): ``[TOOL_CALLS] [{"name": "get_weather", "arguments": {...}}]``,
  results in ``[TOOL_RESULTS] {"content": ..., "call_id": ...}[/TOOL_RESULTS]``;
* v11 (Mistral Small 3.1+, Devstral): ``[TOOL_CALLS]get_weather[ARGS]{...}``, one per call.

Mistral templates refuse call ids that are not 9 alphanumerics, which OpenAI clients send
(``call_...``): ids are mapped to 9 characters derived from a hash of the original, so the
same id maps the same way in the call and in its result.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection, Sequence
from typing import Any, ClassVar

from agentspec.chat.formats.base import (
    InvalidToolCall,
    ParsedOutput,
    ToolCall,
    ToolFormat,
    call_from_parts,
    check_choice,
    forced_call_prefix,
    forces_call,
    function_of,
    hold_for_tag,
    json_rule,
    parameters_schema,
)
from agentspec.chat.formats.hermes import call_schema

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALNUM9 = re.compile(r"^[A-Za-z0-9]{9}$")


class MistralFormat(ToolFormat):
    """v3: ``[TOOL_CALLS] [{...}, ...]``; see the module docstring."""

    name = "mistral"
    tags: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)

    def call_id(self, cid: str) -> str:
        if not cid or _ALNUM9.match(cid):
            return cid
        return hashlib.sha256(cid.encode()).hexdigest()[:9]

    def forced_prefix(self, tool_choice: Any, tools: Sequence[dict[str, Any]] | None) -> str:
        return forced_call_prefix(tools, tool_choice, TOOL_CALLS + " [")

    def parse(self, text: str, known_tools: Collection[str] | None = None) -> ParsedOutput:
        at = text.find(TOOL_CALLS)
        if at < 0:
            return ParsedOutput(text, [], [])
        content, body = text[:at].strip(), text[at + len(TOOL_CALLS):].strip()
        try:
            items = json.loads(body)
        except json.JSONDecodeError as exc:
            return ParsedOutput(content, [], [InvalidToolCall(
                body, f"not valid JSON: {exc.msg} at char {exc.pos}")])
        calls: list[ToolCall] = []
        invalid: list[InvalidToolCall] = []
        for item in items if isinstance(items, list) else [items]:
            raw = json.dumps(item, ensure_ascii=False)
            if not isinstance(item, dict):
                invalid.append(InvalidToolCall(raw, "a tool call must be a JSON object"))
                continue
            parsed = call_from_parts(raw, item.get("name"), item.get("arguments", {}), known_tools)
            (calls if isinstance(parsed, ToolCall) else invalid).append(parsed)  # type: ignore[arg-type]
        return ParsedOutput(content, calls, invalid)

    def grammar(self, tools: Sequence[dict[str, Any]] | None, tool_choice: Any) -> str | None:
        if not tools or tool_choice == "none":
            check_choice(tools, tool_choice)
            return None
        name = check_choice(tools, tool_choice)
        one = call_schema(tools, name)
        calls = {"type": "array", "items": one, "minItems": 1}
        if name is not None:
            calls["maxItems"] = 1
        rule = "calls: " + json_rule(calls)
        opening = f'{self.tag(TOOL_CALLS)} " " calls'
        if tool_choice not in (None, "auto"):
            return f"start: {opening}\n{rule}"
        return "\n".join([f"start: PROSE | PROSE {opening}", self._prose(), rule])

    def _prose(self) -> str:
        if TOOL_CALLS in self.tag_ids:
            return "PROSE: /(?s:.*)/"
        tag = re.escape(TOOL_CALLS)
        return f"PROSE: /(?s:.*)/ & ~/(?s:.*{tag}.*)/"

    def hold_from(self, text: str) -> int:
        return hold_for_tag(text, TOOL_CALLS)

    def raw_call_text(self, raw: str) -> str:
        return f"{TOOL_CALLS} {raw}"

    def call_example(self, name: str = "<tool>", arguments: str = "{...}") -> str:
        return (f'{TOOL_CALLS} [{{"name": {json.dumps(name, ensure_ascii=False)}, '
                f'"arguments": {arguments}}}]')


class MistralV11Format(MistralFormat):
    """v11: ``[TOOL_CALLS]name[ARGS]{...}`` per call; see the module docstring."""

    name = "mistral_v11"
    tags = (TOOL_CALLS, ARGS)
    _CALL = re.compile(r"\[TOOL_CALLS\]\s*([^\[\s]+)\s*\[ARGS\](.*?)(?=\[TOOL_CALLS\]|$)", re.S)

    def forced_prefix(self, tool_choice: Any, tools: Sequence[dict[str, Any]] | None) -> str:
        name = check_choice(tools, tool_choice)
        if not forces_call(tool_choice):
            return ""
        return TOOL_CALLS if name is None else TOOL_CALLS + name + ARGS

    def parse(self, text: str, known_tools: Collection[str] | None = None) -> ParsedOutput:
        at = text.find(TOOL_CALLS)
        if at < 0:
            return ParsedOutput(text, [], [])
        calls: list[ToolCall] = []
        invalid: list[InvalidToolCall] = []
        for m in self._CALL.finditer(text, at):
            raw = m.group(0).strip()
            parsed = call_from_parts(raw, m.group(1), m.group(2).strip(), known_tools)
            (calls if isinstance(parsed, ToolCall) else invalid).append(parsed)  # type: ignore[arg-type]
        if not calls and not invalid:
            invalid.append(InvalidToolCall(text[at:], "no name[ARGS]{...} after [TOOL_CALLS]"))
        return ParsedOutput(text[:at].strip(), calls, invalid)

    def grammar(self, tools: Sequence[dict[str, Any]] | None, tool_choice: Any) -> str | None:
        if not tools or tool_choice == "none":
            check_choice(tools, tool_choice)
            return None
        only = check_choice(tools, tool_choice)
        rules, alts = [], []
        for i, tool in enumerate(tools):
            name = function_of(tool).get("name")
            if not isinstance(name, str) or (only is not None and name != only):
                continue
            alts.append(f"call{i}")
            rules.append(f"call{i}: {self.tag(TOOL_CALLS)} {json.dumps(name)} {self.tag(ARGS)} "
                         f"args{i}")
            rules.append(f"args{i}: " + json_rule(parameters_schema(tool)))
        body = "call" if only is not None else "call+"
        rules.append("call: " + " | ".join(alts))
        if tool_choice not in (None, "auto"):
            return "\n".join([f"start: {body}", *rules])
        return "\n".join(["start: PROSE | PROSE call+", self._prose(), *rules])

    def call_example(self, name: str = "<tool>", arguments: str = "{...}") -> str:
        return f"{TOOL_CALLS}{name}{ARGS}{arguments}"


__all__ = ["ARGS", "TOOL_CALLS", "MistralFormat", "MistralV11Format"]
