"""Structured outputs on the embedded model: constrained + suffix drafting is token-identical
to constrained greedy without drafts; the server's ``json_schema`` answers follow the
schema on 20 varied prompts and ``json_object`` answers parse; forced tool calls parse;
penalised suffix drafting equals penalised decoding without drafts; the model's own
pretty-printed JSON passes the ``response_format`` grammar; ``get_num_tokens`` counts with
the model's tokenizer without touching the network."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from server_harness import ServerThread, serving

from adapters.openai_server import ServerConfig
from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.types import SamplingParams, SessionRef

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "count": {"type": "integer", "minimum": 0, "maximum": 99999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 2},
    },
    "required": ["name", "count", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                      "strict": True}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOPICS = ["a fruit", "a city", "a planet", "a dog breed", "a colour", "a car brand",
          "a river", "a programming language", "a musical instrument", "a sport",
          "a mountain", "a flower", "a board game", "a metal", "a bird", "a book",
          "a country", "a vegetable", "a dance", "an ocean"]


def _valid(doc: Any) -> bool:
    """``doc`` follows SCHEMA (checked by hand: no jsonschema dependency)."""
    return (isinstance(doc, dict) and set(doc) == {"name", "count", "tags"}
            and isinstance(doc["name"], str) and len(doc["name"]) <= 16
            and isinstance(doc["count"], int) and 0 <= doc["count"] <= 99999
            and isinstance(doc["tags"], list) and len(doc["tags"]) <= 2
            and all(isinstance(t, str) and len(t) <= 12 for t in doc["tags"]))


@pytest.fixture(scope="module")
def runtimes(embedded_target: Any) -> tuple[Runtime, Runtime]:
    """(no drafts, suffix drafts) over the one loaded model, no store."""
    plain = Runtime(embedded_target, None, AgentSpec(drafting=DraftingPolicy(method="none")))
    return plain, Runtime(embedded_target, None, AgentSpec())


@pytest.mark.parametrize("kind", ["json_schema", "forced_tool"])
def test_constrained_suffix_equals_constrained_greedy(runtimes, kind: str) -> None:  # type: ignore[no-untyped-def]
    plain, fast = runtimes
    msgs = [{"role": "user", "content": "Describe a red apple as a thing with tags."}]
    kwargs: dict[str, Any] = (
        {"response_format": JSON_SCHEMA} if kind == "json_schema"
        else {"tools": [WEATHER], "tool_choice": "required"})
    if kind == "forced_tool":
        msgs = [{"role": "user", "content": "What is the weather in Lisbon?"}]
    base = plain.chat(msgs, max_tokens=64, **kwargs)
    session = SessionRef(f"grammar-{kind}")
    first = fast.chat(msgs, max_tokens=64, session=session, **kwargs)
    again = fast.chat(msgs, max_tokens=64, session=session, **kwargs)  # drafts from `first`
    assert first.tokens == base.tokens and again.tokens == base.tokens
    assert again.stats.forwards < base.stats.forwards  # the drafts were accepted
    if kind == "json_schema":
        assert base.finish_reason == "stop" and _valid(json.loads(base.text))
    else:
        assert base.tool_calls and not base.invalid_tool_calls
        assert base.tool_calls[0].name == "get_weather"
        assert set(base.tool_calls[0].arguments) == {"city"}


def test_penalised_suffix_equals_penalised_plain(runtimes) -> None:  # type: ignore[no-untyped-def]
    # A repetition penalty (Ollama's default 1.1) and OpenAI's frequency penalty, applied
    # inside the speculative loop: the suffix cache drafts the previous answer, its rows
    # are penalised by their own draft prefix, the output is the plain penalised one.
    plain, fast = runtimes
    msgs = [{"role": "user", "content": "Write the word apple twenty times."}]
    greedy = plain.chat(msgs, max_tokens=48).tokens
    for sp in (SamplingParams(repetition_penalty=1.1), SamplingParams(frequency_penalty=0.5)):
        base = plain.chat(msgs, max_tokens=48, sampling=sp)
        assert base.tokens != greedy  # the penalty acts
        session = SessionRef(f"penalty-{sp.repetition_penalty}-{sp.frequency_penalty}")
        first = fast.chat(msgs, max_tokens=48, session=session, sampling=sp)
        again = fast.chat(msgs, max_tokens=48, session=session, sampling=sp)
        assert first.tokens == base.tokens and again.tokens == base.tokens
        assert again.stats.forwards < base.stats.forwards  # drafts were accepted


def test_pretty_printed_json_passes_the_response_format_grammar(runtimes) -> None:  # type: ignore[no-untyped-def]
    # The model's tokenizer's own tokens for indented JSON (newline + indent tokens).
    plain, _ = runtimes
    doc = {"name": "apple", "count": 3, "tags": ["red", "sweet"]}
    for text in (json.dumps(doc, indent=2), json.dumps(doc), json.dumps(doc, indent=4)):
        constraint = plain.constraint_for(None, None, JSON_SCHEMA, plain.default_spec)
        assert constraint is not None
        ids = plain.target.tokenizer.encode(text, add_special_tokens=False)
        matcher = constraint.matcher  # type: ignore[attr-defined]
        assert matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids)
        assert matcher.is_accepting(), text


@pytest.fixture(scope="module")
def server(runtimes: tuple[Runtime, Runtime]) -> Iterator[ServerThread]:
    with serving(runtimes[1], ServerConfig()) as srv:
        yield srv


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="local", max_retries=0, timeout=600)


def test_server_json_schema_valid_on_20_prompts(server: ServerThread, runtimes) -> None:  # type: ignore[no-untyped-def]
    client = _client(server)
    model = str(runtimes[1].target.name)
    bad = []
    for topic in TOPICS:
        out = client.chat.completions.create(
            model=model, max_tokens=96, response_format=JSON_SCHEMA,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": f"Describe {topic} as JSON."}])
        text = out.choices[0].message.content or ""
        try:
            ok = _valid(json.loads(text)) and out.choices[0].finish_reason == "stop"
        except json.JSONDecodeError:
            ok = False
        if not ok:
            bad.append((topic, text))
    assert not bad, bad


def test_server_json_object_and_forced_call(server: ServerThread, runtimes) -> None:  # type: ignore[no-untyped-def]
    client = _client(server)
    model = str(runtimes[1].target.name)
    # Greedy SmolLM2 pretty-prints this answer and then nests `"value": {` objects until
    # max_tokens (docs/structured-outputs.md, Limits); Ollama's default repeat penalty, sent
    # as vLLM's extra parameter, closes it.
    out = client.chat.completions.create(
        model=model, max_tokens=200, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Reply with a JSON object with one key."}],
        extra_body={"repetition_penalty": 1.1})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)
    call = client.chat.completions.create(
        model=model, max_tokens=64, tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
        messages=[{"role": "user", "content": "Weather in Oslo?"}])
    calls = call.choices[0].message.tool_calls or []
    assert call.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert set(json.loads(calls[0].function.arguments)) == {"city"}  # type: ignore[union-attr]


def test_get_num_tokens_offline(embedded_target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from adapters.langchain import ChatAgentSpec
    from adapters.langchain import runtimes as runtimes_mod

    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("get_num_tokens tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(runtimes_mod, "_TOKENIZERS", {})
    monkeypatch.setattr(runtimes_mod, "_TARGETS", {})  # read tokenizer.json, load no model
    llm = ChatAgentSpec(store=False)
    text = "Hello world, count these tokens: 12345!"
    expected = embedded_target.tokenizer.encode(text, add_special_tokens=False)
    assert llm.get_token_ids(text) == expected
    assert llm.get_num_tokens(text) == len(expected) > 5
