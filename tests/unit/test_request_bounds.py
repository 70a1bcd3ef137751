"""Bounds on stop strings and grammar compilation (issue 35 item 9).

A stop string is searched prefix by prefix at every decode step, and a grammar is compiled
on the thread that serves every request, so both are bounded: a request past a bound gets a
400 naming the parameter before it is queued, and a compiler refuses a grammar past its
:class:`~agentspec.chat.grammar_sources.GrammarLimits` before compiling it (no model is
loaded: the server runs on its fake runtime, the compiler on a byte vocabulary).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_fakes import FakeRuntime

from adapters.openai_server import create_app
from agentspec.chat.grammar import GrammarCompiler
from agentspec.chat.grammar_sources import json_grammar, response_format_grammar
from agentspec.errors import ConfigError, GrammarError

LOCAL = ("127.0.0.1", 50000)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _wide(n: int) -> dict[str, Any]:
    """An object schema with ``n`` optional properties (compile time quadratic in ``n``)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def _patterned(n: int) -> dict[str, Any]:
    """An object schema with ``n`` patternProperties (300 take ~5 s to compile unbounded)."""
    return {"type": "object",
            "patternProperties": {f"^p{i}[a-z]+$": {"type": "string"} for i in range(n)}}


def _client() -> tuple[TestClient, FakeRuntime]:
    rt = FakeRuntime()
    return TestClient(create_app(rt), client=LOCAL), rt


def _post(client: TestClient, **extra: Any) -> Any:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], **extra}
    return client.post("/v1/chat/completions", json=body)


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def _tool(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params}}


# --------------------------------------------------------------------------- stop strings
def test_stop_string_past_the_length_bound_is_a_400_naming_stop() -> None:
    from agentspec.chat.checks import MAX_STOP_CHARS

    assert MAX_STOP_CHARS == 256
    client, rt = _client()
    rng = random.Random(9)
    long_stop = "".join(rng.choice("abcdef") for _ in range(MAX_STOP_CHARS + 1))
    resp = _post(client, stop=["END", long_stop])
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "stop" and "257" in err["message"] and "256" in err["message"]
    resp = _post(client, stop=long_stop)  # a single string is held to the same bound
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop"
    assert not rt.calls
    ok = _post(client, stop=["END", long_stop[:MAX_STOP_CHARS]])
    assert ok.status_code == 200, ok.text
    assert rt.calls[0]["stop"] == ["END", long_stop[:MAX_STOP_CHARS]]


def test_more_than_four_stop_strings_is_a_400_naming_stop() -> None:
    client, rt = _client()
    resp = _post(client, stop=["a", "b", "c", "d", "e"])
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop"
    assert not rt.calls


# --------------------------------------------------------------------------- the server
@pytest.mark.parametrize(("schema", "bound"), [
    (_wide(1_500), "max_object_properties"),
    (_patterned(100), "max_pattern_properties"),
    # ~200 KB of grammar: past the byte bound, well under the 4 MiB body limit.
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 400}
                                       for i in range(500)}}, "max_bytes"),
])
def test_response_format_past_a_grammar_bound_is_a_400(schema: dict[str, Any],
                                                       bound: str) -> None:
    client, rt = _client()
    t0 = time.perf_counter()
    resp = _post(client, response_format=_format(schema))
    elapsed = time.perf_counter() - t0
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "response_format" and bound in err["message"], err
    assert not rt.calls  # refused before it was queued: no compile work at all
    assert elapsed < 5.0, elapsed  # no compile: the checks are one pass over the schema


def test_tools_past_a_grammar_bound_are_a_400_naming_tools() -> None:
    client, rt = _client()
    # 40 tools of 120 optional properties each: no one schema is large, together they are.
    tools = [_tool(f"tool_{k}", {"type": "object", "properties": {
        f"argument_{i}": {"type": "string", "description": "an argument " * 3}
        for i in range(120)}}) for k in range(40)]
    resp = _post(client, tools=tools, tool_choice="required")
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "tools" and "max_bytes" in err["message"], err
    assert not rt.calls
    # The same tools are fine when no grammar is built for them.
    assert _post(client, tools=tools, tool_choice="none").status_code == 200


def test_normal_schemas_still_pass_the_server() -> None:
    client, rt = _client()
    assert _post(client, response_format=_format(SCHEMA)).status_code == 200
    assert _post(client, response_format=_format(_wide(200))).status_code == 200
    tools = [_tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})]
    assert _post(client, tools=tools, tool_choice="required").status_code == 200
    assert len(rt.calls) == 3


