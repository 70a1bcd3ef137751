"""The structured-output requests of :class:`~adapters.vllm.backend.VLLMRuntime`, mapped to
vLLM's own structured outputs (``SamplingParams(structured_outputs=...)``).

The requests are the embedded runtime's (:meth:`agentspec.runtime.Runtime.constraint_for`):
``response_format`` ``json_object`` / ``json_schema`` become vLLM's ``json_object`` /
``json`` options; a tool-call grammar (forced calls, or a call under ``auto``) is passed as
the same llguidance Lark text the embedded engine uses, which vLLM compiles with its
``guidance`` backend (xgrammar cannot read ``%json``; vLLM's ``auto`` backend falls back to
guidance for it). vLLM applies the grammar inside its own speculative decoding. Grammars
and schemas are held to the embedded runtime's bounds
(:class:`~agentspec.chat.grammar_sources.GrammarLimits`) before vLLM compiles them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentspec.chat.formats import ToolFormat, forces_call
from agentspec.chat.grammar_sources import check_grammar, json_grammar, tool_call_grammar
from agentspec.errors import GrammarError
from agentspec.spec import AgentSpec


def structured_output_kwargs(
    tools: Sequence[dict[str, Any]] | None,
    tool_choice: Any,
    response_format: Any,
    spec: AgentSpec,
    tool_format: ToolFormat | None = None,
) -> dict[str, Any] | None:
    """Keyword arguments of vLLM's ``StructuredOutputsParams`` for a request (``None``:
    unconstrained). Same precedence as the embedded runtime: a forced tool call, else the
    ``response_format``, else (``spec.constrained_tool_calls``) a call under ``auto``; tool
    grammars in the model's ``tool_format`` (default: the fallback's).

    Raises:
        GrammarError: a bad ``response_format`` or ``tool_choice``, or
            :class:`~agentspec.chat.grammar_sources.GrammarLimitError`: a grammar or schema
            past the compile bounds.
    """
    forced = forces_call(tool_choice)
    if forced and spec.constrained_tool_calls:
        return {"grammar": _bounded(tool_call_grammar(tools, tool_choice, tool_format))}
    if not forced and response_format is not None:
        fmt = (response_format.model_dump(by_alias=True, exclude_none=True)
               if hasattr(response_format, "model_dump") else response_format)
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise GrammarError("response_format.json_schema.schema must be a JSON schema "
                                   f"object, got {schema!r}")
            # Bounded as the embedded runtime's grammar for the same schema (vLLM compiles
            # the schema itself, with the same superlinear features).
            check_grammar(json_grammar(schema, flexible=True))
            return {"json": schema}
        if kind not in (None, "text"):
            raise GrammarError(f"response_format.type {kind!r} is not supported; use 'text', "
                               "'json_object' or 'json_schema'")
    if not forced and spec.constrained_tool_calls:
        grammar = tool_call_grammar(tools, tool_choice, tool_format)
        if grammar is not None:
            return {"grammar": _bounded(grammar)}
    return None


def _bounded(grammar: str | None) -> str | None:
    if grammar is not None:
        check_grammar(grammar)
    return grammar
