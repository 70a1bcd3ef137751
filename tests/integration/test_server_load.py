"""A bounded load test of the server on loopback: 8 concurrent clients x 20 requests.

Every client has its own session (half of them under a second tenant) and mixes plain and
streaming requests over a fixed set of prompts. The server queues the requests for the one
model; the test checks that none fails, that each response is complete and identical to a
sequential run of the same prompt (greedy decoding is deterministic and the verifier is
lossless, so concurrency, queueing and warm session caches must not change a single token),
and reports p50/p95 latency.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from server_harness import ServerThread, serving

from adapters.openai_server import ServerConfig
from adapters.openai_server.auth import KeyRing
from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec
from agentspec.storage.sessions import SessionStore

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLIENTS, REQUESTS, MAX_TOKENS = 8, 20, 16
KEYS = {"load-key-a": "tenant-a", "load-key-b": "tenant-b"}
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    'Repeat this JSON exactly: {"id": 7, "ok": true, "tags": ["a", "b"]}',
    "What is 12 times 12?",
    "Give one tip for writing clean Python code.",
    "Translate to French: good morning, my friend.",
    "List the days of the week.",
]


@pytest.fixture(scope="module")
def server(embedded_target: Any, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[ServerThread]:
    store = SessionStore(tmp_path_factory.mktemp("load-store") / "sessions.sqlite3")
    runtime = Runtime(embedded_target, store, AgentSpec())
    with serving(runtime, ServerConfig(keys=KeyRing.from_mapping(KEYS))) as srv:
        yield srv


def _ask(client: openai.OpenAI, model: str, prompt: str, stream: bool,
         ) -> tuple[str, str, int]:
    """(content, finish_reason, completion_tokens) of one request."""
    messages: Any = [{"role": "user", "content": prompt}]
    if not stream:
        out = client.chat.completions.create(model=model, messages=messages,
                                             max_tokens=MAX_TOKENS)
        assert out.usage is not None
        return (out.choices[0].message.content or "", str(out.choices[0].finish_reason),
                out.usage.completion_tokens)
    text, finish, tokens = [], "", -1
    for chunk in client.chat.completions.create(model=model, messages=messages,
                                                max_tokens=MAX_TOKENS, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(text), finish, tokens


def _counter(metrics: str, name: str) -> float:
    """The value of an unlabelled-but-for-model counter in a /metrics text."""
    line = next(x for x in metrics.splitlines() if x.startswith(f"agentspec:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def test_concurrent_clients_match_sequential_run(
    server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(httpx.get(f"{server.root}/health").json()["model"])

    def client_for(key: str, session: str | None = None) -> openai.OpenAI:
        headers = {"X-Session-Id": session} if session else None
        return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0,
                             timeout=600, default_headers=headers)

    # The reference: each prompt once, one request at a time, no session cache.
    seq = client_for("load-key-a")
    t0 = time.perf_counter()
    reference = {p: _ask(seq, model, p, stream=False) for p in PROMPTS}
    seq_s = time.perf_counter() - t0

    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def run_client(c: int) -> None:
        key = "load-key-a" if c % 2 == 0 else "load-key-b"
        client = client_for(key, f"load-session-{c}")
        for r in range(REQUESTS):
            prompt = PROMPTS[(c + r) % len(PROMPTS)]
            stream = r % 3 == 2  # a third of the requests stream
            t = time.perf_counter()
            try:
                got = _ask(client, model, prompt, stream)
            except Exception as exc:  # every failure is collected and reported below
                with lock:
                    failures.append(f"client {c} request {r}: {type(exc).__name__}: {exc}")
                continue
            elapsed = time.perf_counter() - t
            with lock:
                latencies.append(elapsed)
                if got != reference[prompt]:
                    failures.append(f"client {c} request {r} ({prompt!r}, stream={stream}): "
                                    f"{got!r} != {reference[prompt]!r}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(run_client, range(CLIENTS)))
    wall = time.perf_counter() - t0

    assert not failures, "\n".join(failures[:10])
    assert len(latencies) == CLIENTS * REQUESTS
    assert all(r[2] >= 1 and r[1] in ("stop", "length") for r in reference.values())
    health = httpx.get(f"{server.root}/health").json()
    assert health["waiting"] == 0 and health["running"] == 0
    metrics = httpx.get(f"{server.root}/metrics").text
    assert "agentspec:http_errors_total{" not in metrics
    p50, p95 = statistics.median(latencies), _percentile(latencies, 0.95)
    tokens, forwards = (_counter(metrics, name) for name in ("generation_tokens_total",
                                                              "target_forwards_total"))
    with capsys.disabled():
        print(f"\nserver load: {CLIENTS} clients x {REQUESTS} requests (max_tokens={MAX_TOKENS}) "
              f"in {wall:.1f}s = {CLIENTS * REQUESTS / wall:.2f} req/s; latency p50 {p50:.2f}s "
              f"p95 {p95:.2f}s max {max(latencies):.2f}s; sequential reference "
              f"{len(PROMPTS)} requests in {seq_s:.1f}s; {tokens / max(forwards, 1):.2f} "
              "tokens per target forward overall")