# --------------------------------------------------------------------------- the compiler
@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    """A compiler for a 200-token byte vocabulary, warmed up (llguidance's first compile in
    a process takes ~2 s of one-off set-up, which the timings below must not include)."""
    comp = GrammarCompiler.from_tokens([bytes([32 + i % 95]) for i in range(200)], 1, [0])
    comp.constraint(json_grammar(SCHEMA))
    return comp


def test_compiler_refuses_a_grammar_past_a_bound_before_compiling(
        compiler: GrammarCompiler) -> None:
    for schema, bound in [(_patterned(300), "max_pattern_properties"),
                          (_wide(4_000), "max_object_properties")]:
        t0 = time.perf_counter()
        with pytest.raises(GrammarError, match=bound):
            compiler.constraint(json_grammar(schema, flexible=True))
        # Compiled, these take ~5 s and ~1.5 s; refused, a few milliseconds.
        assert time.perf_counter() - t0 < 1.0


def test_schema_nested_inside_a_schema_is_bounded_too(compiler: GrammarCompiler) -> None:
    nested = {"type": "object", "properties": {"inner": {"type": "array",
                                                         "items": _patterned(40)},
                                               "other": _patterned(40)}}
    with pytest.raises(GrammarError, match="80 patternProperties"):
        compiler.constraint(json_grammar(nested))


def test_shared_sub_schemas_cannot_blow_up_serialisation() -> None:
    # A schema built in Python may share sub-schemas: 20 levels of two references to the
    # same child serialise to ~80 MB (each level doubles it). The serialiser stops at the
    # byte bound instead.
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(20):
        schema = {"type": "object", "properties": {"a": schema, "b": schema}}
    t0 = time.perf_counter()
    with pytest.raises(GrammarError, match="max_bytes"):
        response_format_grammar(_format(schema))
    assert time.perf_counter() - t0 < 5.0


def test_compiler_limits_are_configurable_and_reach_llguidance() -> None:
    from agentspec.chat.grammar_sources import GrammarLimits

    vocab = [bytes([32 + i % 95]) for i in range(200)]
    small = GrammarCompiler.from_tokens(vocab, 1, [0], limits=GrammarLimits(max_bytes=100))
    with pytest.raises(GrammarError, match="max_bytes"):
        small.constraint(json_grammar(SCHEMA))
    # llguidance's own counters stop its compiler cooperatively.
    tiny = GrammarCompiler.from_tokens(vocab, 1, [0], limits=GrammarLimits(max_grammar_size=50))
    with pytest.raises(GrammarError, match="too big"):
        tiny.constraint(json_grammar(_wide(20)))


def test_grammar_limits_misuse_names_the_field() -> None:
    from agentspec.chat.grammar_sources import GrammarLimits

    with pytest.raises(ConfigError, match=r"max_bytes must be a positive integer, got 0"):
        GrammarLimits(max_bytes=0)
    with pytest.raises(ConfigError, match="max_pattern_properties"):
        GrammarLimits(max_pattern_properties=True)


def test_normal_schema_still_compiles_and_constrains(compiler: GrammarCompiler) -> None:
    constraint = compiler.constraint(json_grammar(SCHEMA))
    assert not constraint.done and int(constraint.state_mask().sum()) != 0
    assert compiler.constraint(json_grammar(_wide(300), flexible=True)) is not None


def test_in_process_stream_chat_bounds_stop_strings_before_any_work(
    tiny_target: Any, char_decode: Any, tmp_path: Path
) -> None:
    """``Runtime.stream_chat`` holds in-process callers to the server's stop bounds."""
    from agentspec.chat.checks import MAX_STOP_CHARS
    from agentspec.errors import ConfigError
    from agentspec.runtime import Runtime
    from agentspec.storage.sessions import SessionStore

    with SessionStore(tmp_path / "s.sqlite3") as store:
        rt = Runtime(tiny_target, store)
        rt.decode = char_decode  # type: ignore[method-assign]  # no tokenizer on the tiny model
        rt.prompt_ids = lambda *a, **k: ([0, 5, 6, 7], "")  # type: ignore[method-assign]
        msgs = [{"role": "user", "content": "x"}]
        for bad, words in ((["x" * (MAX_STOP_CHARS + 1)], "257"), (list("abcde"), "at most 4"),
                           ([""], "non-empty")):
            with pytest.raises(ConfigError, match=words):
                rt.chat(msgs, max_tokens=4, stop=bad)
        ok = rt.chat(msgs, max_tokens=4, stop=["x" * MAX_STOP_CHARS])
        assert len(ok.tokens) >= 1
