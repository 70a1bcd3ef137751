"""Issue 35 item 5: fair queues, deadlines and cancellation.

One tenant must not fill the generation queue for everyone: each tenant has a share of it
(429 past the share, other tenants still get in), tenants are served round-robin, a client
that leaves gives its slot back at once, a request that waited too long gets a 503 without
running, a generation past its deadline ends with ``finish_reason="length"``, and a cancel
reaches the runtime during a (chunked) prefill. The server runs on :class:`FakeRuntime`;
the prefill and decode checks run on the tiny random model.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from server_fakes import FakeRuntime

from adapters.openai_server import ServerConfig, create_app
from adapters.openai_server.auth import KeyRing
from adapters.openai_server.errors import APIError
from adapters.openai_server.metrics import Metrics
from adapters.openai_server.service import ChatService, Job, Ticket
from agentspec.chat.turn import ChatTurn
from agentspec.spec import AgentSpec
from agentspec.storage.sessions import SessionStore
from agentspec.targets.cache.prefix_cache import PrefixCache
from agentspec.targets.hf import HFTarget
from agentspec.types import SessionRef

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from server_harness import serving

LOCAL = ("127.0.0.1", 50000)
KEYS = KeyRing.from_mapping({"key-a": "a", "key-b": "b"})


def _job(text: str, tenant: str) -> Job:
    # The tenant rides on the session here; build_job also sets Job.tenant (the API key's).
    return Job(ChatTurn([{"role": "user", "content": text}], None, None,
                        SessionRef(f"s-{tenant}", tenant=tenant), AgentSpec(), 64))


def _body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": text}], **extra}


async def _finish(gen: Ticket) -> tuple[str, Any, str]:
    """The final event of ``gen`` and the text of its deltas."""
    text = ""
    while True:
        kind, payload = await asyncio.wait_for(gen.next(), 20)
        if kind != "delta":
            return kind, payload, text
        text += payload


async def _running(rt: FakeRuntime, n: int = 1) -> None:
    deadline = time.monotonic() + 20
    while len(rt.calls) < n:  # the worker picked the job up and blocks inside the runtime
        assert time.monotonic() < deadline, "the worker never started the job"
        await asyncio.sleep(0.01)


def _run(rt: FakeRuntime, svc: ChatService, scenario: Any) -> Any:
    try:
        return asyncio.run(scenario())
    finally:
        rt.release.set()  # never leave the worker blocked in WAIT (shutdown waits for it)
        svc.shutdown()


def _sample(metrics_text: str, name: str, **labels: str) -> float:
    inner = ",".join(f'{k}="{v}"' for k, v in {"model_name": "m", **labels}.items())
    prefix = f"agentspec:{name}{{{inner}}} "
    for line in metrics_text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise AssertionError(f"no sample {prefix!r} in the exposition")


def _wait_for(predicate: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _occupy(rt: FakeRuntime, url: str) -> threading.Thread:
    """Send a WAIT request from a thread and return once the model runs it (busy until
    ``rt.release``)."""
    blocker = threading.Thread(target=lambda: httpx.post(url, json=_body("WAIT"), timeout=30))
    blocker.start()
    _wait_for(lambda: rt.calls, "WAIT never started")
    return blocker


# -- a tenant's share of the queue -----------------------------------------------------------


def test_a_flooding_tenant_gets_429_past_its_share_and_others_still_get_in() -> None:
    rt, metrics = FakeRuntime(), Metrics("m")
    svc = ChatService(rt.stream_turn, ServerConfig(keys=KEYS, max_waiting=8), metrics)

    async def scenario() -> tuple[APIError, list[tuple[str, Any, str]]]:
        running = svc.submit(_job("WAIT", "a"))
        await _running(rt)
        flood = [svc.submit(_job(f"a{i}", "a")) for i in range(2)]  # a's share: 8 // 4
        with pytest.raises(APIError) as over:
            svc.submit(_job("a-more", "a"))
        other = svc.submit(_job("b0", "b"))  # 3 of 8 slots used: b gets in
        rt.release.set()
        return over.value, [await _finish(g) for g in (running, *flood, other)]

    over, results = _run(rt, svc, scenario)
    assert over.status == 429 and over.code == "rate_limit_exceeded"
    assert over.headers["Retry-After"].isdigit()
    assert [r[0] for r in results] == ["done"] * 4 and results[-1][2] == "You said: b0"
    text = metrics.render()
    assert _sample(text, "queue_rejections_total", reason="tenant_share") == 1
    assert _sample(text, "queue_rejections_total", reason="global_full") == 0


def test_over_http_the_flooder_gets_429_with_retry_after_and_the_other_tenant_200() -> None:
    rt = FakeRuntime()
    with serving(rt, ServerConfig(keys=KEYS, max_waiting=4)) as srv:  # share: 1
        url = f"{srv.base_url}/chat/completions"

        def post(key: str, text: str, out: list[httpx.Response]) -> threading.Thread:
            t = threading.Thread(target=lambda: out.append(httpx.post(
                url, json=_body(text), headers={"Authorization": f"Bearer {key}"},
                timeout=30)))
            t.start()
            return t

        def waiting() -> int:
            return int(httpx.get(f"{srv.root}/health").json()["waiting"])

        answers: list[httpx.Response] = []
        threads = [post("key-a", "WAIT", answers)]
        _wait_for(lambda: rt.calls, "WAIT never started")
        threads.append(post("key-a", "a1", answers))
        _wait_for(lambda: waiting() == 1, "a1 never queued")
        refused = httpx.post(url, json=_body("a2"), headers={"Authorization": "Bearer key-a"},
                             timeout=30)
        threads.append(post("key-b", "b1", answers))
        _wait_for(lambda: waiting() == 2, "b1 was not queued")
        rt.release.set()
        for t in threads:
            t.join()
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"].isdigit()
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert sorted(r.status_code for r in answers) == [200, 200, 200]


def test_tenants_are_served_round_robin() -> None:
    rt = FakeRuntime()
    svc = ChatService(rt.stream_turn, ServerConfig(), Metrics("m"))

    async def scenario() -> None:
        gens = [svc.submit(_job("WAIT", "a"))]
        await _running(rt)
        gens += [svc.submit(_job(t, "a")) for t in ("a1", "a2", "a3")]
        gens += [svc.submit(_job(t, "b")) for t in ("b1", "b2")]
        gens += [svc.submit(_job("c1", "c"))]
        rt.release.set()
        for g in gens:
            assert (await _finish(g))[0] == "done"

    _run(rt, svc, scenario)
    # b's and c's first requests wait behind one of a's, not behind all of a's backlog.
    assert [c["messages"][-1]["content"] for c in rt.calls] == \
        ["WAIT", "a1", "b1", "c1", "a2", "b2", "a3"]


# -- cancellation --------------------------------------------------------------------------


def test_a_flood_that_disconnects_releases_its_slots_at_once() -> None:
    rt, metrics = FakeRuntime(), Metrics("m")
    svc = ChatService(rt.stream_turn, ServerConfig(max_waiting=4), metrics)

    async def scenario() -> None:
        running = svc.submit(_job("WAIT", "a"))
        await _running(rt)
        flood = [svc.submit(_job(f"a{i}", "a")) for i in range(4)]
        with pytest.raises(APIError) as full:
            svc.submit(_job("b0", "b"))
        assert full.value.status == 503 and full.value.code == "queue_full"
        for g in flood:
            g.cancel()  # the flooding client hangs up
        # Its slots are free now, while the model is still busy with WAIT.
        assert metrics.waiting == 0 and svc.waiting == 0
        assert [(await asyncio.wait_for(g.next(), 5))[0] for g in flood] == ["cancelled"] * 4
        other = svc.submit(_job("b0", "b"))
        rt.release.set()
        assert (await _finish(running))[0] == "done"
        assert (await _finish(other))[2] == "You said: b0"

    _run(rt, svc, scenario)
    assert [c["messages"][-1]["content"] for c in rt.calls] == ["WAIT", "b0"]
    assert _sample(metrics.render(), "request_cancellations_total", stage="queued") == 4


def test_over_http_clients_that_leave_the_queue_free_it_before_the_model_is_free() -> None:
    rt = FakeRuntime()
    rt.wait_s = 120  # WAIT outlasts the check below: the slots must come back before it ends
    with serving(rt, ServerConfig(max_waiting=2)) as srv:
        url = f"{srv.base_url}/chat/completions"
        blocker = _occupy(rt, url)

        def leave(text: str) -> None:
            with pytest.raises(httpx.ReadTimeout):  # queued behind WAIT, the client gives up
                httpx.post(url, json=_body(text), timeout=httpx.Timeout(30, read=0.3))

        leavers = [threading.Thread(target=leave, args=(f"left{i}",)) for i in range(2)]
        for t in leavers:
            t.start()
        for t in leavers:
            t.join()
        # (On a loaded machine the event loop may take a moment to read the closed sockets.)
        _wait_for(lambda: httpx.get(f"{srv.root}/health").json()["waiting"] == 0,
                  "the departed clients' slots were not given back while WAIT ran", 60)
        assert blocker.is_alive() and len(rt.calls) == 1  # the model is still busy
        answer: list[httpx.Response] = []
        late = threading.Thread(target=lambda: answer.append(httpx.post(
            url, json=_body("late"), timeout=30)))
        late.start()
        _wait_for(lambda: httpx.get(f"{srv.root}/health").json()["waiting"] == 1,
                  "the late request was not queued")
        rt.release.set()
        blocker.join()
        late.join()
        metrics = httpx.get(f"{srv.root}/metrics").text
    assert answer[0].status_code == 200, answer[0].text
    assert [c["messages"][-1]["content"] for c in rt.calls] == ["WAIT", "late"]
    assert 'request_cancellations_total{model_name="fake-model",stage="queued"} 2.0' in metrics


def test_a_cancel_while_the_runtime_prefills_stops_it_and_stores_nothing(
        tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "sessions.sqlite3")
    rt, metrics = FakeRuntime(store), Metrics("m")
    svc = ChatService(rt.stream_turn, ServerConfig(), metrics)

    async def scenario() -> str:
        gen = svc.submit(_job("PREFILL", "a"))
        await _running(rt)
        gen.cancel()  # the client leaves before the first delta exists
        return (await _finish(gen))[0]

    assert _run(rt, svc, scenario) == "cancelled"
    assert store.list_sessions() == []
    assert _sample(metrics.render(), "request_cancellations_total", stage="running") == 1


# -- time limits ---------------------------------------------------------------------------


def test_a_request_that_waited_past_max_queue_wait_gets_a_503_without_running() -> None:
    rt = FakeRuntime()
    with serving(rt, ServerConfig(max_queue_wait_s=0.2)) as srv:
        url = f"{srv.base_url}/chat/completions"
        blocker = _occupy(rt, url)
        answer: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: answer.append(httpx.post(
            url, json=_body("too late"), timeout=30)))
        waiter.start()
        _wait_for(lambda: httpx.get(f"{srv.root}/health").json()["waiting"] == 1, "not queued")
        time.sleep(0.4)  # past max_queue_wait_s while the model is busy
        rt.release.set()
        blocker.join()
        waiter.join()
        metrics = httpx.get(f"{srv.root}/metrics").text
    assert answer[0].status_code == 503, answer[0].text
    assert answer[0].json()["error"]["code"] == "queue_timeout"
    assert answer[0].headers["retry-after"].isdigit()
    assert [c["messages"][-1]["content"] for c in rt.calls] == ["WAIT"]
    assert 'queue_rejections_total{model_name="fake-model",reason="queue_timeout"} 1.0' \
        in metrics


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_past_its_deadline_ends_with_length_and_is_not_stored(
        tmp_path: Path, stream: bool) -> None:
    store = SessionStore(tmp_path / "sessions.sqlite3")
    rt = FakeRuntime(store)
    rt.delay = 0.05  # 3 characters per 50 ms: the 70-character reply would take 1.2 s
    client = TestClient(create_app(rt, ServerConfig(max_generation_s=0.2)), client=LOCAL)
    full = "You said: " + "x" * 60
    resp = client.post("/v1/chat/completions", headers={"X-Session-Id": "slow"},
                       json=_body("x" * 60, stream=stream,
                                  **({"stream_options": {"include_usage": True}}
                                     if stream else {})))
    assert resp.status_code == 200, resp.text
    if stream:
        chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]
        content = "".join(c["choices"][0]["delta"].get("content") or ""
                          for c in chunks if c["choices"])
        finish = [c["choices"][0]["finish_reason"] for c in chunks
                  if c["choices"] and c["choices"][0]["finish_reason"]]
        usage = chunks[-1]["usage"]
    else:
        choice = resp.json()["choices"][0]
        content, finish, usage = choice["message"]["content"], [choice["finish_reason"]], \
            resp.json()["usage"]
    assert finish == ["length"]
    assert content and full.startswith(content) and len(content) < len(full)
    assert usage["completion_tokens"] == len(content)  # the fake's one token per character
    assert store.list_sessions() == []  # cut short like any generation closed early
    metrics = client.get("/metrics").text
    assert 'generation_deadline_stops_total{model_name="fake-model"} 1.0' in metrics
    assert 'request_success_total{finished_reason="length",model_name="fake-model"} 1.0' \
        in metrics


# -- the prefill and decode checks, on the tiny model -----------------------------------------


def test_a_cancel_during_a_chunked_prefill_raises_before_the_prefill_ends(
        tiny_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentspec.errors import Cancelled
    from agentspec.targets import hf

    monkeypatch.setattr(hf, "PREFILL_CHUNK", 16)
    target = HFTarget(tiny_model, None, "tiny-llama", "float32", "cpu",
                      PrefixCache(budget_bytes=50_000_000, block_size=8))
    plain = HFTarget(tiny_model, None, "tiny-llama", "float32", "cpu")
    rng = random.Random(7)
    first = [rng.randrange(2, 96) for _ in range(120)]
    target.prefill(first, scope="t")
    prompt = first + [rng.randrange(2, 96) for _ in range(75)]  # 75 new: 5 chunks after reuse
    cancel, calls = threading.Event(), []
    forward = target.kv.forward

    def counting(tokens: Any, last_only: bool = False, **kw: Any) -> torch.Tensor:
        calls.append(len(tokens))
        if len(calls) == 2:
            cancel.set()  # the client leaves while the second chunk is fed
        return forward(tokens, last_only, **kw)

    monkeypatch.setattr(target.kv, "forward", counting)
    with pytest.raises(Cancelled):
        target.prefill(prompt, scope="t", cancel=cancel)
    assert calls == [16, 16] and target.num_cached == 152  # 3 of 5 chunks never ran
    # A cold prefill is one forward: a cancel already set stops it before it starts.
    with pytest.raises(Cancelled):
        target.prefill(prompt, cancel=cancel)
    assert calls == [16, 16]
    # The target is consistent afterwards: the next request gets the exact logits.
    monkeypatch.setattr(target.kv, "forward", forward)
    got = target.prefill(prompt, scope="t")
    torch.testing.assert_close(got, plain.prefill(prompt), atol=1e-5, rtol=1e-5)


def test_the_engine_checks_cancel_between_decode_steps(tiny_target: HFTarget,
                                                       char_decode: Any) -> None:
    from agentspec.engine import SpeculativeDecoder
    from agentspec.errors import Cancelled

    cancel = threading.Event()
    stream = SpeculativeDecoder(tiny_target, None, decode=char_decode).stream(
        [11, 12, 13], 40, cancel=cancel)
    assert next(stream)  # decoding runs
    cancel.set()
    with pytest.raises(Cancelled):
        next(stream)


def test_the_runtime_hands_cancel_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from test_tool_formats import FAMILIES, TEMPLATES, byte_tokenizer

    from agentspec.errors import Cancelled
    from agentspec.runtime import Runtime

    template, eos, special, added = FAMILIES["hermes"]
    tok = byte_tokenizer((TEMPLATES / template).read_text(), eos, special, added)
    rt = Runtime(SimpleNamespace(tokenizer=tok, lock=threading.RLock()))  # type: ignore[arg-type]
    seen: dict[str, Any] = {}

    class Engine:
        def stream(self, *_: Any, **kwargs: Any) -> Any:
            seen.update(kwargs)
            raise Cancelled("cancelled")
            yield  # a generator, as the engine's

    monkeypatch.setattr(rt, "engine_for", lambda spec: Engine())
    cancel = threading.Event()
    with pytest.raises(Cancelled):
        list(rt.stream_chat([{"role": "user", "content": "hi"}], cancel=cancel))
    assert seen["cancel"] is cancel


# -- metrics and configuration -------------------------------------------------------------


def test_queue_metrics_are_exposed_from_the_start() -> None:
    text = Metrics("m").render()
    for reason in ("global_full", "tenant_share", "queue_timeout", "shutdown"):
        assert _sample(text, "queue_rejections_total", reason=reason) == 0
    for stage in ("queued", "running"):
        assert _sample(text, "request_cancellations_total", stage=stage) == 0
    assert _sample(text, "generation_deadline_stops_total") == 0


def test_queue_bounds_config_and_flags() -> None:
    import argparse

    from adapters.openai_server import cli
    from agentspec.errors import ConfigError

    assert ServerConfig(keys=KEYS).tenant_share == 64  # a quarter of 256
    assert ServerConfig(keys=KEYS, max_waiting=3).tenant_share == 1
    assert ServerConfig().tenant_share == 256  # local-only: one tenant, the whole queue
    assert ServerConfig(keys=KEYS, max_waiting_per_tenant=5).tenant_share == 5
    for bad, field in (({"max_waiting_per_tenant": 0}, "max_waiting_per_tenant"),
                       ({"max_waiting": 4, "max_waiting_per_tenant": 5}, "max_waiting_per"),
                       ({"max_queue_wait_s": 0}, "max_queue_wait_s"),
                       ({"max_queue_wait_s": float("nan")}, "max_queue_wait_s"),
                       ({"max_generation_s": -1.0}, "max_generation_s")):
        with pytest.raises(ConfigError, match=field):
            ServerConfig(**bad)
    parser = argparse.ArgumentParser()
    cli.add_serve_parser(parser.add_subparsers(dest="command"))
    config = cli.build_config(parser.parse_args([
        "serve", "--max-waiting-per-tenant", "3", "--max-queue-wait-s", "12.5",
        "--max-generation-s", "0"]))
    assert (config.max_waiting_per_tenant, config.max_queue_wait_s,
            config.max_generation_s) == (3, 12.5, 0.0)
    defaults = cli.build_config(parser.parse_args(["serve"]))
    assert (defaults.max_waiting_per_tenant, defaults.max_queue_wait_s,
            defaults.max_generation_s) == (None, 300.0, 600.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-queue-wait-s", "0"])
