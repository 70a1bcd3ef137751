"""Hybrid Verified Decoding on the agent-grade model: the shipped EAGLE head and payoff
predictor of Qwen2.5-Coder-0.5B-Instruct load by name, and ``hybrid`` and ``model`` decode
through ``Runtime.chat`` token for token as greedy decoding does (fp32), in a fresh session
and on its later turn.

Qwen's decoding is several times slower than SmolLM2's on a CPU: answers are short (48 tokens).
"""

from __future__ import annotations

import pytest

from agentspec.drafters.hybrid import HybridDrafter
from agentspec.drafters.model.eagle import EagleDrafter
from agentspec.payoff.defaults import PACKAGED_PREDICTORS, predictor_path
from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.types import SessionRef

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci "
                                   "number, iteratively."}]
AGAIN = [*ASK, {"role": "assistant", "content": "Sure."},
         {"role": "user", "content": "Now the same function with a docstring."}]


def test_the_shipped_head_and_predictor_are_found_for_qwen(qwen_runtime: Runtime) -> None:
    target = qwen_runtime.target
    assert predictor_path(target).parent == PACKAGED_PREDICTORS
    hybrid = qwen_runtime.drafter_for(AgentSpec(drafting=DraftingPolicy(method="hybrid")))
    assert isinstance(hybrid, HybridDrafter)
    assert isinstance(hybrid.model, EagleDrafter)
    assert hybrid.model.head.spec.target_name == target.name


@pytest.mark.slow
@pytest.mark.parametrize(("method", "policy"), [("model", "cost_aware"), ("hybrid", "threshold"),
                                                ("hybrid", "cost_aware")])
def test_hvd_on_qwen_says_what_greedy_says(qwen_runtime: Runtime, method: str,
                                           policy: str) -> None:
    """Every source mix decodes what greedy decodes. ``model`` and the paper's threshold
    rule (the model drafts whenever the cache has nothing, or ŷ < τ) must put the head in
    the loop; the cost-aware policy picks by this machine's measured verify cost, so on a
    machine where a multi-token verify costs more than the head's drafts commit it may
    rightly never pick the head: there only its output is checked."""
    rt = qwen_runtime
    greedy = AgentSpec(drafting=DraftingPolicy(method="none"))
    spec = AgentSpec(drafting=DraftingPolicy(method=method, hvd_policy=policy))  # type: ignore[arg-type]
    session = SessionRef(f"qwen-hvd-{method}-{policy}")
    head_name = "eagle"  # the EAGLE drafter's source name on its steps
    for messages in (ASK, AGAIN):
        ref = rt.chat(messages, spec=greedy, max_tokens=48)
        out = rt.chat(messages, spec=spec, session=session, max_tokens=48)
        assert out.tokens == ref.tokens, (method, policy)
        sources = [s.source for s in out.stats.steps]
        assert set(sources) <= {"suffix", head_name, "none"}, sources
        if policy == "threshold" or method == "model":
            # The head drafted and some of its tokens were accepted: it is in the loop.
            head = [s for s in out.stats.steps if s.source == head_name]
            assert head and sum(s.accepted for s in head) > 0, sources
            assert out.stats.forwards < len(out.tokens)
