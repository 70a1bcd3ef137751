"""Prefix KV reuse on the embedded model: multi-turn chats through the Runtime reuse the
session's history and a tenant's shared system prompt, with output token-identical to the
same requests fed from scratch (fp32)."""

from __future__ import annotations

import pytest

from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.targets.cache.prefix_cache import PrefixCache
from agentspec.targets.hf import HFTarget
from agentspec.types import SessionRef

pytestmark = pytest.mark.integration

SYSTEM = ("You are a shell agent. Answer with one command in a ```bash block. Tools: ls, cat, "
          "grep, sed, python. Always explain the command in one short sentence first.")
USERS = ["List the files in the repository.", "Show the README.",
         "Find where the function parse_config is defined."]


@pytest.fixture(scope="module")
def runtimes(embedded_target: HFTarget) -> tuple[Runtime, Runtime, PrefixCache]:
    """Two runtimes on the one loaded model: prefix reuse on (a small store of its own)
    and off (a target without a store)."""
    m, tok = embedded_target.model, embedded_target.tokenizer
    store = PrefixCache(budget_bytes=64 << 20)
    on = HFTarget(m, tok, embedded_target.name, "float32", embedded_target.device, store)
    off = HFTarget(m, tok, embedded_target.name, "float32", embedded_target.device)
    return Runtime(on, store=None), Runtime(off, store=None), store


def _conversation(rt: Runtime, ref: SessionRef, users: list[str], spec: AgentSpec
                  ) -> tuple[list[list[int]], list[int], list[int]]:
    messages = [{"role": "system", "content": SYSTEM}]
    outs, cached, prompts = [], [], []
    for user in users:
        messages.append({"role": "user", "content": user})
        res = rt.chat(messages, session=ref, spec=spec, max_tokens=24)
        outs.append(res.tokens)
        cached.append(res.stats.cached_prompt_tokens)
        prompts.append(res.prompt_tokens)
        messages.append({"role": "assistant", "content": res.text})
    return outs, cached, prompts


@pytest.mark.parametrize("method", ["none", "suffix"])
def test_multi_turn_sessions_reuse_history_with_identical_output(
    runtimes: tuple[Runtime, Runtime, PrefixCache], method: str
) -> None:
    on, off, store = runtimes
    spec = AgentSpec(drafting=DraftingPolicy(method=method))
    for i in range(2):  # two sessions of one tenant: the second reuses the system prompt
        ref = SessionRef(f"{method}-{i}", tenant=f"acme-{method}")
        users = USERS if i == 0 else [f"Count the lines of file {i}.py.", *USERS[1:]]
        got, cached, prompts = _conversation(on, ref, users, spec)
        want, none, _ = _conversation(off, ref, users, spec)
        assert got == want
        assert none == [0, 0, 0]
        if i == 1:
            assert cached[0] >= 16  # the shared system prompt, from another session
        # Later turns reuse at least the previous prompt (the answer is re-rendered from
        # text, so it may re-tokenize differently after its first tokens).
        for t in range(1, 3):
            assert prompts[t - 1] - 1 <= cached[t] < prompts[t]
    assert store.bytes_used <= store.budget_bytes


def test_changed_earlier_message_and_other_tenant(
    runtimes: tuple[Runtime, Runtime, PrefixCache]
) -> None:
    on, off, _ = runtimes
    spec = AgentSpec(drafting=DraftingPolicy(method="suffix"))
    ref = SessionRef("edit", tenant="edit-tenant")
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USERS[0]}]
    on.chat(msgs, session=ref, spec=spec, max_tokens=8)
    edited = [{"role": "system", "content": SYSTEM.replace("one short", "a single")},
              {"role": "user", "content": USERS[0]}]
    got = on.chat(edited, session=ref, spec=spec, max_tokens=24)
    a, b = on.prompt_ids(msgs)[0], on.prompt_ids(edited)[0]
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert got.stats.cached_prompt_tokens == shared > 0  # up to the edit, not beyond
    assert got.tokens == off.chat(edited, session=ref, spec=spec, max_tokens=24).tokens
    # Another tenant sends the same prompt: nothing of edit-tenant's KV is reused.
    other = on.chat(edited, session=SessionRef("x", tenant="other"), spec=spec, max_tokens=4)
    assert other.stats.cached_prompt_tokens == 0


def test_langchain_usage_reports_cache_reads(
    runtimes: tuple[Runtime, Runtime, PrefixCache]
) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    from adapters.langchain import ChatAgentSpec

    on, _, _ = runtimes
    llm = ChatAgentSpec(runtime=on, store=False, session_id="lc-1", tenant="lc-tenant",
                        max_tokens=16)
    history = [SystemMessage(SYSTEM), HumanMessage(USERS[0])]
    first = llm.invoke(history)
    assert first.usage_metadata is not None
    assert first.usage_metadata["input_token_details"] == {"cache_read": 0}
    second = llm.invoke([*history, AIMessage(first.content), HumanMessage(USERS[1])])
    assert second.usage_metadata is not None
    read = second.usage_metadata["input_token_details"]["cache_read"]
    assert first.usage_metadata["input_tokens"] - 1 <= read < second.usage_metadata["input_tokens"]


def test_random_prompts_with_eviction_mid_session(embedded_target: HFTarget) -> None:
    """Random-token sessions, two interleaved, in a store far smaller than they are: blocks
    are evicted mid-session, the budget holds after every request, output is unchanged."""
    import random

    from agentspec.engine import SpeculativeDecoder
    from agentspec.factory import build_drafter, build_engine

    m, tok = embedded_target.model, embedded_target.tokenizer
    # SmolLM2-135M fp32 per stored token: layers x (k, v) x heads x dims of KV, plus the
    # block's final-norm feature row (hidden size 576). 300 tokens hold 18 blocks: less than
    # two sessions (10-17 blocks each), more than one, so a session's later turn finds its
    # root blocks while the other session's inserts evict its leaves.
    per_token = 30 * 2 * 3 * 64 * 4 + 576 * 4
    store = PrefixCache(budget_bytes=300 * per_token, block_size=16)
    on = HFTarget(m, tok, embedded_target.name, "float32", embedded_target.device, store)
    off = HFTarget(m, tok, embedded_target.name, "float32", embedded_target.device)
    spec = AgentSpec(drafting=DraftingPolicy(method="prompt_lookup"))

    def engine(target: HFTarget) -> SpeculativeDecoder:
        return build_engine(spec, target, build_drafter(spec, target), eos_token_ids=[2])

    a, b = engine(on), engine(off)
    rng = random.Random(7)
    histories = [[rng.randrange(100, 40000) for _ in range(120)] for _ in range(2)]
    refs = [SessionRef(f"rand-{i}", tenant="rand") for i in range(2)]
    for _turn in range(3):
        for i in range(2):
            histories[i] += [rng.randrange(100, 40000) for _ in range(rng.randrange(10, 60))]
            got = a.generate(histories[i], max_tokens=8, session=refs[i])
            want = b.generate(histories[i], max_tokens=8, session=refs[i])
            assert got.tokens == want.tokens
            assert store.bytes_used <= store.budget_bytes
            histories[i] += got.tokens
    assert store.stats.evicted_blocks > 0 and store.stats.hit_tokens > 0
