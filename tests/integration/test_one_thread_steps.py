"""A loaded machine runs one-row steps with one thread (agentspec.targets.cost.live_cost): on the
shipped models a one-row forward's logits are the same bits with one thread or all, at short
and long contexts, so plain decoding, the reference of every lossless guarantee, does not
change; and a plain decode with every step forced to one thread says what greedy says."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.targets.cost.live_cost import LiveCost
from agentspec.targets.hf import HFTarget

pytestmark = pytest.mark.integration


def _same_bits(target: HFTarget, contexts: tuple[int, ...]) -> None:
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(5)
    try:
        for context in contexts:
            target.prefill(torch.randint(0, target.vocab_size, (context,), generator=gen).tolist())
            for tok in torch.randint(0, target.vocab_size, (3,), generator=gen).tolist():
                got = []
                for t in (threads, 1):
                    torch.set_num_threads(t)
                    got.append(target.score([tok]).clone())  # [1, vocab]
                    target.rollback(1)
                assert torch.equal(got[0], got[1]), (target.name, context)
                target.score([tok])
    finally:
        torch.set_num_threads(threads)


def test_embedded_model_one_row_bits_do_not_depend_on_threads(embedded_target: HFTarget) -> None:
    _same_bits(embedded_target, (9, 700, 3000))


@pytest.mark.slow
def test_qwen_one_row_bits_do_not_depend_on_threads(qwen_runtime: Runtime) -> None:
    _same_bits(qwen_runtime.target, (9, 2500))


def test_plain_decoding_on_one_thread_says_what_greedy_says(embedded_target: HFTarget,
                                                            monkeypatch: Any) -> None:
    if torch.get_num_threads() < 2:
        pytest.skip("a one-thread process has no other thread count to compare")
    rt = Runtime(embedded_target)
    messages = [{"role": "user", "content": "List three uses of a hash map, briefly."}]
    plain = AgentSpec(drafting=DraftingPolicy(method="none"))
    want = rt.chat(messages, spec=plain, max_tokens=40).tokens
    seen: list[int] = []

    def one_thread(self: LiveCost, k: int, context: int) -> int:
        seen.append(k)
        return 1

    monkeypatch.setattr(LiveCost, "threads_for", one_thread)
    got = rt.chat(messages, spec=plain, max_tokens=40).tokens
    assert got == want and seen and set(seen) == {1}
