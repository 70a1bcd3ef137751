"""Property-based fuzzing of the OpenAI-compatible server, in-process, on every ``make test``.

Hypothesis generates request bodies (valid, almost valid and garbage), session ids (header,
``user``, ``prompt_cache_key``) and tool schemas, and sends each to the real FastAPI app
(routes, validation, error handling, the worker thread, a real SQLite session store) with
:class:`FakeRuntime` standing in for the model, which is not what is being tested here.

Every response must be one of: a 200 with a complete answer (a JSON completion, or an SSE
stream ending in ``[DONE]``) or a 4xx with OpenAI's error body. Never a 5xx, never a
dropped connection, never a malformed body. And the store must agree with what was
answered: a 200 for a session stores exactly one turn under the session id the response
names (a valid id), anything else stores nothing.

The generation is derandomised (the same examples every run) and has no example database,
so the suite is reproducible and writes nothing. ``test_fuzz_volume`` checks that the
suite sent at least :data:`MIN_REQUESTS` requests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from server_fakes import FakeRuntime

from adapters.openai_server import ServerConfig, create_app
from adapters.openai_server.auth import KeyRing
from agentspec.storage.sessions import SessionStore

MIN_REQUESTS = 2000
VALID_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}")
FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.data_too_large])
KEY, TENANT = "fuzz-key", "fuzz-tenant"
SENT: dict[str, int] = {"requests": 0, "served": 0, "streamed": 0, "stored": 0}


class Harness:
    """The app under test, its fake runtime and its store."""

    def __init__(self, tmp: Path) -> None:
        self.store = SessionStore(tmp / "sessions.sqlite3")
        self.runtime = FakeRuntime(self.store)
        self.runtime.release.set()  # a generated "WAIT" prompt must not block
        config = ServerConfig(keys=KeyRing.from_mapping({KEY: TENANT}), max_tokens_limit=512,
                              default_max_tokens=64)
        self.client = TestClient(create_app(self.runtime, config), client=("127.0.0.1", 1))
        # Entered once: one event loop for all requests (not a new loop thread per request).
        self.client.__enter__()

    def turns(self, session: str | None = None) -> int:
        if session is None:
            return int(self.store.stats()["turns"])
        # Any agent: the X-Agent-Id header picks one, and the store keys by it too.
        return sum(s.turns for s in self.store.list_sessions(TENANT) if s.session_id == session)

    def send(self, body: Any = None, raw: bytes | None = None,
             headers: dict[str, str] | None = None) -> None:
        """POST one request and check the response and the store (see module docstring)."""
        SENT["requests"] += 1
        hdrs = {"Authorization": f"Bearer {KEY}", "content-type": "application/json",
                **(headers or {})}
        content = raw if raw is not None else json.dumps(body).encode("utf-8", "surrogatepass")
        before = self.turns()
        resp = self.client.post("/v1/chat/completions", content=content, headers=hdrs)
        assert resp.status_code < 500, (resp.status_code, resp.text[:500], content[:500])
        if resp.status_code != 200:
            assert resp.headers.get("content-type", "").startswith("application/json"), (
                resp.status_code, resp.headers, resp.text[:300], content[:300])
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            assert self.turns() == before, "a refused request stored a turn"
            return
        SENT["served"] += 1
        if resp.headers["content-type"].startswith("text/event-stream"):
            SENT["streamed"] += 1
            # SSE lines end at \n only; str.splitlines() would also split inside a JSON
            # string at U+0085 or U+2028, which the stream legitimately carries raw.
            events = [ln[6:] for ln in resp.text.split("\n") if ln.startswith("data: ")]
            assert events and events[-1] == "[DONE]", resp.text[-300:]
            chunks = [json.loads(e) for e in events[:-1]]
            assert all("error" not in c for c in chunks), chunks
            assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
        else:
            assert resp.headers.get("content-type", "").startswith("application/json"), (
                resp.status_code, resp.headers, resp.text[:300], content[:300])
            out = resp.json()
            assert out["object"] == "chat.completion" and out["choices"][0]["finish_reason"]
        sid = resp.headers.get("x-session-id")
        if sid is None:
            assert self.turns() == before, "an anonymous request stored a turn"
            return
        # Checked here independently of agentspec's own check_id: a valid id is also a
        # header value every HTTP client and proxy accepts (no blanks or control bytes).
        assert VALID_ID.fullmatch(sid), sid
        assert self.turns() == before + 1
        SENT["stored"] += 1
        assert self.turns(sid) >= 1  # the turn went to the session the response names


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    h = Harness(tmp_path_factory.mktemp("fuzz"))
    yield h
    h.client.__exit__(None, None, None)
    h.store.close()


# -- strategies ------------------------------------------------------------------------------

json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_value = st.recursive(json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
# Text the way clients send it: mostly ordinary, sometimes control characters, newlines,
# non-BMP characters and lone surrogates (which JSON can carry as \ud800 escapes).
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
ids = st.one_of(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,20}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,8}[\n\r\t \x00/]", fullmatch=True),
    any_text,
    st.text(st.sampled_from("ab-\n"), min_size=120, max_size=300),
)
header_ids = st.one_of(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,20}", fullmatch=True),
                       st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E),
                               max_size=140))
schema = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "number", "integer", "boolean"])}),
    lambda inner: st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=3)},
        optional={"required": st.lists(st.text(max_size=8), max_size=2)}),
    max_leaves=6)
tool_names = st.one_of(st.sampled_from(["get_weather", "search", "add"]), st.text(max_size=70))
tool = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "function", "function", "code"]),
     "function": st.fixed_dictionaries(
         {"name": tool_names},
         optional={"description": any_text,
                   "parameters": st.one_of(schema, json_value,
                                           st.fixed_dictionaries({"type": st.just("object"),
                                                                  "properties": json_value}))})})
tool_call = st.fixed_dictionaries(
    {"type": st.just("function"),
     "function": st.fixed_dictionaries({"name": tool_names},
                                       optional={"arguments": st.text(max_size=20)})},
    optional={"id": st.sampled_from(["c1", "c2", "call_x"])})
content = st.one_of(any_text, st.none(),
                    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"])},
                                                   optional={"text": any_text}), max_size=3),
                    json_value)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "user", "system", "developer", "assistant", "tool",
                              "robot"])},
    optional={"content": content, "name": st.text(max_size=10),
              "tool_calls": st.lists(tool_call, max_size=2),
              "tool_call_id": st.sampled_from(["c1", "c2", "zz", ""])})
user_message = st.fixed_dictionaries({"role": st.just("user"), "content": any_text})
body = st.fixed_dictionaries(
    {"model": st.sampled_from(["fake-model", "fake-model", "fake-model", "gpt-4o", ""]),
     "messages": st.one_of(st.lists(user_message, min_size=1, max_size=2),
                           st.lists(message, max_size=4), json_value)},
    optional={
        "tools": st.one_of(st.lists(tool, max_size=3), json_value),
        "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "any"]),
                                 json_value),
        "stop": st.one_of(any_text, st.lists(any_text, max_size=5), json_value),
        "max_tokens": st.one_of(st.integers(-5, 2000), json_value),
        "max_completion_tokens": st.integers(-1, 700),
        "temperature": st.one_of(st.sampled_from([0, 0.0, 0.5, 2, 2.5, -1]), json_value),
        "top_p": st.one_of(st.floats(-1, 2, allow_nan=False), json_value),
        "seed": st.one_of(st.integers(-(2**70), 2**70), json_value),
        "stream": st.one_of(st.booleans(), json_value),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}),
                                    json_value),
        "user": st.one_of(ids, json_value),
        "prompt_cache_key": st.one_of(ids, json_value),
        "n": st.one_of(st.integers(-1, 3), json_value),
        "logprobs": json_value,
        "presence_penalty": st.one_of(st.sampled_from([0, 0.0, 0.5]), json_value),
        "parallel_tool_calls": json_value,
    })


valid_tool = st.builds(
    lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
    st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
    st.one_of(st.just({"type": "object", "properties": {}}),
              st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), schema,
                              max_size=3).map(lambda p: {"type": "object", "properties": p})))
# Near-valid requests: every field plausible, so most reach the worker and the store.
valid_body = st.fixed_dictionaries(
    {"model": st.just("fake-model"), "messages": st.lists(user_message, min_size=1, max_size=3)},
    optional={
        "tools": st.lists(valid_tool, max_size=3, unique_by=lambda t: t["function"]["name"]),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4),
        "max_tokens": st.integers(1, 512),
        "temperature": st.just(0),
        "top_p": st.floats(0.01, 1.0),
        "seed": st.integers(-(2**63), 2**64 - 1),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "user": ids,
        "prompt_cache_key": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,20}", fullmatch=True),
        "n": st.just(1),
        "parallel_tool_calls": st.booleans(),
    })


# -- the properties --------------------------------------------------------------------------


@settings(FUZZ, max_examples=1000)
@given(body=st.one_of(valid_body, body))
def test_fuzz_request_bodies(harness: Harness, body: dict[str, Any]) -> None:
    harness.send(body)


@settings(FUZZ, max_examples=400)
@given(header=st.one_of(st.none(), header_ids), agent=st.one_of(st.none(), header_ids),
       user=st.one_of(st.none(), ids), key=st.one_of(st.none(), ids),
       stream=st.booleans(), text=any_text)
def test_fuzz_session_ids(harness: Harness, header: str | None, agent: str | None,
                          user: str | None, key: str | None, stream: bool, text: str) -> None:
    req: dict[str, Any] = {"model": "fake-model", "stream": stream, "max_tokens": 32,
                           "messages": [{"role": "user", "content": text}]}
    if user is not None:
        req["user"] = user
    if key is not None:
        req["prompt_cache_key"] = key
    headers = {name: value for name, value in (("X-Session-Id", header), ("X-Agent-Id", agent))
               if value is not None}
    harness.send(req, headers=headers)


@settings(FUZZ, max_examples=400)
@given(tools=st.lists(tool, min_size=1, max_size=4),
       choice=st.one_of(st.none(), st.sampled_from(["none", "auto", "required"]),
                        st.builds(lambda n: {"type": "function", "function": {"name": n}},
                                  tool_names)),
       call=st.one_of(st.none(), tool_names), args=json_value, stream=st.booleans())
def test_fuzz_tool_schemas(harness: Harness, tools: list[dict[str, Any]], choice: Any,
                           call: str | None, args: Any, stream: bool) -> None:
    # "CALL <name> <json>" makes the fake answer with a tool call, so parsing is exercised.
    text = f"CALL {call} {json.dumps(args)}" if call is not None else "hello"
    req: dict[str, Any] = {"model": "fake-model", "tools": tools, "stream": stream,
                           "messages": [{"role": "user", "content": text}],
                           "user": "tool-fuzz"}
    if choice is not None:
        req["tool_choice"] = choice
    harness.send(req)


@settings(FUZZ, max_examples=300)
@given(raw=st.one_of(
    st.binary(max_size=200),
    st.builds(lambda v: json.dumps(v).encode(), json_value),
    st.builds(lambda d, tail: (("[" * d) + tail).encode(), st.integers(1, 3000),
              st.sampled_from(["", "]", "{", '"x"'])),
    st.builds(lambda t: ('{"model": "fake-model", "messages": [{"role": "user", "content": "'
                         + t + '"}]}').encode("utf-8", "surrogatepass"),
              st.lists(st.sampled_from(['\\ud800', '\\udfff', '\\u0000', '\\n', 'a', '"',
                                        '\\']), max_size=8).map("".join)),
))
def test_fuzz_raw_bodies(harness: Harness, raw: bytes) -> None:
    harness.send(raw=raw)


def test_fuzz_volume(harness: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    """The suite above really sent the requests it claims (and the server stayed sane)."""
    with capsys.disabled():
        print(f"\nserver fuzz: {SENT}")
    assert SENT["requests"] >= MIN_REQUESTS, SENT
    # Not only rejections: a good share went all the way through the worker and the store.
    assert SENT["served"] >= 0.25 * SENT["requests"] and SENT["streamed"] >= 100, SENT
    assert SENT["stored"] >= 200, SENT
    health = harness.client.get("/health").json()
    assert health["waiting"] == 0 and health["running"] == 0
    metrics = harness.client.get("/metrics").text
    statuses = [s.labels["status"] for f in text_string_to_metric_families(metrics)
                for s in f.samples if s.name == "agentspec:http_errors_total"]
    assert statuses and not any(code.startswith("5") for code in statuses), statuses
