"""ChatAgentSpec without silent no-ops, on a scripted runtime (no model loaded):
``with_structured_output`` in its three methods asks the runtime for the right grammar and
parses the reply, ``max_tokens`` aliases are honoured, and arguments that cannot be
honoured raise a ``ConfigError`` naming them (after langchain-openai's ``model_kwargs``
warning for unknown constructor arguments)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from pydantic import BaseModel
from test_langchain_unit import FakeRuntime

from adapters.langchain import ChatAgentSpec
from agentspec.errors import ConfigError


class City(BaseModel):
    """A city and its population."""

    name: str
    population: int


def _llm(*outputs: str, **kw: Any) -> tuple[ChatAgentSpec, FakeRuntime]:
    rt = FakeRuntime(*outputs)
    return ChatAgentSpec(runtime=rt, store=False, **kw), rt


def test_json_schema_is_the_default_method() -> None:
    llm, rt = _llm('{"name": "Oslo", "population": 700000}')
    assert llm.with_structured_output(City).invoke("a city") == City(name="Oslo",
                                                                    population=700000)
    fmt = rt.calls[0]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "City"
    assert fmt["json_schema"]["schema"]["required"] == ["name", "population"]
    assert rt.calls[0]["tools"] is None


def test_pydantic_v1_models_take_the_json_schema_method() -> None:
    """A ``pydantic.v1`` model has ``schema()``, not ``model_json_schema()`` (it raised
    AttributeError before): its schema reaches the grammar and the reply parses to it."""
    from pydantic import v1

    class Town(v1.BaseModel):
        name: str
        population: int

    llm, rt = _llm('{"name": "Bergen", "population": 290000}')
    out = llm.with_structured_output(Town).invoke("a town")
    assert isinstance(out, Town) and out.population == 290000
    fmt = rt.calls[0]["response_format"]
    assert fmt["json_schema"]["name"] == "Town"
    assert fmt["json_schema"]["schema"]["required"] == ["name", "population"]


def test_json_mode_asks_for_any_json_object() -> None:
    llm, rt = _llm('{"name": "Oslo", "population": 1}')
    out = llm.with_structured_output(City, method="json_mode").invoke("a city")
    assert out == City(name="Oslo", population=1)
    assert rt.calls[0]["response_format"] == {"type": "json_object"}
    llm, rt = _llm('{"a": [1, 2]}')
    assert llm.with_structured_output(None, method="json_mode").invoke("x") == {"a": [1, 2]}


def test_function_calling_forces_the_schema_tool() -> None:
    llm, rt = _llm('<tool_call>{"name": "City", "arguments": {"name": "Rome", '
                   '"population": 2}}</tool_call>')
    out = llm.with_structured_output(City, method="function_calling").invoke("a city")
    assert out == City(name="Rome", population=2)
    assert rt.calls[0]["tool_choice"] == "City"
    assert [t["function"]["name"] for t in rt.calls[0]["tools"]] == ["City"]
    assert rt.calls[0].get("response_format") is None


def test_include_raw_and_dict_schema() -> None:
    schema = {"title": "pt", "type": "object", "properties": {"x": {"type": "integer"}},
              "required": ["x"]}
    llm, rt = _llm('{"x": 3}')
    out = llm.with_structured_output(schema, include_raw=True).invoke("p")
    assert out["parsed"] == {"x": 3} and out["parsing_error"] is None
    assert out["raw"].content == '{"x": 3}'
    assert rt.calls[0]["response_format"]["json_schema"]["schema"]["properties"] == {
        "x": {"type": "integer"}}


def test_bad_structured_output_arguments() -> None:
    llm, _ = _llm()
    with pytest.raises(ConfigError, match="method='xml'"):
        llm.with_structured_output(City, method="xml")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs a schema"):
        llm.with_structured_output(None)
    with pytest.raises(ConfigError, match="unsupported arguments"):
        llm.with_structured_output(City, foo=1)


@pytest.mark.parametrize("alias", ["max_completion_tokens", "num_predict"])
def test_max_tokens_aliases(alias: str) -> None:
    llm, rt = _llm("hi", **{alias: 10})
    assert llm.max_tokens == 10
    llm.invoke("x")
    llm.invoke("x", **{alias: 3})
    assert [c["max_tokens"] for c in rt.calls] == [10, 3]
    with pytest.raises(ValueError, match="conflicts"):  # pydantic wraps it
        ChatAgentSpec(runtime=rt, max_tokens=5, **{alias: 6})


def test_penalties_reach_the_runtime() -> None:
    # Constructor fields (repeat_penalty: Ollama's alias), overridden per call.
    llm, rt = _llm("hi", frequency_penalty=0.5, repeat_penalty=1.1)
    assert llm.repetition_penalty == 1.1
    llm.invoke("x")
    llm.invoke("x", presence_penalty=0.3, repetition_penalty=1.3)
    llm.invoke("x", repeat_penalty=1.05)
    got = [(c["spec"].verifier.frequency_penalty, c["spec"].verifier.presence_penalty,
            c["spec"].verifier.repetition_penalty) for c in rt.calls]
    assert got == [(0.5, 0.0, 1.1), (0.5, 0.3, 1.3), (0.5, 0.0, 1.05)]
    with pytest.raises(ValueError, match="frequency_penalty"):
        ChatAgentSpec(runtime=rt, frequency_penalty=3.0)
    with pytest.raises(ValueError, match="conflicts"):
        ChatAgentSpec(runtime=rt, repetition_penalty=1.2, repeat_penalty=1.1)
    with pytest.raises(ConfigError, match="repetition_penalty"):
        llm.invoke("x", repetition_penalty=0.0)


@pytest.mark.parametrize("name,value", [("logit_bias", {"5": 3}), ("top_k", 5),
                                        ("n", 2), ("logprobs", True), ("frobnicate", 1)])
def test_unhonourable_arguments_raise(name: str, value: Any) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=name):
            ChatAgentSpec(store=False, **{name: value})
    # langchain-openai's convention: the argument was first moved to model_kwargs, warned
    assert any(f"{name} was transferred to model_kwargs" in str(w.message) for w in caught)
    llm, rt = _llm("hi")
    with pytest.raises(ConfigError, match=name):
        llm.invoke("x", **{name: value})
    assert not rt.calls


def test_model_kwargs_response_format_is_honoured() -> None:
    llm, rt = _llm('{"k": 1}', model_kwargs={"response_format": {"type": "json_object"}})
    llm.invoke("x")
    assert rt.calls[0]["response_format"] == {"type": "json_object"}
