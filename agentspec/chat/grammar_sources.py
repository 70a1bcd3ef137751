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

Bounds (:class:`GrammarLimits`, issue 35 item 9): a grammar comes from the client (its
``response_format`` schema, its tools), and llguidance compiles it on the one thread that
serves every request, so its size and the work it costs are bounded before any of it
starts: the grammar text's bytes, the properties of any one schema object and the
``patternProperties`` of the whole grammar (the two schema features whose compile time
grows faster than their size, measured in ``docs/reliability.md``), then llguidance's
own fuel and size counters while it builds (:meth:`GrammarLimits.llguidance`). A grammar
past a bound raises :class:`GrammarLimitError` naming the bound and the value.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from agentspec.chat.formats import ToolFormat
from agentspec.chat.formats.base import chosen_tool
from agentspec.chat.formats.fallback import FallbackFormat
from agentspec.chat.formats.hermes import call_schema
from agentspec.errors import ConfigError, GrammarError

__all__ = ["DEFAULT_GRAMMAR_LIMITS", "GrammarLimitError", "GrammarLimits", "check_grammar",
           "check_schema", "chosen_tool", "json_grammar", "response_format_grammar",
           "tool_call_grammar", "tool_call_schema"]


class GrammarLimitError(GrammarError):
    """A grammar (a ``response_format`` schema, a tool set) is past a :class:`GrammarLimits`
    bound; the message names the bound, the value and the limit."""


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's grammar may cost to build, checked before and while compiling.

    The first three are checked here, in Python, before llguidance sees the grammar; the
    others are llguidance's own counters (``LLParserLimits``), which stop its compiler and
    lexer cooperatively once spent. Defaults: ``docs/reliability.md`` has the table and
    the compile times measured at the bounds.

    Attributes:
        max_bytes: UTF-8 bytes of the grammar text, JSON schemas included (128 KiB: about
            60 typical tool schemas; compile time grows faster than linearly in size).
        max_object_properties: ``properties`` of any one schema object (optional
            properties cost quadratic compile time: 1,000 take ~0.06 s, 4,000 ~1.5 s).
        max_pattern_properties: ``patternProperties`` keys in the whole grammar (each
            pattern is checked against the others: 64 take ~0.01 s, 300 ~5 s).
        max_grammar_size: llguidance's symbols in grammar productions (its default).
        initial_lexer_fuel: llguidance's fuel for building the lexer's regexes (~50k a
            millisecond; its default, ~20 ms).
        step_lexer_fuel: llguidance's fuel for one token mask (~14k a millisecond; its
            default, ~14 ms a step).
        max_lexer_states: llguidance's lexer states (1-2 kB each; its default).
    """

    max_bytes: int = 128 * 1024
    max_object_properties: int = 1_000
    max_pattern_properties: int = 64
    max_grammar_size: int = 500_000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    max_lexer_states: int = 250_000

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GrammarLimits.{f.name} must be a positive integer, "
                                  f"got {value!r}")

    def llguidance(self) -> Any:
        """llguidance's ``LLParserLimits`` for these bounds (errors without the grammar's
        text: a 128 KiB schema echoed into a 400 body helps nobody)."""
        import llguidance

        return llguidance.LLParserLimits(
            max_grammar_size=self.max_grammar_size,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            max_lexer_states=self.max_lexer_states,
            verbose_errors=False,
        )


#: The bounds every compiler and the server's request checks use unless told otherwise.
DEFAULT_GRAMMAR_LIMITS = GrammarLimits()


def check_schema(schema: Any, limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS,
                 where: str = "schema", pattern_count: int = 0) -> int:
    """Check one JSON schema's structure against ``limits`` (iteratively: any depth).

    Args:
        schema: The decoded JSON schema.
        limits: The bounds.
        where: Name of the schema in messages.
        pattern_count: ``patternProperties`` keys already counted in the same grammar.

    Returns:
        ``pattern_count`` plus this schema's ``patternProperties`` keys.

    Raises:
        GrammarLimitError: an object with more than ``max_object_properties`` properties,
            or more than ``max_pattern_properties`` pattern properties in all.
    """
    stack: list[tuple[Any, str]] = [(schema, where)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict) and len(props) > limits.max_object_properties:
                raise GrammarLimitError(
                    f"{path}: an object schema with {len(props)} properties is past the limit "
                    f"of {limits.max_object_properties} (GrammarLimits.max_object_properties)")
            patterns = node.get("patternProperties")
            if isinstance(patterns, dict):
                pattern_count += len(patterns)
                if pattern_count > limits.max_pattern_properties:
                    raise GrammarLimitError(
                        f"{path}: {pattern_count} patternProperties are past the limit of "
                        f"{limits.max_pattern_properties} per grammar "
                        "(GrammarLimits.max_pattern_properties)")
            stack.extend((v, f"{path}.{k}") for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return pattern_count


def check_grammar(grammar: str, limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS) -> None:
    """Check grammar text against ``limits`` before it is compiled (cheap: one pass).

    Every ``%json`` schema in the grammar is decoded and checked with :func:`check_schema`.

    Raises:
        GrammarLimitError: the grammar is past a bound.
    """
    size = len(grammar.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise GrammarLimitError(
            f"the grammar is {size} bytes (JSON schemas of response_format / tools included), "
            f"past the limit of {limits.max_bytes} (GrammarLimits.max_bytes)")
    decoder = json.JSONDecoder()
    patterns, pos, n = 0, 0, 0
    while (at := grammar.find("%json", pos)) >= 0:
        start = grammar.find("{", at)
        pos = at + len("%json")
        if start < 0:
            break
        try:
            schema, end = decoder.raw_decode(grammar, start)
        except (ValueError, RecursionError):
            continue  # not a schema of ours: llguidance reports what is wrong with it
        where = "schema" if n == 0 else f"schema {n + 1}"  # in the grammar's order
        patterns = check_schema(schema, limits, where, patterns)
        pos, n = end, n + 1

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
    # Serialised chunk by chunk and cut off past the byte bound: a schema built in Python
    # can share sub-schemas (a DAG), whose text grows exponentially with its depth, so
    # json.dumps alone could run out of time or memory before check_grammar sees it.
    limit = DEFAULT_GRAMMAR_LIMITS.max_bytes
    out: list[str] = []
    size = 0
    try:
        for chunk in json.JSONEncoder(ensure_ascii=False).iterencode(
                {**schema, "x-guidance": style}):
            size += len(chunk)  # characters <= UTF-8 bytes: past this, past the bound
            if size > limit:
                raise GrammarLimitError(
                    f"the JSON schema is over {limit} bytes when serialised, past the limit "
                    "(GrammarLimits.max_bytes)")
            out.append(chunk)
    except GrammarError:
        raise
    except RecursionError:
        raise GrammarError("the JSON schema nests too deeply to serialise") from None
    except (TypeError, ValueError) as exc:  # unserialisable values, circular references
        raise GrammarError(f"JSON schema is not serialisable: {exc}") from exc
    return "%json " + "".join(out)


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
