"""Where grammars come from: JSON schemas, OpenAI ``response_format`` and tool schemas,
turned into llguidance Lark text for :class:`agentspec.chat.grammar.GrammarCompiler`.

Tool-call JSON is laid out the way the prompt shows it (``", "`` between items, ``": "``
after keys, no other whitespace): a small model then meets the separators it expects,
cannot stall in a run of spaces, and a session's suffix cache sees the same bytes every
turn. ``response_format`` JSON allows the model's own layout instead (:data:`FLEXIBLE_JSON`):
instruction-tuned models pretty-print JSON (newlines, two-space indents), and a grammar that
forces the compact layout pushes them off the token sequences they were trained on (a
measured cause of unclosed arrays, see ``docs/structured-outputs.md``). Whitespace between
JSON tokens is then one optional line break and at most 32 spaces or tabs: every common
pretty-printed layout and the compact one pass, and no run of whitespace can fill the
length limit.

Tool-call grammars are written by the model's tool format (:mod:`agentspec.chat.formats`), in
the model's own syntax: a forced call (``tool_choice`` ``"required"``/``"any"`` or a named
tool) is a call to a bound tool whose arguments follow its parameter schema; under
``"auto"`` the model may write prose, and once it opens a call the body is held to the same
rule.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentspec.chat.formats import ToolFormat
from agentspec.chat.formats.base import chosen_tool
from agentspec.chat.formats.fallback import FallbackFormat
from agentspec.chat.formats.hermes import call_schema
from agentspec.errors import GrammarError

__all__ = ["chosen_tool", "json_grammar", "response_format_grammar", "tool_call_grammar",
           "tool_call_schema"]

#: llguidance JSON options: fixed separators, as in the prompt's tool-call example.
JSON_STYLE: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
#: llguidance JSON options for ``response_format``: llguidance's flexible whitespace
#: (``whitespace_flexible``, i.e. ``[ \n\r\t]+`` between tokens) bounded to one line break
#: plus indentation, so compact, ``", "``-separated and indented layouts are all valid.
FLEXIBLE_JSON: dict[str, Any] = {
    "whitespace_pattern": r"(?:\x0D?\x0A)?[\x20\x09]{0,32}",
}


def _json_rule(schema: dict[str, Any], lenient: bool = False, flexible: bool = False) -> str:
    """A Lark ``%json`` rule body for ``schema``: the project's compact layout, or with
    ``flexible`` the model's own whitespace (:data:`FLEXIBLE_JSON`)."""
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    style = FLEXIBLE_JSON if flexible else JSON_STYLE
    if lenient:
        style = dict(style, lenient=True)
    try:
        return "%json " + json.dumps({**schema, "x-guidance": style}, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"JSON schema is not serialisable: {exc}") from exc


def json_grammar(schema: dict[str, Any] | None = None, flexible: bool = False) -> str:
    """Grammar of one JSON value following ``schema`` (``None``: any JSON object);
    ``flexible`` allows the model's own whitespace between tokens (:data:`FLEXIBLE_JSON`),
    otherwise the compact ``", "`` / ``": "`` layout is the only one."""
    rule = _json_rule(schema if schema is not None else {"type": "object"}, flexible=flexible)
    return "start: " + rule


def response_format_grammar(response_format: Any) -> str | None:
    """Grammar for an OpenAI ``response_format`` (``None`` for plain text).

    ``{"type": "json_object"}`` allows any JSON object; ``{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` the schema's documents
    (enforced whether or not ``strict`` is set: constrained decoding costs nothing extra).
    Both allow the model's own whitespace (pretty-printed or compact JSON).

    Raises:
        GrammarError: an unknown type or a ``json_schema`` without a schema object.
    """
    if response_format is None:
        return None
    if hasattr(response_format, "model_dump"):
        response_format = response_format.model_dump(by_alias=True, exclude_none=True)
    if not isinstance(response_format, dict):
        raise GrammarError(f"response_format must be an object, got {response_format!r}")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return json_grammar(None, flexible=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise GrammarError(
                "response_format.json_schema.schema must be a JSON schema object, got "
                f"{schema!r}"
            )
        return json_grammar(schema, flexible=True)
    raise GrammarError(
        f"response_format.type {kind!r} is not supported; use 'text', 'json_object' or "
        "'json_schema'"
    )


def tool_call_schema(tools: Sequence[dict[str, Any]], only: str | None = None) -> dict[str, Any]:
    """JSON schema of a call body ``{"name": ..., "arguments": {...}}`` to one of ``tools``
    (or to the tool named ``only``), each name paired with its own parameter schema."""
    return call_schema(tools, only)


def tool_call_grammar(
    tools: Sequence[dict[str, Any]] | None, tool_choice: Any, fmt: ToolFormat | None = None
) -> str | None:
    """Grammar of an answer under ``tool_choice`` in the model's tool format (``None``:
    unconstrained; default format: the fallback's ``<tool_call>{...}</tool_call>``).

    ``"required"``/``"any"`` and named tools force valid calls; ``"auto"`` (and ``None``)
    allow prose, and hold a call to its schema once the answer opens one; ``"none"``
    constrains nothing. See :meth:`agentspec.chat.formats.ToolFormat.grammar`.

    Raises:
        GrammarError: a forced choice without tools, a name that is not bound, or a tool
            whose parameter schema llguidance cannot compile.
    """
    return (fmt or FallbackFormat()).grammar(tools, tool_choice)
