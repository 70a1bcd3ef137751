"""Chat messages -> prompt token ids, with the model's own chat template.

Tool schemas are rendered into the system turn in the Hermes / SmolLM2 style (a JSON list
inside ``<tools>``; calls come back as ``<tool_call>{...}</tool_call>``), which the
embedded model's chat template does not do by itself. Rendering is deterministic, so the
same tools produce the same tokens every turn: exactly what a session cache drafts from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentspec.errors import ConfigError

_ROLES = {"system", "user", "assistant", "tool"}

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


def normalise_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
) -> list[dict[str, str]]:
    """Validate messages and fold tools / tool results into plain role+content turns.

    Raises:
        ConfigError: a message without a known role or with non-text content.
    """
    out: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in _ROLES:
            raise ConfigError(f"message {i} has unsupported role {role!r}; use one of {_ROLES}")
        content = msg.get("content") or ""
        if not isinstance(content, str):
            raise ConfigError(f"message {i} content must be a string, got {type(content).__name__}")
        calls = msg.get("tool_calls") or []
        for call in calls:
            fn = call.get("function", call)
            args = fn.get("arguments", {})
            if not isinstance(args, str):
                args = json.dumps(args, sort_keys=True)
            content += f'<tool_call>{{"name": {json.dumps(fn.get("name"))}, "arguments": {args}}}'
            content += "</tool_call>"
        if role == "tool":
            # The template has no tool role: a tool result is a user turn in a marked block.
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        decl = render_tools(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": decl + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": decl})
    return out


def render_prompt(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of the chat prompt, ending with the assistant turn's opening."""
    if not messages:
        raise ConfigError("messages must not be empty")
    turns = normalise_messages(messages, tools)
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
