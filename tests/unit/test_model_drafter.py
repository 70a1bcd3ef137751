"""The model drafter: greedy and sampled drafts, KV-cache reuse and cropping, K i.i.d.
drafts in one batched pass, and the target's batched scoring for multi-draft decoding."""

from __future__ import annotations

import pytest
import torch

from agentspec.drafters.model.causal import ModelDrafter, ModelDrafterConfig
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError
from agentspec.multi_engine import MultiDraftDecoder
from agentspec.sampling import process_logits
from agentspec.types import DraftContext, SamplingParams
from agentspec.verifiers import BlockVerifier
from tests.conftest import TINY_VOCAB, noisy_copy
from tests.unit.test_engine_lossless import hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def draft_model(tiny_model):  # type: ignore[no-untyped-def]
    """The tiny model with noisy weights: a drafter that is right most of the time."""
    return noisy_copy(tiny_model, seed=3)


def _next_dist(model: torch.nn.Module, tokens: list[int], sp: SamplingParams) -> torch.Tensor:
    with torch.inference_mode():
        return process_logits(model(torch.tensor([tokens])).logits[0, -1], sp)


def test_greedy_drafts_are_the_drafters_greedy_continuation(draft_model) -> None:  # type: ignore[no-untyped-def]
    drafter = ModelDrafter(draft_model, ModelDrafterConfig(max_tokens=6))
    ctx = [7, 3, 9, 11]
    draft = drafter.propose(DraftContext(ctx, len(ctx)), 6)
    assert draft.tokens == hf_greedy(draft_model, ctx, 6, None)
    assert draft.probs is None and draft.source == "model"
    assert drafter.forwards == 6  # the context once, then one forward per further token


def test_cache_is_reused_and_cropped_on_rejection(draft_model) -> None:  # type: ignore[no-untyped-def]
    drafter = ModelDrafter(draft_model, ModelDrafterConfig(max_tokens=5))
    ctx = [5, 6, 7, 8, 9]
    first = drafter.propose(DraftContext(ctx, 3), 5)
    # The verifier accepted 2 tokens and chose its own third: the rest is cropped.
    ctx2 = [*ctx, *first.tokens[:2], (first.tokens[2] + 1) % TINY_VOCAB]
    before = drafter.forwards
    second = drafter.propose(DraftContext(ctx2, 3, step=1), 5)
    assert drafter.forwards - before == 5  # the new tokens in one forward, then 4 steps
    assert second.tokens == hf_greedy(draft_model, ctx2, 5, None)
    # A context that shares nothing (a new request) starts over.
    third = drafter.propose(DraftContext([40, 41], 2), 3)
    assert third.tokens == hf_greedy(draft_model, [40, 41], 3, None)


def test_sampled_drafts_carry_their_distributions(draft_model) -> None:  # type: ignore[no-untyped-def]
    sp = SamplingParams(temperature=0.8, top_k=5)
    drafter = ModelDrafter(draft_model, ModelDrafterConfig(max_tokens=4, temperature=0.8, top_k=5))
    ctx = [12, 13, 14]
    drafter.begin_request(None, torch.Generator().manual_seed(0))
    draft = drafter.propose(DraftContext(ctx, 3), 4)
    assert draft.probs is not None and tuple(draft.probs.shape) == (4, TINY_VOCAB)
    for i, tok in enumerate(draft.tokens):
        want = _next_dist(draft_model, ctx + draft.tokens[:i], sp)
        assert torch.allclose(draft.probs[i], want, atol=1e-5)
        assert draft.probs[i, tok] > 0
    drafter.begin_request(None, torch.Generator().manual_seed(0))  # same seed, same draft
    assert drafter.propose(DraftContext(ctx, 3), 4).tokens == draft.tokens


