"""Chat messages -> prompt token ids, with the model's own chat template and tool format.

The tool format (:mod:`agentspec.chat.formats`) decides how tools, calls and tool results enter
the prompt: a template that renders ``tools=`` itself (Qwen2.5, Llama 3.x, Mistral) gets
them as it expects; one that ignores tools (SmolLM2's) gets the fallback preamble. Rendering
is deterministic, so the same conversation produces the same tokens every turn: exactly
what a session cache drafts from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentspec.chat.formats import ToolFormat, format_for
from agentspec.chat.formats.fallback import TOOL_PREAMBLE, FallbackFormat, render_tools
from agentspec.errors import ConfigError

__all__ = ["TOOL_PREAMBLE", "normalise_messages", "render_prompt", "render_tools"]


def normalise_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
) -> list[dict[str, str]]:
    """Messages folded into plain role + content turns the way the fallback format renders
    them (tools in the system turn, calls as text, tool results as user turns).

    Raises:
        ConfigError: a message without a known role or with non-text content.
    """
    return FallbackFormat().plain_turns(messages, tools)


def render_prompt(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    fmt: ToolFormat | None = None,
) -> list[int]:
    """Token ids of the chat prompt, ending with the assistant turn's opening.

    Args:
        tokenizer: The model's tokenizer (its chat template renders the prompt).
        messages: OpenAI-style messages (``tool_calls``, role ``tool`` with ``tool_call_id``).
        tools: OpenAI function schemas.
        fmt: The tool format (default: the one chosen for ``tokenizer``).

    Raises:
        ConfigError: empty or malformed messages, or a template that rejects them.
    """
    if not messages:
        raise ConfigError("messages must not be empty")
    return (fmt or format_for(tokenizer)).render(tokenizer, messages, tools)
