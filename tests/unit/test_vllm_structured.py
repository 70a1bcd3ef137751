"""The vLLM backend maps structured-output requests to vLLM's own structured outputs.
vLLM is not installed here (``.venv-vllm`` is built by ``make vllm-env``): a stand-in
``vllm`` module records the parameters the backend builds."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from adapters.vllm.backend import VLLMRuntime
from adapters.vllm.structured import structured_output_kwargs
from agentspec.errors import GrammarError
from agentspec.spec import AgentSpec
from agentspec.types import SamplingParams

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
SCHEMA = {"type": "object", "properties": {"x": {"type": "string"}}}
SPEC = AgentSpec()


def test_response_formats_map_to_vllm_json_options() -> None:
    assert structured_output_kwargs(None, None, {"type": "json_object"}, SPEC) == {
        "json_object": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert structured_output_kwargs(None, None, fmt, SPEC) == {"json": SCHEMA}
    assert structured_output_kwargs(None, None, {"type": "text"}, SPEC) is None
    assert structured_output_kwargs(None, None, None, SPEC) is None
    with pytest.raises(GrammarError, match="'xml'"):
        structured_output_kwargs(None, None, {"type": "xml"}, SPEC)


@pytest.mark.parametrize("choice", ["required", "add", {"type": "function",
                                                         "function": {"name": "add"}}])
def test_forced_tool_calls_map_to_the_tool_grammar(choice: Any) -> None:
    out = structured_output_kwargs([TOOL], choice, {"type": "json_object"}, SPEC)
    assert out is not None and set(out) == {"grammar"}
    assert out["grammar"].startswith('start: "<tool_call>" call "</tool_call>"')
    assert '"const": "add"' in out["grammar"]


def test_auto_and_opt_out() -> None:
    auto = structured_output_kwargs([TOOL], "auto", None, SPEC)
    assert auto is not None and "PROSE" in auto["grammar"]
    off = AgentSpec(constrained_tool_calls=False)
    assert structured_output_kwargs([TOOL], "auto", None, off) is None
    assert structured_output_kwargs([TOOL], "required", None, off) is None
    assert structured_output_kwargs([TOOL], "none", None, SPEC) is None


def test_grammars_past_the_compile_bounds_never_reach_vllm() -> None:
    """vLLM compiles what it is handed on its engine thread: schemas and tool grammars are
    held to the embedded runtime's GrammarLimits first (issue 35 item 9)."""
    patterned = {"type": "object", "patternProperties": {
        f"^p{i}[a-z]+$": {"type": "string"} for i in range(300)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": patterned}}
    with pytest.raises(GrammarError, match="max_pattern_properties"):
        structured_output_kwargs(None, None, fmt, SPEC)
    wide = {"type": "function", "function": {"name": "wide", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1500)}}}}
    for choice in ("required", "auto"):
        with pytest.raises(GrammarError, match="max_object_properties"):
            structured_output_kwargs([wide], choice, None, SPEC)


def test_sampling_params_carry_structured_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm = ModuleType("vllm")
    sampling_params = ModuleType("vllm.sampling_params")
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)  # type: ignore[attr-defined]
    sampling_params.StructuredOutputsParams = (  # type: ignore[attr-defined]
        lambda **kw: ("structured", kw))
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling_params)
    rt = VLLMRuntime.__new__(VLLMRuntime)
    params = rt._sampling_params(SamplingParams(), 8, ["</tool_call>"], {"json_object": True})
    assert params.structured_outputs == ("structured", {"json_object": True})
    assert params.max_tokens == 8 and params.stop == ["</tool_call>"]
    plain = rt._sampling_params(SamplingParams(), 8, [])
    assert not hasattr(plain, "structured_outputs")


def test_sampling_params_carry_penalties(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm = ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    rt = VLLMRuntime.__new__(VLLMRuntime)
    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=0.2, repetition_penalty=1.1)
    params = rt._sampling_params(sp, 8, [])
    assert (params.frequency_penalty, params.presence_penalty,
            params.repetition_penalty) == (0.5, 0.2, 1.1)
    off = rt._sampling_params(SamplingParams(), 8, [])
    assert (off.frequency_penalty, off.presence_penalty, off.repetition_penalty) == (0, 0, 1)