def test_propose_many_draws_iid_drafts_and_restores_the_cache(draft_model) -> None:  # type: ignore[no-untyped-def]
    cfg = ModelDrafterConfig(max_tokens=3, temperature=1.0)
    drafter = ModelDrafter(draft_model, cfg)
    ctx = [20, 21, 22]
    gen = torch.Generator().manual_seed(1)
    drafts = drafter.propose_many(DraftContext(ctx, 3), 3, 4, gen)
    assert len(drafts) == 4 and all(len(d.tokens) == 3 for d in drafts)
    for d in drafts:
        assert d.probs is not None
        assert torch.allclose(d.probs[1], _next_dist(draft_model, ctx + d.tokens[:1],
                                                     cfg.sampling()), atol=1e-5)
    # 4000 one-token drafts in one batched pass follow the drafter's distribution.
    firsts = torch.tensor([d.tokens[0] for d in drafter.propose_many(
        DraftContext(ctx, 3), 1, 4000, gen)])
    freq = torch.bincount(firsts, minlength=TINY_VOCAB).double() / 4000
    assert (freq - _next_dist(draft_model, ctx, cfg.sampling()).double()).abs().max() < 0.03
    # The cache holds the context only again: a greedy drafter sharing it agrees.
    drafter.config = ModelDrafterConfig(max_tokens=3)
    assert drafter.propose(DraftContext(ctx, 3), 3).tokens == hf_greedy(draft_model, ctx, 3, None)
    with pytest.raises(ConfigError, match="sampling drafter"):
        drafter.propose_many(DraftContext(ctx, 3), 3, 2, gen)


def test_greedy_engine_with_model_drafter_is_lossless(tiny_model, tiny_target, draft_model) -> None:  # type: ignore[no-untyped-def]
    prompt = [9, 8, 7, 6]
    expected = hf_greedy(tiny_model, prompt, 40, None)
    for model, min_accept in ((draft_model, 1.0), (tiny_model, 4.5)):
        drafter = ModelDrafter(model, ModelDrafterConfig(max_tokens=4))
        engine = SpeculativeDecoder(tiny_target, drafter, config=EngineConfig(max_draft=4))
        got = engine.generate(prompt, max_tokens=40)
        assert got.tokens == expected
        assert got.stats.mean_accepted_len >= min_accept  # the target itself: all accepted


def test_score_batch_matches_single_row_scoring(tiny_target) -> None:  # type: ignore[no-untyped-def]
    prefix, rows = [3, 4, 5, 6], [[7, 8, 9], [7, 10, 11], [12, 13, 14]]
    tiny_target.prefill(prefix)
    batched = tiny_target.score_batch(rows)  # [3, 3, V]
    tiny_target.select_row(1)
    tiny_target.rollback(1)  # keep 7, 10 of row 1
    after = tiny_target.score([15])
    for j, row in enumerate(rows):
        tiny_target.prefill(prefix)
        assert torch.allclose(batched[j], tiny_target.score(row), atol=1e-5)
    tiny_target.prefill(prefix)
    assert torch.allclose(after, tiny_target.score([7, 10, 15])[-1:], atol=1e-5)


def test_multi_draft_decoder_with_a_perfect_drafter_is_greedy(tiny_model, tiny_target) -> None:  # type: ignore[no-untyped-def]
    prompt = [30, 31, 32]
    drafter = ModelDrafter(tiny_model, ModelDrafterConfig(max_tokens=4, temperature=1.0))
    engine = MultiDraftDecoder(tiny_target, drafter, num_drafts=3,
                               config=EngineConfig(max_draft=4))
    got = engine.generate(prompt, max_tokens=30)  # a greedy request: exact
    assert got.tokens == hf_greedy(tiny_model, prompt, 30, None)
    sp = SamplingParams(temperature=1.0, seed=4)
    sampled = engine.generate(prompt, max_tokens=30, sampling=sp)
    # q = p: every block is accepted whole, so each forward commits k + 1 tokens.
    assert sampled.stats.mean_accepted_len > 4.0
    single = SpeculativeDecoder(tiny_target, ModelDrafter(tiny_model, drafter.config),
                                BlockVerifier(), config=EngineConfig(max_draft=4))
    assert single.generate(prompt, 30, sampling=sp).stats.mean_accepted_len > 4.0
