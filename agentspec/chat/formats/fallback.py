"""The fallback format, for chat templates that ignore ``tools`` (SmolLM2's ChatML).

The template cannot declare tools, so they are declared in a preamble of the system turn (a
JSON list inside ``<tools>``, calls requested as ``<tool_call>{...}</tool_call>`` with no
newlines around the body). Calls of earlier turns are written back in that form, and a tool
result, which such a template has no role for, becomes a user turn in a
``<tool_response>`` block. Rendering is deterministic, so the same tools give the same
tokens every turn: exactly what a session cache drafts from. An answer stops at the closing
tag (the agent runs the tool); a small model otherwise keeps writing.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from agentspec.chat.formats.base import (
    ParsedOutput,
    ToolFormat,
    apply_template,
    check_choice,
    forced_call_prefix,
    hold_for_tag,
    json_rule,
)
from agentspec.chat.formats.hermes import CLOSE, OPEN, call_schema, parse_tagged_calls
from agentspec.errors import ConfigError

TOOL_PREAMBLE = (
    "You are a helpful assistant with access to the following tools. To call a tool, reply "
    'with <tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call>.\n<tools>\n'
)


def render_tools(tools: Sequence[dict[str, Any]]) -> str:
    """The system-prompt text that declares ``tools`` (OpenAI function schemas)."""
    try:
        body = "\n".join(json.dumps(t, sort_keys=True, ensure_ascii=False) for t in tools)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"tool schemas must be JSON-serialisable: {exc}") from exc
    return TOOL_PREAMBLE + body + "\n</tools>"


class FallbackFormat(ToolFormat):
    """Tools in a system preamble, ``<tool_call>{json}</tool_call>`` answers."""

    name = "fallback"
    tags = (OPEN, CLOSE)
    stop = (CLOSE,)
    template_instructs = False  # the template ignores tools; only agentspec's preamble does

    def plain_turns(self, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None = None) -> list[dict[str, str]]:
        """Messages folded into plain role + content turns (tools in the system turn, calls
        as text, tool results as user turns)."""
        out: list[dict[str, str]] = []
        for msg, turn in zip(messages, self.template_messages(messages), strict=True):
            content = turn["content"]
            for call in msg.get("tool_calls") or []:
                fn = call.get("function", call)
                # Arguments already in text stay as written (the model's own key order).
                args = fn.get("arguments", {})
                if not isinstance(args, str):
                    args = json.dumps(args, sort_keys=True)
                content += f'{OPEN}{{"name": {json.dumps(fn.get("name"))}, "arguments": {args}}}'
                content += CLOSE
            if turn["role"] == "tool":
                out.append({"role": "user",
                            "content": f"<tool_response>\n{content}\n</tool_response>"})
            else:
                out.append({"role": turn["role"], "content": content})
        if tools:
            decl = render_tools(tools)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": decl + "\n\n" + out[0]["content"]}
            else:
                out.insert(0, {"role": "system", "content": decl})
        return out

    def render(self, tokenizer: Any, messages: Sequence[dict[str, Any]],
               tools: Sequence[dict[str, Any]] | None) -> list[int]:
        return apply_template(tokenizer, list(self.plain_turns(messages, tools)))

    def render_text(self, tokenizer: Any, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None, generation: bool) -> str:
        return str(tokenizer.apply_chat_template(
            list(self.plain_turns(messages, tools)), tokenize=False,
            add_generation_prompt=generation))

    def forced_prefix(self, tool_choice: Any, tools: Sequence[dict[str, Any]] | None) -> str:
        return forced_call_prefix(tools, tool_choice, OPEN)

    def parse(self, text: str, known_tools: Collection[str] | None = None) -> ParsedOutput:
        parsed = parse_tagged_calls(text, known_tools)
        return parsed if parsed is not None else ParsedOutput(text, [], [])

    def grammar(self, tools: Sequence[dict[str, Any]] | None, tool_choice: Any) -> str | None:
        if not tools or tool_choice == "none":
            check_choice(tools, tool_choice)
            return None
        name = check_choice(tools, tool_choice)
        call = "call: " + json_rule(call_schema(tools, name))
        if tool_choice in (None, "auto"):
            # Prose ending at the first opening tag, then a call; or prose that never opens
            # one. Plain lexemes (not llguidance's stop= rules, which cannot roll back).
            return "\n".join([
                f'start: OPEN call "{CLOSE}" | PROSE',
                f"OPEN: /(?s:.*){OPEN}/ & ~/(?s:.*{OPEN}.+)/",
                f"PROSE: /(?s:.*)/ & ~/(?s:.*{OPEN}.*)/",
                call,
            ])
        return f'start: {self.tag(OPEN)} call {self.tag(CLOSE)}\n{call}'

    def hold_from(self, text: str) -> int:
        return hold_for_tag(text, OPEN)

    def raw_call_text(self, raw: str) -> str:
        return f"{OPEN}{raw}{CLOSE}"


__all__ = ["TOOL_PREAMBLE", "FallbackFormat", "render_tools"]
