"""The OpenAI-compatible server without a model: schemas, auth, errors, metrics, routes.

Routes are driven through Starlette's TestClient against :class:`FakeRuntime`; the client
reports 127.0.0.1 as its address so local-only mode answers it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from server_fakes import FakeRuntime

from adapters.openai_server import ServerConfig, create_app
from adapters.openai_server.auth import KeyRing, load_file, load_keys, parse_env
from adapters.openai_server.config import check_bind, is_loopback
from adapters.openai_server.metrics import LATENCY_BUCKETS, Metrics
from adapters.openai_server.responses import ToolTextFilter
from agentspec.chat.turn import ChatTurn
from agentspec.errors import ConfigError
from agentspec.spec import AgentSpec, VerifierPolicy
from agentspec.types import RequestStats, SessionRef, StepStats

LOCAL = ("127.0.0.1", 50000)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _client(config: ServerConfig | None = None, client: tuple[str, int] = LOCAL,
            ) -> tuple[TestClient, FakeRuntime]:
    rt = FakeRuntime()
    return TestClient(create_app(rt, config), client=client), rt


def _body(text: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": text}], **extra}


def _sse(resp: Any) -> list[Any]:
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _assert_error(resp: Any, status: int, param: str | None = None, code: str | None = None,
                  ) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


# -- auth and binding ------------------------------------------------------------------------


def test_env_keys_and_files(tmp_path: Path) -> None:
    ring = parse_env(" k1=tenant-a , k2=tenant-b,")
    assert ring.tenant_for("Bearer k1") == "tenant-a" and ring.tenants == ["tenant-a", "tenant-b"]
    assert "k1" not in repr(ring)  # only digests are kept
    (tmp_path / "keys.json").write_text(json.dumps({"keys": {"k3": "tenant-c"}}))
    (tmp_path / "keys.toml").write_text('[keys]\nk4 = "tenant-d"\n')
    assert load_file(tmp_path / "keys.json").tenant_for("Bearer k3") == "tenant-c"
    assert load_file(tmp_path / "keys.toml").tenant_for("Bearer k4") == "tenant-d"
    both = load_keys(tmp_path / "keys.json", env={"AGENTSPEC_API_KEYS": "k1=tenant-a"})
    assert both.tenants == ["tenant-a", "tenant-c"]
    assert load_keys(None, env={}).local_only


@pytest.mark.parametrize("bad", ["k1", "=t", "k 1=t", "k1=bad tenant", "k1=a,k1=b"])
def test_bad_env_keys(bad: str) -> None:
    with pytest.raises(ConfigError):
        ring = parse_env(bad)
        ring.merged(parse_env("k1=other"))


def test_bad_key_file(tmp_path: Path) -> None:
    (tmp_path / "k.json").write_text("[1, 2]")
    for path in (tmp_path / "k.json", tmp_path / "missing.json"):
        with pytest.raises(ConfigError, match="key file"):
            load_file(path)


def test_bind_rules() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "::", "testclient", None))
    check_bind("127.0.0.1", KeyRing())
    check_bind("0.0.0.0", parse_env("k=t"))
    with pytest.raises(ConfigError, match=r"refusing to listen on '0\.0\.0\.0' without API keys"):
        check_bind("0.0.0.0", KeyRing())


def test_serve_cli_refuses_public_host_without_keys(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from adapters.openai_server.cli import main

    monkeypatch.delenv("AGENTSPEC_API_KEYS", raising=False)
    assert main(["serve", "--host", "0.0.0.0"]) == 2  # before any model is loaded
    assert "without API keys" in capsys.readouterr().err


def test_unauthorised_keys_are_refused() -> None:
    client, rt = _client(ServerConfig(keys=parse_env("good=tenant-a")))
    _assert_error(client.get("/v1/models"), 401, code="invalid_api_key")
    for auth in ("Bearer wrong", "Basic Z29vZA==", "Bearer "):
        resp = client.post("/v1/chat/completions", json=_body(), headers={"Authorization": auth})
        _assert_error(resp, 401, code="invalid_api_key")
        assert "wrong" not in resp.text
    resp = client.post("/v1/chat/completions", json=_body(),
                       headers={"Authorization": "Bearer good", "X-Session-Id": "s1"})
    assert resp.status_code == 200 and rt.calls[-1]["session"] == SessionRef("s1", "tenant-a")
    assert client.get("/health").status_code == 200  # probes need no key


def test_local_only_mode_answers_loopback_only() -> None:
    client, _ = _client(client=("testclient", 50000))
    _assert_error(client.get("/v1/models"), 403)
    client, rt = _client()
    assert client.get("/v1/models").json()["data"][0]["id"] == "fake-model"
    client.post("/v1/chat/completions", json=_body(), headers={"X-Session-Id": "s"})
    assert rt.calls[-1]["session"] == SessionRef("s", "local")


# -- request validation and error bodies -----------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "fake-model", "messages": []}, "messages"),
    ({"model": "fake-model", "messages": [{"role": "robot", "content": "x"}]}, "messages"),
    (_body(stop=["a", "b", "c", "d", "e"]), "stop"),
    (_body(n=2), "n"),
    (_body(temperature=3), "temperature"),
    (_body(top_p=0), "top_p"),
    (_body(max_tokens=0), "max_tokens"),
    (_body(max_tokens=100_000), "max_tokens"),
    (_body(tool_choice="sometimes"), "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "fake-model", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
])
def test_bad_requests_get_openai_error_bodies(body: dict[str, Any], param: str) -> None:
    client, _ = _client()
    err = _assert_error(client.post("/v1/chat/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"


def test_runtime_errors_map_to_400() -> None:
    client, _ = _client()
    post = client.post
    _assert_error(post("/v1/chat/completions", content=b"{nope"), 400)
    _assert_error(post("/v1/chat/completions", json=[1]), 400)
    _assert_error(post("/v1/chat/completions", json=_body("LONG")), 400, "messages",
                  "context_length_exceeded")
    _assert_error(post("/v1/chat/completions", json=_body("LONG", stream=True)), 400,
                  code="context_length_exceeded")
    _assert_error(post("/v1/chat/completions", json=_body(tool_choice={
        "type": "function", "function": {"name": "nope"}})), 400, "tool_choice")
    _assert_error(post("/v1/chat/completions", json=_body(), headers={"X-Session-Id": "a b"}),
                  400, "X-Session-Id")


def test_sampling_request_is_a_clear_400_until_sampling_verifiers_land() -> None:
    client, rt = _client()
    resp = client.post("/v1/chat/completions", json=_body(temperature=0.7, top_p=0.9, seed=3))
    err = _assert_error(resp, 400, "temperature")
    assert "temperature" in err["message"]
    assert rt.calls[-1]["spec"].verifier.sampling().seed == 3
    rt.default_spec = AgentSpec(verifier=VerifierPolicy(mode="budgeted", budget=1.0))
    resp = client.post("/v1/chat/completions", json=_body(temperature=0.5))
    assert "budgeted" in _assert_error(resp, 400, "temperature")["message"]


def test_unknown_model_and_route() -> None:
    client, _ = _client()
    _assert_error(client.post("/v1/chat/completions", json={**_body(), "model": "gpt-9"}), 404,
                  "model", "model_not_found")
    _assert_error(client.get("/v1/models/gpt-9"), 404, code="model_not_found")
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    missing = client.get("/v2/nothing")  # OpenAI's body for a route it does not serve
    assert missing.status_code == 404
    assert missing.json()["error"] == {"message": "Invalid URL (GET /v2/nothing)",
                                       "type": "invalid_request_error", "param": None,
                                       "code": None}


def test_request_size_limit() -> None:
    client, rt = _client(ServerConfig(max_request_bytes=2000))
    big = _body("x" * 3000)
    _assert_error(client.post("/v1/chat/completions", json=big), 413, code="request_too_large")

    def chunks() -> Any:  # no content-length: the limit applies while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 500):
            yield data[i : i + 500]

    _assert_error(client.post("/v1/chat/completions", content=chunks()), 413)
    assert not rt.calls
    assert client.post("/v1/chat/completions", json=_body("x" * 500)).status_code == 200


# -- completions -----------------------------------------------------------------------------


def test_completion_shape_and_sessions() -> None:
    client, rt = _client()
    resp = client.post("/v1/chat/completions", json=_body(
        "hi there", max_tokens=12, stop="never", user="alice@example.com"))
    data = resp.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "You said: hi"}
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    assert data["agentspec"]["forwards"] == 2
    call = rt.calls[-1]
    assert call["max_tokens"] == 12 and call["stop"] == ["never"]
    assert call["session"].session_id == "alice@example.com"
    client.post("/v1/chat/completions", json=_body(user="Alice Smith"))
    assert rt.calls[-1]["session"].session_id.startswith("user-")
    client.post("/v1/chat/completions", json=_body(prompt_cache_key="pk-1", user="u"))
    assert rt.calls[-1]["session"].session_id == "pk-1"
    client.post("/v1/chat/completions", json=_body())
    # Anonymous under the default (tenant) scope: a fresh session of its own that reads and
    # feeds the tenant's history, never another session's request state.
    anon = rt.calls[-1]["session"]
    assert anon is not None and anon.session_id.startswith("anon-")
    client.post("/v1/chat/completions", json={"model": "fake-model", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text",
                                                                            "text": "brief"}]},
        {"role": "user", "content": "x"}]})
    assert rt.calls[-1]["messages"][0] == {"role": "system", "content": "be brief"}


def test_tool_calls_and_invalid_calls() -> None:
    client, rt = _client()
    body = _body('CALL get_weather {"city": "Paris"}', tools=[WEATHER])
    data = client.post("/v1/chat/completions", json=body).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert rt.calls[-1]["tools"] == [WEATHER]  # sent to the runtime exactly as received
    bad = client.post("/v1/chat/completions", json=_body("BAD", tools=[WEATHER])).json()
    assert bad["choices"][0]["finish_reason"] == "stop"
    assert "tool_calls" not in bad["choices"][0]["message"]
    assert bad["choices"][0]["message"]["content"].startswith("<tool_call>")
    plain = client.post("/v1/chat/completions", json=_body('CALL x {"a": 1}')).json()
    assert plain["choices"][0]["finish_reason"] == "stop"  # no bound tools: nothing parsed
    assert "<tool_call>" in plain["choices"][0]["message"]["content"]


def _stream(client: TestClient, body: dict[str, Any]) -> tuple[list[Any], str]:
    resp = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event")
    chunks = _sse(resp)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    return chunks, text


@pytest.mark.parametrize("text", ["a fairly long message to stream", 'CALL get_weather {"c": 1}',
                                  "BAD"])
def test_streaming_equals_non_streaming(text: str) -> None:
    client, _ = _client()
    body = _body(text, tools=[WEATHER], stream_options={"include_usage": True})
    whole = client.post("/v1/chat/completions", json=body).json()
    chunks, streamed = _stream(client, body)
    msg = whole["choices"][0]["message"]
    assert streamed == (msg["content"] or "")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish[0]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    calls = [tc for c in chunks if c["choices"]
             for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    want = msg.get("tool_calls", [])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in want]


def test_response_bodies_carry_only_the_fields_the_server_sets() -> None:
    # The bodies are openai's models sent with exclude_unset: none of their other optional
    # fields (refusal, audio, service_tier, ...) may leak onto the wire as nulls.
    client, _ = _client()
    body = _body('CALL get_weather {"c": 1}', tools=[WEATHER],
                 stream_options={"include_usage": True})
    whole = client.post("/v1/chat/completions", json=body).json()
    assert set(whole) == {"id", "object", "created", "model", "choices", "usage",
                          "system_fingerprint", "agentspec"}
    (choice,) = whole["choices"]
    assert set(choice) == {"index", "message", "finish_reason", "logprobs"}
    assert set(choice["message"]) == {"role", "content", "tool_calls"}
    assert set(choice["message"]["tool_calls"][0]) == {"id", "type", "function"}
    assert set(whole["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens",
                                   "prompt_tokens_details"}
    chunks, _ = _stream(client, body)
    keys = {"id", "object", "created", "model", "choices", "system_fingerprint"}
    assert all(set(c) == keys for c in chunks[:-2])
    assert set(chunks[-2]) == keys | {"agentspec"} and set(chunks[-1]) == keys | {"usage"}
    assert all(set(c["choices"][0]) == {"index", "delta", "finish_reason", "logprobs"}
               for c in chunks[:-1])
    (call,) = [tc for c in chunks[:-1] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert set(call) == {"index", "id", "type", "function"}
    assert client.get("/v1/models").json()["data"] == [client.get("/v1/models/fake-model").json()]
    assert set(client.get("/v1/models/fake-model").json()) == {"id", "object", "created",
                                                               "owned_by"}


def test_model_card_reports_the_resolved_precision() -> None:
    """``/v1/models`` names the precision the model runs in (``--dtype auto`` resolved, as
    the target holds it): an extra field of the card, absent where the runtime does not say
    (the stand-in above)."""
    rt = FakeRuntime()
    rt.target.dtype = "w8a16"  # type: ignore[attr-defined]
    client = TestClient(create_app(rt), client=LOCAL)
    (card,) = client.get("/v1/models").json()["data"]
    assert card["dtype"] == "w8a16" and card["id"] == "fake-model"
    assert client.get("/v1/models/fake-model").json() == card


def test_tool_text_filter_holds_back_tags() -> None:
    f = ToolTextFilter(tools_active=True)
    text = "Sure thing.  <tool_call>{}"
    out = "".join(f.feed(ch) for ch in text)
    assert out == "Sure thing." and f.blocked
    assert f.rest("Sure thing.") == ""
    g = ToolTextFilter(tools_active=True)
    assert g.feed("a <tool") == "a" and g.feed("box> b") == " <toolbox> b"


# -- metrics ---------------------------------------------------------------------------------


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, parsed: (name, labels) -> value."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_exposition() -> None:
    m = Metrics('m"1')
    stats = RequestStats(prompt_tokens=5, cached_prompt_tokens=2, prefill_s=0.25,
                         generated_tokens=7, forwards=3, steps=[
        StepStats("suffix", 4, 4, 5, 0, 0), StepStats("suffix", 3, 1, 2, 0, 0),
        StepStats("none", 0, 0, 1, 0, 0)])
    m.finished(stats, "stop", 0.3)
    m.error(401)
    m.queued(+1)
    text = m.render()
    assert 'model_name="m\\"1"' in text  # the quote is escaped on the wire
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = _samples(text)
    model = ("model_name", 'm"1')

    def value(name: str, **labels: str) -> float:
        return samples[(f"agentspec:{name}", frozenset({model, *labels.items()}))]

    assert families["agentspec:spec_decode_num_drafts"].type == "counter"
    assert value("spec_decode_num_drafts_total") == 2
    assert value("spec_decode_num_draft_tokens_total") == 7
    assert value("spec_decode_num_accepted_tokens_total") == 5
    per_pos = "spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(per_pos, position=str(p)) for p in range(4)] == [2, 1, 1, 1]
    assert (f"agentspec:{per_pos}", frozenset({model, ("position", "4")})) not in samples
    assert value("request_success_total", finished_reason="stop") == 1
    assert value("http_errors_total", status="401") == 1
    assert value("generation_tokens_total") == 7
    assert value("prompt_tokens_total") == 5
    assert value("prompt_tokens_cached_total") == 2
    assert value("prefill_seconds_total") == pytest.approx(0.25)
    assert value("target_forwards_total") == 3
    assert value("num_requests_waiting") == 1 and value("num_requests_running") == 0
    # The latency histogram: the same buckets, cumulative counts, sum and count.
    e2e = families["agentspec:e2e_request_latency_seconds"]
    assert e2e.type == "histogram"
    buckets = {float(s.labels["le"]): s.value for s in e2e.samples
               if s.name.endswith("_bucket")}
    assert list(buckets) == [*LATENCY_BUCKETS, float("inf")]
    assert all(n == (1 if le >= 0.3 else 0) for le, n in buckets.items())
    assert value("e2e_request_latency_seconds_count") == 1
    assert value("e2e_request_latency_seconds_sum") == pytest.approx(0.3)
    assert value("time_to_first_token_seconds_count") == 0
    # No _created samples; labelled counters have no sample before their first value.
    assert not any(name.endswith("_created") for name, _ in samples)
    assert not any(s.labels.get("finished_reason") == "abort"
                   for f in families.values() for s in f.samples)
    m.aborted()
    assert _samples(m.render())[("agentspec:request_success_total", frozenset(
        {model, ("finished_reason", "abort")}))] == 1


def test_metrics_prefix_cache_gauges_follow_the_store() -> None:
    from agentspec.targets.cache.prefix_cache import PrefixCache

    m, store = Metrics("m"), PrefixCache(budget_bytes=4096, block_size=2)
    m.watch_prefix_cache(store)
    model = frozenset({("model_name", "m")})
    assert _samples(m.render())[("agentspec:prefix_cache_bytes", model)] == 0
    kv = [(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8))]  # 2 blocks of 2 x 8 x 4 x 2
    store.insert("t", [5, 6, 7, 8], kv)
    samples = _samples(m.render())
    assert samples[("agentspec:prefix_cache_bytes", model)] == 256
    assert samples[("agentspec:prefix_cache_budget_bytes", model)] == 4096


def test_metrics_show_the_request_state_home() -> None:
    from agentspec.requests import RequestStates

    m, home = Metrics("m"), RequestStates(max_requests=1)
    m.watch_requests(home)
    model = frozenset({("model_name", "m")})
    slot = home.slot("part")
    slot.put("r1", 1)
    slot.put("r2", 2)  # one more than the home keeps: r1 is forgotten
    samples = _samples(m.render())
    assert samples[("agentspec:request_states", model)] == 1
    assert samples[("agentspec:request_states_evicted_total", model)] == 1


def test_serve_default_prefix_budget_matches_the_library() -> None:
    from adapters.openai_server.cli import DEFAULT_PREFIX_CACHE_MB
    from agentspec.targets.cache.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES

    assert DEFAULT_PREFIX_CACHE_MB << 20 == DEFAULT_PREFIX_CACHE_BYTES


def test_metrics_registries_are_per_instance() -> None:
    a, b = Metrics("a"), Metrics("b")
    a.error(500)
    assert "http_errors_total{" in a.render() and "http_errors_total{" not in b.render()


def test_metrics_route_counts_requests() -> None:
    client, _ = _client()
    client.post("/v1/chat/completions", json=_body())
    client.post("/v1/chat/completions", json=_body(stream=True))
    resp = client.get("/metrics")
    assert resp.headers["content-type"] == CONTENT_TYPE_LATEST
    samples = _samples(resp.text)
    model = ("model_name", "fake-model")
    assert samples[("agentspec:request_success_total",
                    frozenset({model, ("finished_reason", "stop")}))] == 2
    assert samples[("agentspec:spec_decode_num_drafts_total", frozenset({model}))] == 4
    assert samples[("agentspec:time_to_first_token_seconds_count", frozenset({model}))] == 1


# -- the generation queue --------------------------------------------------------------------


def test_queue_limit_and_cancelled_jobs() -> None:
    import asyncio

    from adapters.openai_server.errors import APIError
    from adapters.openai_server.service import ChatService, Job

    async def scenario() -> None:
        rt = FakeRuntime()
        svc = ChatService(rt.stream_turn, ServerConfig(max_waiting=1), Metrics("m"))
        wait = Job(ChatTurn([{"role": "user", "content": "WAIT"}], None, None, None, AgentSpec(),
                            64))
        running = svc.submit(wait)
        while not rt.calls:  # the worker picked it up and blocks inside the runtime
            await asyncio.sleep(0.01)
        queued = svc.submit(Job(ChatTurn([{"role": "user", "content": "x"}], None, None, None,
                                         AgentSpec(), 64)))
        with pytest.raises(APIError) as full:
            svc.submit(wait)
        assert full.value.status == 503 and full.value.code == "queue_full"
        queued.cancel()  # a client that left while queued is skipped, never generated
        rt.release.set()
        kinds = []
        while not kinds or kinds[-1] not in ("done", "error"):
            kinds.append((await running.next())[0])
        assert kinds[-1] == "done"
        svc.shutdown()
        assert len(rt.calls) == 1

    asyncio.run(scenario())


def test_a_turn_the_store_refuses_is_answered_flagged_and_counted(tmp_path: Path) -> None:
    """The client gets its answer with ``agentspec.stored: false``; ``/metrics`` counts the
    failure by operation and reason (every reason exposed at 0 from the start)."""
    from agentspec.storage.sessions import SessionStore, StoreConfig

    with SessionStore(tmp_path / "s.sqlite3", StoreConfig(max_tokens_per_session=4)) as store:
        rt = FakeRuntime(store)
        client = TestClient(create_app(rt), client=LOCAL)
        model = ("model_name", "fake-model")

        def failures(reason: str) -> float:
            samples = _samples(client.get("/metrics").text)
            return samples[("agentspec:store_failures_total",
                            frozenset({model, ("op", "append"), ("reason", reason)}))]

        assert failures("too_large") == 0
        resp = client.post("/v1/chat/completions", json=_body(), headers={"X-Session-Id": "s1"})
        assert resp.status_code == 200 and resp.json()["agentspec"]["stored"] is False
        assert failures("too_large") == 1 and failures("busy") == 0
        anon = client.post("/v1/chat/completions", json=_body())  # no session: nothing to store
        assert anon.json()["agentspec"]["stored"] is None


def test_metrics_count_rejected_and_unwritten_kv_blocks(tmp_path: Path) -> None:
    from agentspec.targets.cache.kv_spill import KVSpill
    from agentspec.targets.cache.prefix_cache import PrefixCache

    spill = KVSpill(tmp_path / "kv", 10**6)
    m, cache = Metrics("m"), PrefixCache(budget_bytes=4096, block_size=2, spill=spill)
    m.watch_prefix_cache(cache)
    kv = [(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8))]
    cache.insert("t", [5, 6, 7, 8], kv)
    for f in (tmp_path / "kv").glob("*.kv"):
        f.write_bytes(b"forged" + f.read_bytes()[6:])
    fresh = PrefixCache(budget_bytes=4096, block_size=2, spill=spill)  # memory empty
    assert fresh.lookup("t", [5, 6, 7, 8, 9], 5)[0] == 0  # forged blocks are misses
    samples = _samples(m.render())
    key = ("agentspec:prefix_cache_disk_faults_total", frozenset({("model_name", "m"),
                                                                  ("kind", "rejected")}))
    assert samples[key] >= 1
