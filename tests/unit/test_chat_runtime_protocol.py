"""Both runtimes satisfy :class:`agentspec.chat.api.ChatRuntime`, ``tool_format`` included
(the faces read it directly). No model is loaded, and vLLM is not imported: the vLLM
runtime is built around a stand-in engine."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_tool_formats import FAMILIES, TEMPLATES, byte_tokenizer

from adapters.vllm import VLLMRuntime
from agentspec.chat.api import ChatRuntime
from agentspec.chat.formats import ToolFormat
from agentspec.errors import ConfigError
from agentspec.runtime import Runtime


def _tokenizer(family: str) -> Any:
    template, eos, special, added = FAMILIES[family]
    return byte_tokenizer((TEMPLATES / template).read_text(), eos, special, added)


def _fake_llm(tokenizer: Any) -> Any:
    return SimpleNamespace(llm_engine=None, get_tokenizer=lambda: tokenizer)


def test_protocol_declares_tool_format() -> None:
    class NoFormat:  # everything but tool_format
        target = store = default_spec = tokenizer = None
        lock = threading.RLock()

        def stream_turn(self, *a: Any, **k: Any) -> Any: ...

        def stream_chat(self, *a: Any, **k: Any) -> Any: ...

        def chat(self, *a: Any, **k: Any) -> Any: ...

    assert not isinstance(NoFormat(), ChatRuntime)
    with_format = NoFormat()
    with_format.tool_format = None  # type: ignore[attr-defined]
    assert isinstance(with_format, ChatRuntime)  # tool_format was the only member missing


def test_hf_runtime_is_a_chat_runtime_with_the_templates_format() -> None:
    target = SimpleNamespace(tokenizer=_tokenizer("hermes"), lock=threading.RLock())
    rt = Runtime(target)  # type: ignore[arg-type]
    assert isinstance(rt, ChatRuntime) and rt.lock is target.lock  # the target's lock
    assert isinstance(rt.tool_format, ToolFormat) and rt.tool_format.name == "hermes"
    explicit = Runtime(target, tool_format="fallback")  # type: ignore[arg-type]
    assert explicit.tool_format.name == "fallback"


def test_vllm_runtime_is_a_chat_runtime_without_vllm() -> None:
    tok = _tokenizer("llama3_json")
    rt = VLLMRuntime(_fake_llm(tok), "m", str(Path("m")))
    assert isinstance(rt, ChatRuntime) and rt.tool_format.name == "llama3_json"
    assert VLLMRuntime(_fake_llm(tok), "m", "m", tool_format="hermes").tool_format.name \
        == "hermes"
    with pytest.raises(ConfigError, match="'nope' is unknown"):
        VLLMRuntime(_fake_llm(tok), "m", "m", tool_format="nope")
    assert "vllm" not in sys.modules  # the class was built without importing vLLM
