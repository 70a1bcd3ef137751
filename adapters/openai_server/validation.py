"""Request checks beyond the schema: JSON depth, text encodability and conversation shape.

These run on every chat request after JSON parsing and schema validation, so inputs that
would otherwise fail deep inside the runtime (a tokenizer ``TypeError`` on a lone surrogate,
a ``RecursionError`` on deeply nested JSON, a tool result answering no call) are answered
with a 400 and OpenAI's error body instead of a 500, or instead of a 200 for a conversation
the client did not mean.
"""

from __future__ import annotations

import json
from typing import Any

from adapters.openai_server.errors import bad_request
from agentspec.chat.checks import check_tool_replies, check_tool_schemas
from agentspec.errors import ConfigError

MAX_JSON_DEPTH = 64  # tool schemas nest a few levels; 64 leaves room and keeps recursion safe


def parse_json(raw: bytes) -> Any:
    """Parse a request body, mapping every failure to a 400.

    Raises:
        APIError: 400 for invalid JSON, JSON nested deeper than :data:`MAX_JSON_DEPTH`
            (the C parser raises ``RecursionError`` long before memory runs out) or a
            string that is not valid Unicode text (a lone surrogate such as ``\\ud800``).
    """
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    _check_tree(data)
    return data


def _check_tree(data: Any) -> None:
    """Iteratively check nesting depth and that every string encodes as UTF-8."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, str):
            _check_text(node, path)
        elif isinstance(node, dict):
            for key, value in node.items():
                _check_text(key, path)
                stack.append((value, depth + 1, f"{path}.{key}" if path else str(key)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(node))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        param = path.split(".")[0].split("[")[0] or None
        raise bad_request(
            f"{path or 'body'}: text contains {bad!r} (a lone UTF-16 surrogate), which is not "
            "valid Unicode text", param) from None


def check_conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       ) -> None:
    """Tool results answer earlier calls; tool names are unique; parameters are schemas.

    Args:
        messages: The request's messages as sent (``tool_call_id`` included).
        tools: The request's tools as sent, or ``None``.

    Raises:
        APIError: 400 naming the message or tool at fault.
    """
    try:
        if tools:
            check_tool_schemas(tools)
        check_tool_replies(messages)
    except ConfigError as exc:
        raise bad_request(str(exc), "tools" if str(exc).startswith("tools") else "messages",
                          ) from None


__all__ = ["MAX_JSON_DEPTH", "check_conversation", "parse_json"]
