"""Every request parameter of OpenAI's Chat Completions API, and what this server does
with it: no parameter is silently ignored.

Each entry is either *implemented* (the server honours it; its values are validated by
:class:`~adapters.openai_server.schemas.ChatCompletionRequest`) or *rejected*: any value
other than the parameter's "off" value is answered with a 400 in OpenAI's error body whose
``param`` names it. Unknown top-level fields get OpenAI's own answer ("Unrecognized request
argument supplied"), since an unknown field the server drops is a silent no-op too.
``tests/unit/test_server_params.py`` checks the table against the ``openai`` package's
request type, so a parameter OpenAI adds fails the test until it is classified here.
:data:`EXTRA_PARAMS` are the non-OpenAI parameters the server also honours (vLLM's
sampling extras, sent by the ``openai`` client through ``extra_body``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from adapters.openai_server.errors import bad_request

Status = Literal["implemented", "rejected"]


def _off(value: Any) -> bool:
    """The values that mean "feature not used": null, false, 0, empty."""
    return value is None or value is False or value == 0 or value in ([], {}, "")


@dataclass(frozen=True)
class Param:
    """How the server treats one request parameter.

    Attributes:
        status: ``implemented`` or ``rejected``.
        note: What the server does (implemented) or why it cannot (rejected).
        allowed: For rejected parameters, the values that still pass (the "off" values
            by default): a rejected parameter set to one of them changes nothing.
    """

    status: Status
    note: str
    allowed: Callable[[Any], bool] = _off


def _impl(note: str) -> Param:
    return Param("implemented", note, lambda _: True)


def _rej(note: str, allowed: Callable[[Any], bool] = _off) -> Param:
    return Param("rejected", note, allowed)


PARAMS: dict[str, Param] = {
    "model": _impl("must name the served model (404 model_not_found otherwise)"),
    "messages": _impl("system/developer/user/assistant/tool turns, text content"),
    "max_tokens": _impl("completion token limit (capped by the server's limit)"),
    "max_completion_tokens": _impl("newer name of max_tokens; wins when both are set"),
    "stop": _impl(
        "up to 4 stop sequences of at most 256 characters each; output ends before the first"
    ),
    "stream": _impl("server-sent events in OpenAI's chunk format"),
    "stream_options": _impl("include_usage adds the final usage chunk"),
    "temperature": _impl("0 (default here) is greedy; > 0 samples losslessly"),
    "top_p": _impl("nucleus sampling"),
    "seed": _impl("seeds the request's generator: same seed, same output"),
    "tools": _impl("function tools, rendered into the prompt"),
    "tool_choice": _impl(
        "none/auto/required/named; required and named force a call whose arguments "
        "follow the tool's parameter schema (grammar-constrained)"
    ),
    "parallel_tool_calls": _impl(
        "the model makes at most one call per turn, which satisfies both true and false"
    ),
    "response_format": _impl(
        "text, json_object (any JSON object) and json_schema (the schema's documents), "
        "enforced by grammar-constrained decoding"
    ),
    "n": _rej("one choice per request only", lambda v: v is None or v == 1),
    "user": _impl("session id when neither X-Session-Id nor prompt_cache_key is sent"),
    "prompt_cache_key": _impl("the session id: scopes the suffix cache that drafts"),
    "logprobs": _rej("log probabilities are not returned"),
    "top_logprobs": _rej("log probabilities are not returned"),
    "logit_bias": _rej("logit bias is not supported"),
    "presence_penalty": _impl(
        "in [-2, 2]: minus this from the logit of every token already generated, applied "
        "to each verified row with its own draft prefix (output = penalised plain decoding)"
    ),
    "frequency_penalty": _impl(
        "in [-2, 2]: minus this times the token's count among the generated tokens, "
        "applied inside the speculative loop as presence_penalty"
    ),
    "store": _rej("completions are not stored for later retrieval"),
    "metadata": _rej("metadata only tags stored completions, which this server has none of"),
    "modalities": _rej("text output only", lambda v: _off(v) or v == ["text"]),
    "audio": _rej("text output only"),
    "prediction": _rej("predicted outputs are not accepted (the session cache drafts)"),
    "reasoning_effort": _rej("the served model is not a reasoning model"),
    "verbosity": _rej("the served model has no verbosity control"),
    "service_tier": _rej("one service tier", lambda v: v in (None, "auto", "default")),
    "web_search_options": _rej("no web search", lambda v: v is None),  # {} turns it on
    "functions": _rej("the deprecated functions API: send tools instead"),
    "function_call": _rej("the deprecated functions API: send tool_choice instead"),
    "safety_identifier": _rej("no abuse monitoring to report the identifier to"),
    "prompt_cache_retention": _rej("cache retention is the server's session store policy"),
    "prompt_cache_options": _rej("cache options are the server's session store policy"),
    "moderation": _rej("no moderation"),
}


#: Parameters outside OpenAI's API that the server honours, as vLLM's server does.
EXTRA_PARAMS: dict[str, Param] = {
    "repetition_penalty": _impl(
        "vLLM's extra parameter (Ollama's repeat_penalty), > 0, 1 is off: logits of tokens "
        "in the prompt or the output are divided by it when positive, multiplied otherwise"
    ),
}


def check_params(body: dict[str, Any]) -> None:
    """Raise a 400 naming the first parameter the server would otherwise ignore.

    Raises:
        APIError: an unknown parameter, or a rejected one set to a value that matters.
    """
    for name, value in body.items():
        param = PARAMS.get(name) or EXTRA_PARAMS.get(name)
        if param is None:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name,
                              "unsupported_parameter")
        if param.status == "rejected" and not param.allowed(value):
            raise bad_request(f"{name}={value!r} is not supported by this server: {param.note}",
                              name, "unsupported_parameter")


def check_structured(request: Any, raw_tools: list[dict[str, Any]] | None) -> None:
    """Reject a ``response_format`` or ``tool_choice`` that cannot become a grammar, or a
    grammar past the compile bounds (:class:`~agentspec.chat.grammar_sources.GrammarLimits`),
    before the request is queued (400 naming the parameter), so no compile work is queued
    behind other requests for it.

    Raises:
        APIError: a bad ``response_format`` type or schema, a forced tool that is not
            bound, or a ``response_format`` schema / tool set past a bound (``param``
            ``response_format`` / ``tools``).
    """
    from agentspec.chat.grammar_sources import (
        GrammarLimitError,
        check_grammar,
        response_format_grammar,
        tool_call_grammar,
    )
    from agentspec.errors import GrammarError

    try:
        grammar = response_format_grammar(request.response_format)
        if grammar is not None:
            check_grammar(grammar)
    except GrammarError as exc:
        raise bad_request(str(exc), "response_format") from None
    if request.tool_choice == "none":
        return  # no tool grammar is compiled
    try:
        # The tool grammar in the fallback format: the model's own format lays out the
        # same schemas, so the bounds hold for it too within a few bytes of tags.
        grammar = tool_call_grammar(raw_tools, request.tool_choice)
        if grammar is not None:
            check_grammar(grammar)
    except GrammarLimitError as exc:
        raise bad_request(str(exc), "tools") from None
    except GrammarError as exc:
        raise bad_request(str(exc), "tool_choice") from None
