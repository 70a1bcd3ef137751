"""Regression tests of issue 14's repros: each input gets a 4xx with OpenAI's error body (or
is served correctly), every error response is counted, and no turn is stored without an
answer delivered to a client that is still there.

The app runs in-process on :class:`FakeRuntime` with a real :class:`SessionStore`, so what
the server *stored* is checked, not only what it answered.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from prometheus_client.parser import text_string_to_metric_families
from server_fakes import FakeRuntime

from adapters.langchain.messages import MessageConversionError, to_agentspec_messages
from adapters.langchain.request import session_from_config, thread_session
from adapters.openai_server import ServerConfig, create_app
from adapters.openai_server.auth import KeyRing, load_file, parse_env
from adapters.openai_server.metrics import Metrics
from adapters.openai_server.service import ChatService, Job
from agentspec.chat.turn import ChatTurn
from agentspec.errors import ConfigError
from agentspec.spec import AgentSpec
from agentspec.storage.sessions import SessionStore, StoreConfig
from agentspec.types import SessionRef, check_id

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from server_harness import serving

LOCAL = ("127.0.0.1", 50000)
TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}


@pytest.fixture
def store(tmp_path: Path) -> SessionStore:
    return SessionStore(tmp_path / "sessions.sqlite3")


def _app(store: SessionStore | None, config: ServerConfig | None = None,
         ) -> tuple[TestClient, FakeRuntime]:
    rt = FakeRuntime(store)
    return TestClient(create_app(rt, config), client=LOCAL), rt


def _body(text: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": text}], **extra}


def _error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return dict(err)


def _errors_counted(client: TestClient) -> int:
    text = client.get("/metrics").text
    return sum(int(float(m)) for m in re.findall(r'http_errors_total\{[^}]*\} (\S+)', text))


def _turns(store: SessionStore) -> int:
    return int(store.stats()["turns"])


# -- repro 1: an id with a trailing newline --------------------------------------------------


@pytest.mark.parametrize("bad", ["nl-sess\n", "a\r", "x\ty", "\nlead", "s\x00", "é", "", "a" * 129])
def test_check_id_matches_the_whole_string(bad: str) -> None:
    with pytest.raises(ConfigError, match="invalid session id"):
        check_id("session", bad)
    assert check_id("session", "ok-1.2:3@x_y") == "ok-1.2:3@x_y"


def test_newline_user_is_served_under_a_valid_session(store: SessionStore) -> None:
    client, _rt = _app(store)
    resp = client.post("/v1/chat/completions", json=_body(user="nl-sess\n"))
    assert resp.status_code == 200, resp.text
    sid = resp.headers["x-session-id"]
    assert sid.startswith("user-") and check_id("session", sid) == sid
    assert resp.json()["agentspec"]["session_id"] == sid
    assert [s.session_id for s in store.list_sessions()] == [sid] and _turns(store) == 1


def test_newline_user_over_real_http_gets_its_answer(store: SessionStore) -> None:
    # The original failure: uvicorn refused the illegal X-Session-Id header after the turn
    # was stored, and the client got an empty reply (and retried, storing more turns).
    with serving(FakeRuntime(store), ServerConfig()) as srv:
        resp = httpx.post(f"{srv.base_url}/chat/completions", timeout=30,
                          json=_body("hi", user="nl-sess\n", max_tokens=4))
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]
    assert check_id("session", resp.headers["x-session-id"])
    assert _turns(store) == 1


def test_newline_ids_in_body_are_refused_and_store_nothing(store: SessionStore) -> None:
    client, rt = _app(store)
    _error(client.post("/v1/chat/completions", json=_body(prompt_cache_key="nl-sess\n")),
           400, "prompt_cache_key")
    assert not rt.calls and _turns(store) == 0


def test_langchain_refuses_newline_session_ids() -> None:
    with pytest.raises(ConfigError):
        session_from_config({"configurable": {"session_id": "lc-nl\n"}}, {})
    hashed = thread_session("lc-nl\n")  # a free-form thread id is hashed into a valid id
    assert hashed.startswith("thread-") and check_id("session", hashed) == hashed


# -- repro 2: 500s that are the client's fault -----------------------------------------------


def test_huge_seed_is_a_400(store: SessionStore) -> None:
    client, rt = _app(store)
    for seed in (2**64, -(2**63) - 1, 10**30):
        _error(client.post("/v1/chat/completions", json=_body(seed=seed, temperature=0.7)),
               400, "seed")
    assert not rt.calls
    resp = client.post("/v1/chat/completions", json=_body(seed=2**64 - 1))
    assert resp.status_code == 200 and rt.calls[-1]["spec"].verifier.seed == 2**64 - 1


def test_lone_surrogate_is_a_400(store: SessionStore) -> None:
    client, rt = _app(store)
    raw = '{"model": "fake-model", "messages": [{"role": "user", "content": "hi \\ud800"}]}'
    err = _error(client.post("/v1/chat/completions", content=raw,
                             headers={"content-type": "application/json"}), 400, "messages")
    assert "surrogate" in err["message"] and not rt.calls


def test_deep_json_is_a_400_with_an_error_body(store: SessionStore) -> None:
    client, rt = _app(store)
    for depth in (1000, 100_000, 70):
        raw = '{"model": "fake-model", "messages": ' + "[" * depth + "]" * depth + "}"
        err = _error(client.post("/v1/chat/completions", content=raw,
                                 headers={"content-type": "application/json"}), 400)
        assert "nests deeper" in err["message"]
    assert not rt.calls


def test_every_error_response_is_counted_even_unexpected_ones(store: SessionStore) -> None:
    client, rt = _app(store)

    class Broken(Exception):
        pass

    def explode(*_: Any, **__: Any) -> Any:
        raise Broken("a bug that escapes every handler")

    statuses = [
        client.post("/v1/chat/completions", content=b"{").status_code,
        client.post("/v1/chat/completions", json=_body(seed=2**70)).status_code,
        client.post("/v1/chat/completions", json=_body(model="nope")).status_code,
        client.get("/v1/nothing-here").status_code,
        client.post("/v1/chat/completions", json=_body("LONG")).status_code,
    ]
    rt.reply = explode  # type: ignore[method-assign]  # fails inside the worker
    statuses.append(client.post("/v1/chat/completions", json=_body()).status_code)
    type(rt).default_spec = property(explode)  # type: ignore[assignment]  # fails in the route
    try:
        resp = client.post("/v1/chat/completions", json=_body())
    finally:
        del type(rt).default_spec
    statuses.append(_error(resp, 500) and resp.status_code)
    assert statuses == [400, 400, 404, 404, 400, 500, 500]
    assert _errors_counted(client) == len(statuses)
    assert "Broken" not in resp.text  # internals stay out of the body


# -- repro 3: shutdown closes the store ------------------------------------------------------


def test_shutdown_checkpoints_the_store_into_its_main_file(tmp_path: Path) -> None:
    path = tmp_path / "sessions.sqlite3"
    store = SessionStore(path)
    with TestClient(create_app(FakeRuntime(store), ServerConfig(owns_runtime=True)),
                    client=LOCAL) as client:
        for i in range(5):
            resp = client.post("/v1/chat/completions", json=_body(f"turn {i}"),
                               headers={"X-Session-Id": "keep-me"})
            assert resp.status_code == 200
        assert Path(f"{path}-wal").stat().st_size > 0  # while serving, turns sit in the WAL
    wal = Path(f"{path}-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    alone = tmp_path / "copy" / "sessions.sqlite3"
    alone.parent.mkdir()
    shutil.copy(path, alone)  # the main file only, as `cp sessions.sqlite3` would
    with sqlite3.connect(alone) as conn:
        assert conn.execute("SELECT turns FROM sessions").fetchall() == [(5,)]
        assert conn.execute("SELECT COUNT(*) FROM turns").fetchone() == (5,)


def test_sessions_backup_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agentspec.cli.sessions import main

    path = tmp_path / "s.sqlite3"
    with SessionStore(path) as live:
        for i in range(3):
            live.append_turn(SessionRef(f"s{i}", "t"), [i, i + 1])
        # The store stays open (a running server): the backup is taken from the live file.
        assert main(["--store", str(path), "backup", str(tmp_path / "b.sqlite3")]) == 0
        assert "3 sessions" in capsys.readouterr().err
        assert main(["--store", str(path), "backup", str(tmp_path / "b.sqlite3")]) == 2
    with SessionStore(tmp_path / "b.sqlite3") as copy:
        assert copy.load(SessionRef("s2", "t")) == [[2, 3]]


# -- repro 4: one key, two tenants -----------------------------------------------------------


def test_duplicate_api_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="twice"):
        parse_env("k=tenantA,k=tenantB")
    with pytest.raises(ConfigError, match="twice"):
        parse_env("k=tenantA, k=tenantA")
    (tmp_path / "keys.json").write_text('{"keys": {"k": "tenantA", "k": "tenantB"}}')
    with pytest.raises(ConfigError):
        load_file(tmp_path / "keys.json")


# -- repro 5: work for departed clients ------------------------------------------------------


def _job(rt: FakeRuntime, text: str, session: str) -> Job:
    return Job(ChatTurn([{"role": "user", "content": text}], None, None, SessionRef(session),
                        AgentSpec(), 64))


def test_a_queued_job_whose_client_left_is_skipped(store: SessionStore) -> None:
    rt = FakeRuntime(store)
    service = ChatService(rt.stream_turn, ServerConfig(), Metrics("fake"))

    async def scenario() -> str:
        first = service.submit(_job(rt, "WAIT", "busy"))
        second = service.submit(_job(rt, "never run", "gone"))
        second.cancel()  # the client hung up while its job waited
        rt.release.set()
        while (await first.next())[0] == "delta":
            pass
        return (await second.next())[0]

    kind = asyncio.run(scenario())
    service.shutdown()
    assert kind == "cancelled"
    assert [c["messages"][-1]["content"] for c in rt.calls] == ["WAIT"]
    assert [s.session_id for s in store.list_sessions()] == ["busy"]


def test_http_client_that_leaves_while_queued_gets_no_work(store: SessionStore) -> None:
    rt = FakeRuntime(store)
    with serving(rt, ServerConfig()) as srv:
        url = f"{srv.base_url}/chat/completions"
        blocker = threading.Thread(target=lambda: httpx.post(
            url, json=_body("WAIT"), headers={"X-Session-Id": "busy"}, timeout=30))
        blocker.start()
        while httpx.get(f"{srv.root}/health").json()["running"] == 0:
            pass
        with pytest.raises(httpx.ReadTimeout):  # queued behind WAIT, the client gives up
            httpx.post(url, json=_body("left"), headers={"X-Session-Id": "gone"},
                       timeout=httpx.Timeout(30, read=0.3))
        # Release the model only once the server has seen the hang-up (on a loaded machine
        # the event loop may take a moment to read the closed socket): the departed
        # client's request then leaves the queue at once.
        service = srv.app.state.service
        deadline = time.monotonic() + 60
        while service.waiting:
            assert time.monotonic() < deadline, "the server never noticed the hang-up"
            time.sleep(0.01)
        rt.release.set()
        blocker.join()
        while httpx.get(f"{srv.root}/health").json()["waiting"]:
            pass
        metrics = httpx.get(f"{srv.root}/metrics").text
    assert [c["messages"][-1]["content"] for c in rt.calls] == ["WAIT"]
    assert [s.session_id for s in store.list_sessions()] == ["busy"]
    assert [s.value for f in text_string_to_metric_families(metrics) for s in f.samples
            if s.labels.get("finished_reason") == "abort"] == [1]


# -- repro 6: one LRU across tenants ---------------------------------------------------------


def test_store_quota_evicts_within_the_tenant(tmp_path: Path) -> None:
    cfg = StoreConfig(max_sessions=8, max_sessions_per_tenant=5, max_tokens_per_tenant=40)
    with SessionStore(tmp_path / "q.sqlite3", cfg) as st:
        for i in range(3):
            st.append_turn(SessionRef(f"b{i}", "quiet"), [1, 2])
        for i in range(50):  # a noisy tenant opens many sessions
            st.append_turn(SessionRef(f"a{i}", "noisy"), [3] * 7)
        quiet = [s.session_id for s in st.list_sessions("quiet")]
        noisy = st.list_sessions("noisy")
        assert quiet == ["b0", "b1", "b2"]
        assert len(noisy) == 5 and sum(s.tokens for s in noisy) <= 40
        assert [s.session_id for s in noisy] == [f"a{i}" for i in range(45, 50)]
        st.append_turn(SessionRef("a49", "noisy"), [3] * 20)  # tokens: a49 grows, others go
        assert sum(s.tokens for s in st.list_sessions("noisy")) <= 40
        assert st.load(SessionRef("a49", "noisy"))[-1] == [3] * 20


def test_full_store_evicts_from_the_heaviest_tenant(tmp_path: Path) -> None:
    with SessionStore(tmp_path / "f.sqlite3", StoreConfig(max_sessions=6)) as st:
        for i in range(2):
            st.append_turn(SessionRef(f"b{i}", "quiet"), [1])
        for i in range(30):
            st.append_turn(SessionRef(f"a{i}", "noisy"), [2])
        assert [s.session_id for s in st.list_sessions("quiet")] == ["b0", "b1"]
        assert len(st.list_sessions()) == 6


def test_in_memory_history_lru_is_per_tenant() -> None:
    from agentspec.drafters.suffix.drafter import SuffixConfig, SuffixDrafter
    from agentspec.types import DraftContext

    drafter = SuffixDrafter(SuffixConfig(max_scopes=4, scope="session"))
    for ref in [SessionRef("q", "quiet")] + [SessionRef(f"n{i}", "noisy") for i in range(20)]:
        drafter.finish(DraftContext([1, 2, 3, 4], 2, ref, 1))
    scopes = drafter.stats()["scopes"]
    assert "session/quiet/q" in scopes and len(scopes) == 4


# -- repro 7: lenient inputs -----------------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    (_body(stream="yes"), "stream"),
    (_body(stream=1), "stream"),
    (_body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": "city"}}}]), "tools"),
    (_body(tools=[TOOL, TOOL]), "tools"),
    ({"model": "fake-model", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather"}}]},
        {"role": "tool", "content": "sunny"}]}, "messages"),
    ({"model": "fake-model", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "tool", "content": "sunny", "tool_call_id": "c9"}]}, "messages"),
    ({"model": "fake-model", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c2"}]}, "messages"),
])
def test_lenient_inputs_are_refused(store: SessionStore, body: dict[str, Any], param: str,
                                    ) -> None:
    client, rt = _app(store)
    _error(client.post("/v1/chat/completions", json=body), 400, param)
    assert not rt.calls and _turns(store) == 0


def test_a_correct_tool_reply_is_served(store: SessionStore) -> None:
    client, _rt = _app(store)
    body = {"model": "fake-model", "tools": [TOOL], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize("auth", ["bearer good", "BEARER good", "Bearer  good", "Bearer good ",
                                  "Bearer\tgood", "Bearer go od"])
def test_sloppy_authorization_is_refused(auth: str) -> None:
    client, rt = _app(None, ServerConfig(keys=KeyRing.from_mapping({"good": "t"})))
    resp = client.post("/v1/chat/completions", json=_body(), headers={"Authorization": auth})
    _error(resp, 401)
    assert not rt.calls


def test_langchain_tool_message_must_answer_a_call() -> None:
    call = AIMessage("", tool_calls=[{"name": "f", "args": {}, "id": "c1"}])
    ok = to_agentspec_messages([HumanMessage("q"), call, ToolMessage("r", tool_call_id="c1")])
    assert [m["role"] for m in ok] == ["user", "assistant", "tool"]
    for history in ([HumanMessage("q"), ToolMessage("r", tool_call_id="c1")],
                    [HumanMessage("q"), call, ToolMessage("r", tool_call_id="zz")]):
        with pytest.raises(MessageConversionError, match="tool"):
            to_agentspec_messages(history)


def test_a_body_that_never_arrives_gets_a_408() -> None:
    with serving(FakeRuntime(), ServerConfig(body_timeout_s=0.3)) as srv, \
            socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"model\"")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_serve_flags_reach_the_store_quotas(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from adapters.openai_server import cli

    parser = argparse.ArgumentParser()
    cli.add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--tenant-max-sessions", "7", "--tenant-max-tokens",
                              "900", "--no-store"])
    assert cli.build_config(args).owns_runtime  # serve closes the store it opened
    seen: dict[str, Any] = {}

    def fake_load(*_: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise ConfigError("stop before loading a model")

    monkeypatch.setattr("agentspec.runtime.Runtime.load", fake_load)
    assert cli.run_serve(args) == 2
    quotas = seen["store_config"]
    assert (quotas.max_sessions_per_tenant, quotas.max_tokens_per_tenant) == (7, 900)
    with pytest.raises(ConfigError, match="max_tokens_per_tenant"):
        StoreConfig(max_tokens_per_tenant=0)
