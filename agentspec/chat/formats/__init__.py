"""Tool-call formats as data, and the choice of a model's format.

``hermes`` (Qwen2.5, Hermes), ``llama3_json`` (Llama 3.x), ``mistral`` (v3 tokenizer),
``mistral_v11`` (v11 tokenizer) and ``fallback`` (a preamble, for templates that ignore
``tools``, such as SmolLM2's). :func:`choose_tool_format` picks one for a tokenizer, the way
llama.cpp and vLLM do: an explicit ``tool_format``; else the tokenizer's
``response_template`` (transformers' response parsing), by the call syntax it parses; else
rules on the chat template's text (``<tool_call>`` -> hermes, ``<|start_header_id|>ipython``
-> llama3_json, ``[TOOL_CALLS]`` -> mistral, with ``[ARGS]`` -> mistral_v11); else the
fallback when the template ignores ``tools``; else a :class:`ConfigError` asking for one.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from typing import Any

from agentspec.chat.formats.base import (
    InvalidToolCall,
    ParsedOutput,
    ToolCall,
    ToolFormat,
    apply_template,
    forces_call,
    tool_names,
)
from agentspec.chat.formats.fallback import FallbackFormat
from agentspec.chat.formats.hermes import HermesFormat
from agentspec.chat.formats.llama3 import Llama3JsonFormat
from agentspec.chat.formats.mistral import MistralFormat, MistralV11Format
from agentspec.errors import ConfigError

__all__ = [
    "FORMATS", "InvalidToolCall", "ParsedOutput", "ToolCall", "ToolFormat",
    "check_format_name", "choose_tool_format", "forces_call", "format_for", "tool_names",
]

FORMATS: dict[str, type[ToolFormat]] = {
    f.name: f for f in (HermesFormat, Llama3JsonFormat, MistralFormat, MistralV11Format,
                        FallbackFormat)
}

_PROBE_TOOL = {"type": "function", "function": {
    "name": "agentspec_probe", "description": "probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


def _by_syntax(text: str) -> str | None:
    """The format whose call syntax appears in ``text`` (a template or response template)."""
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral_v11" if "[ARGS]" in text else "mistral"
    if "<|start_header_id|>ipython" in text or ("ipython" in text and "<|eot_id|>" in text):
        return "llama3_json"
    return None


def _template_text(tokenizer: Any) -> str | None:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):  # named templates: the tool-use one if there is one
        tpl = tpl.get("tool_use") or tpl.get("default")
    return tpl if isinstance(tpl, str) else None


def _ignores_tools(tokenizer: Any) -> bool:
    messages = [{"role": "user", "content": "hi"}]
    try:
        return apply_template(tokenizer, messages) == apply_template(
            tokenizer, messages, tools=[_PROBE_TOOL])
    except ConfigError:
        return False


def check_format_name(tool_format: str) -> str:
    """``tool_format`` itself if it names a format of :data:`FORMATS`.

    Raises:
        ConfigError: an unknown name (the message lists the valid ones).
    """
    if tool_format not in FORMATS:
        raise ConfigError(f"tool_format {tool_format!r} is unknown; use one of "
                          f"{sorted(FORMATS)}")
    return tool_format


def choose_tool_format(tokenizer: Any, tool_format: str | None = None) -> ToolFormat:
    """The tool format of ``tokenizer``'s model, bound to it (see the module docstring).

    Raises:
        ConfigError: an unknown ``tool_format``, or a template that renders tools in a
            syntax none of the formats knows (the message asks for ``tool_format``).
    """
    if tool_format is not None:
        return FORMATS[check_format_name(tool_format)]().bind(tokenizer)
    response = getattr(tokenizer, "response_template", None)
    if response:
        found = _by_syntax(json.dumps(response, ensure_ascii=False))
        if found is None:
            raise ConfigError(
                "the tokenizer's response_template parses tool calls in a syntax agentspec "
                f"does not know; pass tool_format= (one of {sorted(FORMATS)})")
        return FORMATS[found]().bind(tokenizer)
    text = _template_text(tokenizer)
    found = _by_syntax(text) if text else None
    if found is not None:
        return FORMATS[found]().bind(tokenizer)
    if text is None or _ignores_tools(tokenizer):
        return FallbackFormat().bind(tokenizer)
    raise ConfigError(
        "the chat template renders tools, but in no tool-call syntax agentspec recognises "
        f"(hermes <tool_call>, llama3 ipython, mistral [TOOL_CALLS]); pass tool_format= "
        f"(one of {sorted(FORMATS)})")


_CHOSEN: weakref.WeakKeyDictionary[Any, ToolFormat] = weakref.WeakKeyDictionary()


def format_for(tokenizer: Any) -> ToolFormat:
    """:func:`choose_tool_format` with no explicit format, remembered per tokenizer."""
    try:
        return _CHOSEN[tokenizer]
    except (KeyError, TypeError):
        pass
    fmt = choose_tool_format(tokenizer)
    with contextlib.suppress(TypeError):  # not weak-referenceable: chosen again next time
        _CHOSEN[tokenizer] = fmt
    return fmt
