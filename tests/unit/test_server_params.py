"""No silent no-ops on the server: every Chat Completions parameter OpenAI defines is
honoured or answered with a 400 naming it (enumerated from the ``openai`` package's own
request type), unknown parameters get OpenAI's "Unrecognized request argument", and
``response_format`` / ``max_completion_tokens`` reach the runtime."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from openai.types.chat import completion_create_params as ccp
from server_fakes import FakeRuntime

from adapters.openai_server import create_app
from adapters.openai_server.params import PARAMS

LOCAL = ("127.0.0.1", 50000)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

OPENAI_PARAMS = (set(ccp.CompletionCreateParamsNonStreaming.__annotations__)
                 | set(ccp.CompletionCreateParamsStreaming.__annotations__))

# A value that uses each parameter (for rejected ones: a value that would matter).
USED: dict[str, Any] = {
    "max_tokens": 5, "max_completion_tokens": 5, "stop": ["x"], "stream": False,
    "stream_options": None, "temperature": 0.0, "top_p": 0.9, "seed": 3,
    "tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": False,
    "response_format": {"type": "json_object"}, "n": 2, "user": "u1",
    "prompt_cache_key": "s1", "logprobs": True, "top_logprobs": 2, "logit_bias": {"50": 5},
    "presence_penalty": 0.5, "frequency_penalty": 0.5, "store": True,
    "metadata": {"k": "v"}, "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "mp3"},
    "prediction": {"type": "content", "content": "hi"}, "reasoning_effort": "low",
    "verbosity": "low", "service_tier": "priority", "web_search_options": {},
    "functions": [WEATHER["function"]], "function_call": "auto",
    "safety_identifier": "abc", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": 60}, "moderation": {"enabled": True},
}


def _client() -> tuple[TestClient, FakeRuntime]:
    rt = FakeRuntime()
    return TestClient(create_app(rt), client=LOCAL), rt


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], **extra}


def test_every_openai_parameter_is_classified() -> None:
    assert OPENAI_PARAMS, "the openai package no longer exposes its request type"
    assert set(PARAMS) == OPENAI_PARAMS, (
        f"unclassified: {sorted(OPENAI_PARAMS - set(PARAMS))}, "
        f"stale: {sorted(set(PARAMS) - OPENAI_PARAMS)}"
    )
    assert set(USED) >= OPENAI_PARAMS - {"model", "messages"}


@pytest.mark.parametrize("name", sorted(n for n, p in PARAMS.items() if p.status == "rejected"))
def test_rejected_parameter_gets_a_400_naming_it(name: str) -> None:
    client, rt = _client()
    resp = client.post("/v1/chat/completions", json=_body(**{name: USED[name]}))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == name and name in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert not rt.calls  # nothing was generated


@pytest.mark.parametrize("name", sorted(n for n, p in PARAMS.items()
                                        if p.status == "implemented"
                                        and n not in ("model", "messages")))
def test_implemented_parameter_is_accepted(name: str) -> None:
    client, rt = _client()
    extra = {name: USED[name]}
    if name == "tool_choice":
        extra["tools"] = [WEATHER]
    resp = client.post("/v1/chat/completions", json=_body(**extra))
    assert resp.status_code == 200, (name, resp.text)
    assert len(rt.calls) == 1


@pytest.mark.parametrize("name", ["n", "modalities", "service_tier", "logprobs", "store"])
def test_rejected_parameter_at_its_off_value_passes(name: str) -> None:
    off = {"n": 1, "modalities": ["text"], "service_tier": "auto", "logprobs": False,
           "store": False}[name]
    client, _ = _client()
    assert client.post("/v1/chat/completions", json=_body(**{name: off})).status_code == 200


def test_unknown_parameter_is_rejected_like_openai() -> None:
    client, _ = _client()
    resp = client.post("/v1/chat/completions", json=_body(top_k=5))
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "Unrecognized request argument supplied: top_k"
    assert resp.json()["error"]["param"] == "top_k"


def test_response_format_and_max_completion_tokens_reach_the_runtime() -> None:
    client, rt = _client()
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    resp = client.post("/v1/chat/completions",
                       json=_body(response_format=fmt, max_completion_tokens=7, max_tokens=99))
    assert resp.status_code == 200
    assert rt.calls[0]["response_format"] == fmt and rt.calls[0]["max_tokens"] == 7


@pytest.mark.parametrize("fmt", [{"type": "xml"}, {"type": "json_schema"},
                                 {"type": "json_schema", "json_schema": {"name": "a"}}])
def test_bad_response_format_is_a_400(fmt: dict[str, Any]) -> None:
    client, rt = _client()
    resp = client.post("/v1/chat/completions", json=_body(response_format=fmt))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "response_format"
    assert not rt.calls


def test_forced_tool_that_is_not_bound_is_a_400() -> None:
    client, _ = _client()
    choice = {"type": "function", "function": {"name": "nope"}}
    resp = client.post("/v1/chat/completions", json=_body(tools=[WEATHER], tool_choice=choice))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize("route", [("GET", "/v1/completions"), ("POST", "/v1/embeddings"),
                                   ("GET", "/v1/chat/completions")])
def test_unserved_openai_routes_get_openai_error_body(route: tuple[str, str]) -> None:
    client, _ = _client()
    method, path = route
    resp = client.request(method, path)
    assert resp.status_code in (404, 405)
    assert resp.json() == {"error": {"message": f"Invalid URL ({method} {path})",
                                     "type": "invalid_request_error", "param": None,
                                     "code": None}}


def test_penalties_reach_the_runtime() -> None:
    # OpenAI's two penalties and vLLM's repetition_penalty (an extra body field) become
    # the request's verifier policy; the runtime applies them inside the speculative loop.
    client, rt = _client()
    resp = client.post("/v1/chat/completions", json=_body(
        frequency_penalty=0.5, presence_penalty=-0.25, repetition_penalty=1.1))
    assert resp.status_code == 200, resp.text
    sampling = rt.calls[0]["spec"].verifier.sampling()
    assert (sampling.frequency_penalty, sampling.presence_penalty,
            sampling.repetition_penalty) == (0.5, -0.25, 1.1)
    client.post("/v1/chat/completions", json=_body())
    assert not rt.calls[1]["spec"].verifier.sampling().penalised  # default: off


@pytest.mark.parametrize("name,value", [
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.01), ("presence_penalty", 3),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", "high"),
])
def test_penalty_out_of_range_is_a_400_naming_it(name: str, value: Any) -> None:
    client, rt = _client()
    resp = client.post("/v1/chat/completions", json=_body(**{name: value}))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == name and name in err["message"], err
    assert not rt.calls
