"""``with_structured_output`` and the call options of :class:`ChatAgentSpec`, with no
silent no-ops.

Structured output is grammar-constrained (see ``docs/structured-outputs.md``), so the
reply always parses:

* ``method="json_schema"`` (the default, as in langchain-ollama): the reply is a JSON
  document of the schema (``response_format`` ``json_schema``);
* ``method="json_mode"``: the reply is a JSON object (``response_format`` ``json_object``);
  the schema only chooses the parser, and the prompt should ask for its fields;
* ``method="function_calling"``: the schema is bound as a tool and the call is forced, its
  arguments following the schema.

Constructor arguments the model does not define go to ``model_kwargs`` with
langchain-openai's warning; those that cannot be honoured (``logit_bias``, ``n > 1``...)
then raise a ``ConfigError`` (a ``ValueError``) naming them, at construction
and on every call, instead of being ignored. ``max_completion_tokens`` (OpenAI) and
``num_predict`` (Ollama) are aliases of ``max_tokens``; ``repeat_penalty`` (Ollama) is an
alias of ``repetition_penalty``. The penalties (``frequency_penalty``, ``presence_penalty``,
``repetition_penalty``) are honoured inside the speculative loop, as call arguments too.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import itemgetter
from typing import Any, Literal

from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
)
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from agentspec.errors import ConfigError

StructuredMethod = Literal["json_schema", "json_mode", "function_calling"]

#: Aliases of ``max_tokens`` accepted as constructor, ``model_kwargs`` or call arguments.
MAX_TOKENS_ALIASES = ("max_completion_tokens", "num_predict")
#: Penalties honoured as constructor and call arguments (``repeat_penalty``: Ollama's name
#: of ``repetition_penalty``).
PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty")
PENALTY_ALIASES = {"repeat_penalty": "repetition_penalty"}
#: Call arguments ChatAgentSpec honours (besides the ``max_tokens`` aliases).
CALL_ARGS = frozenset({
    "tools", "tool_choice", "temperature", "max_tokens", "timeout", "session_id", "model",
    "response_format", "stop", "parallel_tool_calls", *PENALTIES, *PENALTY_ALIASES,
    # set by LangChain itself for tracing (with_structured_output, bind_tools)
    "ls_structured_output_format",
    # LangChain's standard credential argument: the embedded model has no endpoint to
    # authenticate to, so there is nothing to honour (the standard tests pass one).
    "api_key",
})
#: Why the OpenAI / Ollama options LangChain users pass most often cannot be honoured.
UNSUPPORTED = {
    "logit_bias": "logit bias is not supported",
    "logprobs": "log probabilities are not returned",
    "top_logprobs": "log probabilities are not returned",
    "n": "one generation per call only",
    "top_k": "set top_k in the agent spec's verifier policy",
    "top_p": "set top_p in the agent spec's verifier policy",
}


def check_call_args(kwargs: Mapping[str, Any]) -> None:
    """Raise for a call (or ``model_kwargs``) argument ChatAgentSpec would ignore.

    Raises:
        ConfigError: an unknown argument, or a known one it cannot honour (named, with why).
    """
    for name, value in kwargs.items():
        if name in CALL_ARGS or name in MAX_TOKENS_ALIASES:
            continue
        if name == "n" and value in (None, 1):
            continue
        why = UNSUPPORTED.get(name, "ChatAgentSpec does not support it")
        raise ConfigError(f"{name}={value!r} cannot be honoured: {why}")


def token_limit(kwargs: Mapping[str, Any]) -> Any:
    """``max_tokens`` or the first of its aliases that is set (``None``: none is)."""
    for name in ("max_tokens", *MAX_TOKENS_ALIASES):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def _pydantic_json_schema(model: Any) -> dict[str, Any]:
    """The JSON schema of a pydantic model class, v2 (``model_json_schema``) or v1
    (``pydantic.v1.BaseModel.schema``)."""
    if hasattr(model, "model_json_schema"):
        return dict(model.model_json_schema())
    return dict(model.schema())


def _schema_name(schema: Any, json_schema: dict[str, Any]) -> str:
    if isinstance(schema, type):
        return schema.__name__
    title = json_schema.get("title") if isinstance(json_schema, dict) else None
    return str(title or "response")


def structured_runnable(
    llm: Any,
    schema: Any,
    *,
    method: StructuredMethod = "json_schema",
    include_raw: bool = False,
    strict: bool | None = None,
) -> Runnable[Any, Any]:
    """The runnable ``llm.with_structured_output(schema, ...)`` returns.

    Args:
        llm: The chat model (``ChatAgentSpec``).
        schema: A pydantic model, a TypedDict, a JSON schema dict or an OpenAI tool dict
            (``None`` only with ``json_mode``: any JSON object, parsed to a dict).
        method: ``json_schema``, ``json_mode`` or ``function_calling``.
        include_raw: Return ``{"raw", "parsed", "parsing_error"}`` instead of the parsed value.
        strict: Accepted for API compatibility: the grammar enforces the schema either way.

    Raises:
        ConfigError: an unknown method, or no schema where the method needs one.
    """
    pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    parser: Runnable[Any, Any]
    if method == "function_calling":
        if schema is None:
            raise ConfigError("method='function_calling' needs a schema")
        name = convert_to_openai_tool(schema)["function"]["name"]
        bound = llm.bind_tools([schema], tool_choice=name, ls_structured_output_format={
            "kwargs": {"method": method, "strict": strict}, "schema": schema})
        parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic
                  else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
    elif method in ("json_schema", "json_mode"):
        if method == "json_schema":
            if schema is None:
                raise ConfigError("method='json_schema' needs a schema")
            # pydantic v2 models have model_json_schema(); v1 models (pydantic.v1, which
            # langchain-tests checks too) only schema().
            js = (_pydantic_json_schema(schema) if pydantic
                  else convert_to_json_schema(schema))
            fmt: dict[str, Any] = {"type": "json_schema", "json_schema": {
                "name": _schema_name(schema, js), "schema": js, "strict": True}}
        else:
            fmt = {"type": "json_object"}
        bound = llm.bind(response_format=fmt, ls_structured_output_format={
            "kwargs": {"method": method, "strict": strict}, "schema": schema})
        parser = (PydanticOutputParser(pydantic_object=schema) if pydantic
                  else JsonOutputParser())
    else:
        raise ConfigError(
            f"method={method!r} is not supported; use 'json_schema', 'json_mode' or "
            "'function_calling'"
        )
    if not include_raw:
        return bound | parser
    with_parsed = RunnablePassthrough.assign(
        parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=bound) | with_parsed.with_fallbacks(
        [fallback], exception_key="parsing_error")
