"""The draft model run as a target (HVD's model drafter for a larger model of its family):
greedy drafts, rollback of rejected tails, the tenant's prefix reuse across requests, a
lossless engine, and the factory's choice of draft model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from agentspec.drafters.model.causal import ModelDrafterConfig
from agentspec.drafters.model.target_drafter import TargetDrafter
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError
from agentspec.factory import draft_model_name
from agentspec.models import AGENT_MODEL, LOOP_MODEL, SHIPPED_MODELS
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.targets.cache.prefix_cache import PrefixCache
from agentspec.targets.hf import HFTarget
from agentspec.types import DraftContext, SessionRef
from tests.conftest import TINY_VOCAB, noisy_copy
from tests.unit.test_engine_lossless import hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def draft_model(tiny_model):  # type: ignore[no-untyped-def]
    """The tiny model with noisy weights: a draft model right most of the time."""
    return noisy_copy(tiny_model, seed=3)


def _drafter(model: torch.nn.Module, max_tokens: int = 6,
             store: PrefixCache | None = None) -> TargetDrafter:
    draft = HFTarget(model, None, "tiny-draft", "float32", "cpu", store)
    return TargetDrafter(draft, ModelDrafterConfig(max_tokens=max_tokens),
                         vocab_size=TINY_VOCAB)


def test_greedy_drafts_are_the_draft_models_greedy_continuation(draft_model) -> None:  # type: ignore[no-untyped-def]
    drafter = _drafter(draft_model)
    ctx = [7, 3, 9, 11]
    draft = drafter.propose(DraftContext(ctx, len(ctx)), 6)
    assert draft.tokens == hf_greedy(draft_model, ctx, 6, None)
    assert draft.probs is None and draft.source == "model:tiny-draft"
    assert drafter.forwards == 6  # the context once, then one forward per further token


def test_a_rejected_tail_is_rolled_back_and_only_new_tokens_fed(draft_model) -> None:  # type: ignore[no-untyped-def]
    drafter = _drafter(draft_model, max_tokens=5)
    ctx = [5, 6, 7, 8, 9]
    first = drafter.propose(DraftContext(ctx, 3), 5)
    # The verifier accepted 2 tokens and chose its own third: the other two go.
    ctx2 = [*ctx, *first.tokens[:2], (first.tokens[2] + 1) % TINY_VOCAB]
    before = drafter.forwards
    second = drafter.propose(DraftContext(ctx2, 3, step=1), 5)
    assert drafter.forwards - before == 5  # the new token in one forward, then 4 steps
    assert drafter.draft.num_cached == len(ctx2) + 4
    assert second.tokens == hf_greedy(draft_model, ctx2, 5, None)
    third = drafter.propose(DraftContext([40, 41], 2), 3)  # shares nothing: a prefill
    assert third.tokens == hf_greedy(draft_model, [40, 41], 3, None)


def test_a_later_turn_reuses_the_tenants_prefix_after_another_tenant(draft_model) -> None:  # type: ignore[no-untyped-def]
    drafter = _drafter(draft_model, max_tokens=4, store=PrefixCache(10**7, block_size=4))
    gen = torch.Generator().manual_seed(11)
    turn1 = torch.randint(2, TINY_VOCAB, (40,), generator=gen).tolist()
    other = torch.randint(2, TINY_VOCAB, (30,), generator=gen).tolist()
    alice, bob = SessionRef("s1", tenant="alice"), SessionRef("s2", tenant="bob")
    drafter.propose(DraftContext(turn1, 40, session=alice), 4)
    drafter.propose(DraftContext(other, 30, session=bob), 4)
    turn2 = [*turn1, 3, 4, 5, 6, 7, 8]  # the conversation goes on: its next turn
    draft = drafter.propose(DraftContext(turn2, len(turn2), session=alice), 4)
    assert drafter.draft.reused_tokens >= 36  # the earlier turn's blocks, not re-read
    assert draft.tokens == hf_greedy(draft_model, turn2, 4, None)


def test_the_engine_with_a_target_drafter_is_lossless(tiny_model, tiny_target, draft_model) -> None:  # type: ignore[no-untyped-def]
    prompt = [9, 8, 7, 6]
    expected = hf_greedy(tiny_model, prompt, 40, None)
    for model, min_accept in ((draft_model, 1.0), (tiny_model, 4.5)):
        engine = SpeculativeDecoder(tiny_target, _drafter(model, max_tokens=4),
                                    config=EngineConfig(max_draft=4))
        got = engine.generate(prompt, max_tokens=40)
        assert got.tokens == expected
        assert got.stats.mean_accepted_len >= min_accept  # the target itself: all accepted


def test_multi_draft_is_refused_with_a_reason(draft_model) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="one sequence at a time"):
        _drafter(draft_model).propose_many(DraftContext([1, 2], 2), 3, 2, torch.Generator())


def test_the_draft_model_is_the_policys_else_the_shipped_targets_own() -> None:
    named = AgentSpec(drafting=DraftingPolicy(method="hybrid", draft_model="/some/folder"))
    loop = SimpleNamespace(name=LOOP_MODEL)
    assert draft_model_name(named, loop) == "/some/folder"  # type: ignore[arg-type]
    hybrid = AgentSpec(drafting=DraftingPolicy(method="hybrid"))
    assert draft_model_name(hybrid, SimpleNamespace(name="tiny")) is None  # type: ignore[arg-type]
    if SHIPPED_MODELS[AGENT_MODEL].installed:
        assert draft_model_name(hybrid, loop) == AGENT_MODEL  # type: ignore[arg-type]
    else:
        with pytest.raises(ConfigError, match="make qwen"):
            draft_model_name(hybrid, loop)  # type: ignore[arg-type]


def test_warming_leaves_no_state_behind(draft_model) -> None:  # type: ignore[no-untyped-def]
    drafter = _drafter(draft_model)
    drafter.warm()
    ctx = [7, 3, 9, 11]
    assert drafter.propose(DraftContext(ctx, len(ctx)), 6).tokens == \
        hf_greedy(draft_model, ctx, 6, None)
    with pytest.raises(ConfigError, match="at least 4 tokens"):
        drafter.warm((1, 2))
