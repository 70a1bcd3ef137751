"""The OpenAI-compatible server on loopback with the embedded model, driven by the real
``openai`` client and by ``langchain-openai``'s ChatOpenAI: plain, streaming and tool-calling
completions identical to the runtime's own, sessions, API keys and tenant isolation."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerThread, serving

from adapters.openai_server import ServerConfig
from adapters.openai_server.auth import KeyRing
from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec
from agentspec.storage.sessions import SessionStore
from agentspec.targets.cost.live_cost import LiveCost, LiveCostConfig
from agentspec.types import SessionRef

pytestmark = pytest.mark.integration

# carol and dave are used by one test only, so their tenants start with empty caches.
KEYS = {"key-alice": "alice", "key-bob": "bob", "key-carol": "carol", "key-dave": "dave",
        "key-erin": "erin"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DOC = ('Repeat this JSON exactly: {"city": "Paris", "days": 3, "units": "metric", '
       '"tags": ["trip", "weather"]}')
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# One worked example in the history: the 135M model then writes a well-formed call.
TOOL_HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18, "sky": "sunny"}'},
    {"role": "assistant", "content": "It is sunny and 18 C in Paris."},
    {"role": "user", "content": "What is the weather in London?"},
]
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def runtime(embedded_target: Any, tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    store = SessionStore(tmp_path_factory.mktemp("server-store") / "sessions.sqlite3")
    return Runtime(embedded_target, store, AgentSpec())


@pytest.fixture(scope="module")
def server(runtime: Runtime) -> Iterator[ServerThread]:
    with serving(runtime, ServerConfig(keys=KeyRing.from_mapping(KEYS))) as srv:
        yield srv


def _client(server: ServerThread, key: str = "key-alice", **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=300,
                         default_headers=headers or None)


def _model(runtime: Runtime) -> str:
    return str(runtime.target.name)


def test_models_health_and_auth(server: ServerThread, runtime: Runtime) -> None:
    models = _client(server).models.list().data
    assert [m.id for m in models] == [_model(runtime)]
    # The card names the precision the model runs in (the fixture's, fp32 by name).
    assert [getattr(m, "dtype", None) for m in models] == [runtime.target.dtype] == ["float32"]
    assert httpx.get(f"{server.root}/health").json()["status"] == "ok"
    for key in ("key-mallory", ""):
        with pytest.raises(openai.AuthenticationError) as err:
            _client(server, key or "x").chat.completions.create(
                model=_model(runtime), messages=QUESTION, max_tokens=4)  # type: ignore[arg-type]
        assert err.value.status_code == 401 and "key-mallory" not in str(err.value)
    resp = httpx.post(f"{server.base_url}/chat/completions", json={"model": "m"})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


def test_completion_and_stream_identical_to_runtime(server: ServerThread, runtime: Runtime) -> None:
    ref = runtime.chat(QUESTION, max_tokens=24)
    client = _client(server)
    out = client.chat.completions.create(model=_model(runtime), messages=QUESTION,  # type: ignore[arg-type]
                                         max_tokens=24, seed=7)
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage is not None and out.usage.completion_tokens == ref.completion_tokens
    chunks = list(client.chat.completions.create(
        model=_model(runtime), messages=QUESTION, max_tokens=24, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == ref.finish_reason and not any(finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == ref.prompt_tokens


def test_tool_calls_plain_and_streamed(server: ServerThread, runtime: Runtime) -> None:
    ref = runtime.chat(TOOL_HISTORY, [WEATHER], tool_choice=FORCE_WEATHER, max_tokens=40)
    assert [(c.name, c.arguments) for c in ref.tool_calls] == [("get_weather", {"city": "London"})]
    client = _client(server)
    args = {"model": _model(runtime), "messages": TOOL_HISTORY, "tools": [WEATHER],
            "tool_choice": FORCE_WEATHER, "max_tokens": 40}
    out = client.chat.completions.create(**args)  # type: ignore[call-overload]
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "London"}
    streamed: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**args, stream=True):  # type: ignore[call-overload]
        for tc in chunk.choices[0].delta.tool_calls or []:
            slot = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(s["name"], json.loads(s["arguments"])) for s in streamed.values()] == \
        [("get_weather", {"city": "London"})]


def test_sessions_warm_up_and_tenants_are_isolated(server: ServerThread, runtime: Runtime) -> None:
    msgs = [{"role": "user", "content": DOC}]

    def ask(key: str) -> tuple[str, dict[str, Any]]:
        raw = _client(server, key, **{"X-Session-Id": "shared-id"}).chat.completions \
            .with_raw_response.create(model=_model(runtime), messages=msgs, max_tokens=48)  # type: ignore[arg-type]
        assert raw.headers["x-session-id"] == "shared-id"
        body = raw.parse()
        return str(body.choices[0].message.content), dict(body.agentspec)  # type: ignore[attr-defined]

    # The draft gate prices drafts by the machine's timed forwards, shared by every tenant
    # (it is the machine's state, not a tenant's): frozen here, so that the two cold turns
    # meet the same prices and any difference between them could only come from Carol.
    target = runtime.target
    live = target.live_cost
    target.meter.live = LiveCost(live.prior, live.threads, LiveCostConfig(learn=False),
                            measured=live.measured)
    try:
        carol_cold, c1 = ask("key-carol")
        carol_warm, c2 = ask("key-carol")
        dave_cold, d1 = ask("key-dave")
    finally:
        target.meter.live = live
    assert carol_cold == carol_warm == dave_cold
    # Carol's second turn drafts her first from the cache: far fewer forwards.
    assert c2["forwards"] < c1["forwards"]
    # Dave uses the same session id but another tenant: nothing of Carol's is visible, so
    # his cold turn decodes exactly as hers did (both tenants start empty).
    assert d1["forwards"] == c1["forwards"]
    assert d1["accepted_histogram"] == c1["accepted_histogram"]
    store = runtime.store
    assert store is not None
    by_tenant = {i.tenant: i.turns for i in store.list_sessions() if i.session_id == "shared-id"}
    assert by_tenant == {"carol": 2, "dave": 1}


def test_cached_tokens_in_usage_and_metrics(server: ServerThread, runtime: Runtime) -> None:
    """A second turn reuses the first turn's prompt and answer (prefix KV reuse): OpenAI's
    usage.prompt_tokens_details.cached_tokens says how many prompt tokens, streamed or
    not, and the Prometheus counter adds them up."""
    client = _client(server, "key-erin", **{"X-Session-Id": "erin-chat"})

    def cached_total() -> float:
        text = httpx.get(f"{server.root}/metrics").text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "agentspec:prompt_tokens_cached_total")

    before = cached_total()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": DOC}]
    first = client.chat.completions.create(model=_model(runtime), messages=msgs,  # type: ignore[arg-type]
                                           max_tokens=24)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # erin's first request
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Now only the city."}]
    chunks = list(client.chat.completions.create(
        model=_model(runtime), messages=msgs, max_tokens=8, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    assert first.usage.prompt_tokens - 1 <= cached < usage.prompt_tokens
    assert cached_total() - before == cached


def test_langchain_chat_openai(server: ServerThread, runtime: Runtime) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=_model(runtime), base_url=server.base_url, api_key="key-bob",  # type: ignore[arg-type]
                     max_tokens=24, max_retries=0, default_headers={"X-Session-Id": "lc-1"})
    ref = runtime.chat(QUESTION, max_tokens=24)
    assert llm.invoke([HumanMessage(QUESTION[0]["content"])]).content == ref.text
    assert "".join(str(c.content) for c in llm.stream(QUESTION[0]["content"])) == ref.text
    assert runtime.store is not None  # both turns went to Bob's session "lc-1"
    assert runtime.store.info(SessionRef("lc-1", "bob")).turns == 2
    history = [HumanMessage(TOOL_HISTORY[0]["content"]),
               AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"},
                                          "id": "call_1"}]),
               ToolMessage(TOOL_HISTORY[2]["content"], tool_call_id="call_1"),
               AIMessage(TOOL_HISTORY[3]["content"]), HumanMessage(TOOL_HISTORY[4]["content"])]
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather").bind(max_tokens=40)
    msg = bound.invoke(history)
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "London"})]
    gathered: Any = None
    for chunk in bound.stream(history):
        gathered = chunk if gathered is None else gathered + chunk
    assert [(c["name"], c["args"]) for c in gathered.tool_calls] == \
        [("get_weather", {"city": "London"})]


def test_bad_input_over_http(server: ServerThread, runtime: Runtime) -> None:
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=_model(runtime), messages=[], max_tokens=4)
    assert bad.value.body["param"] == "messages"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=QUESTION, max_tokens=4)  # type: ignore[arg-type]
    big = {"model": _model(runtime), "messages": [{"role": "user", "content": "x" * 5_000_000}]}
    resp = httpx.post(f"{server.base_url}/chat/completions", json=big,
                      headers={"Authorization": "Bearer key-alice"}, timeout=60)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_sampling_is_served_or_refused_clearly(server: ServerThread, runtime: Runtime) -> None:
    try:
        out = _client(server).chat.completions.create(
            model=_model(runtime), messages=QUESTION, max_tokens=8, temperature=0.7, seed=1)  # type: ignore[arg-type]
    except openai.BadRequestError as exc:  # until the sampling verifiers land
        assert exc.body["param"] == "temperature" and "temperature" in exc.message  # type: ignore[index]
    else:
        assert isinstance(out.choices[0].message.content, str)


def test_event_loop_answers_while_generating(server: ServerThread, runtime: Runtime) -> None:
    done = threading.Event()

    def long_request() -> None:
        _client(server).chat.completions.create(
            model=_model(runtime), messages=[{"role": "user", "content": "Write a short poem."}],  # type: ignore[arg-type]
            max_tokens=64)
        done.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    seen_running = False
    while not done.is_set():
        # Answered *while* the model generates (running == 1): the loop is not blocked. How
        # fast it answered is not asserted; on a loaded machine that is not deterministic.
        health = httpx.get(f"{server.root}/health", timeout=60).json()
        seen_running |= health["running"] == 1
        time.sleep(0.05)
    worker.join()
    assert seen_running
    metrics = httpx.get(f"{server.root}/metrics").text
    assert "agentspec:spec_decode_num_drafts_total" in metrics


def test_client_disconnect_releases_the_model(server: ServerThread, runtime: Runtime) -> None:
    body = {"model": _model(runtime), "stream": True, "max_tokens": 400, "messages": [
        {"role": "user", "content": "Count from 1 to 200, separated by commas."}]}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=300,
                      headers={"Authorization": "Bearer key-alice"}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"role"' not in line:
                break  # one content chunk, then hang up
    deadline = time.monotonic() + 120
    while httpx.get(f"{server.root}/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{server.root}/health").json()["running"] == 0
    metrics = httpx.get(f"{server.root}/metrics").text
    assert [s.value for f in text_string_to_metric_families(metrics) for s in f.samples
            if s.labels.get("finished_reason") == "abort"] == [1]
    ref = runtime.chat(QUESTION, max_tokens=8)  # the model lock was released
    out = _client(server).chat.completions.create(model=_model(runtime), messages=QUESTION,  # type: ignore[arg-type]
                                                  max_tokens=8)
    assert out.choices[0].message.content == ref.text


def test_local_only_server(runtime: Runtime) -> None:
    with serving(runtime, ServerConfig()) as local:
        out = openai.OpenAI(base_url=local.base_url, api_key="anything", max_retries=0) \
            .chat.completions.create(model=_model(runtime), messages=QUESTION, max_tokens=6)  # type: ignore[arg-type]
        assert out.choices[0].message.content
