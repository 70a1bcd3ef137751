"""Prompt lookup and oracle drafters, the greedy verifier, and the shared dataclasses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentspec.drafters import OracleDrafter, PromptLookupConfig, PromptLookupDrafter
from agentspec.drafters.lookup import find_ngram_continuation
from agentspec.errors import ConfigError, DraftError
from agentspec.types import Draft, DraftContext, SamplingParams, SessionRef, VerifyResult
from agentspec.verifiers.greedy import GreedyVerifier, greedy_accept_len


def test_prompt_lookup_copies_after_latest_match() -> None:
    ctx = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    toks, n = find_ngram_continuation(np.array(ctx), 3, 1, 4)
    assert n == 3
    assert toks == [7, 8, 6, 1]  # the latest earlier occurrence of [1, 2, 3] wins


def test_prompt_lookup_falls_back_to_shorter_ngrams_and_nothing() -> None:
    toks, n = find_ngram_continuation(np.array([5, 6, 7, 8, 6]), 3, 1, 3)
    assert (toks, n) == ([7, 8, 6], 1)
    assert find_ngram_continuation(np.array([1, 2, 3]), 3, 1, 3) == ([], 0)
    d = PromptLookupDrafter().propose(DraftContext([1, 2, 1], 3), max_tokens=2)
    assert d.tokens == [2, 1] and d.source == "prompt_lookup"
    with pytest.raises(ConfigError, match="min_ngram"):
        PromptLookupConfig(max_ngram=1, min_ngram=2)


def test_oracle_drafts_reference_until_divergence() -> None:
    oracle = OracleDrafter()
    oracle.add([1, 2], [10, 11, 12, 13])
    assert oracle.propose(DraftContext([1, 2, 10], 2), 2).tokens == [11, 12]
    assert oracle.propose(DraftContext([1, 2, 99], 2), 2).tokens == []
    assert oracle.propose(DraftContext([5, 5], 2), 2).tokens == []


def test_greedy_verifier_accepts_matching_prefix_plus_one() -> None:
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([3, 4, 8, 6]):
        logits[row, tok] = 5.0
    res = GreedyVerifier().verify(Draft([3, 4, 5]), logits, SamplingParams())
    assert res.tokens == [3, 4, 8] and res.num_accepted == 2
    full = GreedyVerifier().verify(Draft([3, 4, 8]), logits, SamplingParams())
    assert full.tokens == [3, 4, 8, 6] and full.num_accepted == 3
    empty = GreedyVerifier().verify(Draft([]), logits[:1], SamplingParams())
    assert empty.tokens == [3]
    assert greedy_accept_len(torch.tensor([1, 2, 3]), torch.tensor([1, 9, 3, 0])) == 1
    with pytest.raises(ConfigError, match="temperature"):
        GreedyVerifier().verify(Draft([3]), logits[:2], SamplingParams(temperature=0.7))
    with pytest.raises(ConfigError, match="logit rows"):
        GreedyVerifier().verify(Draft([3]), logits, SamplingParams())


def test_dataclass_validation_names_the_bad_value() -> None:
    with pytest.raises(DraftError, match="parent"):
        Draft([1, 2], parents=[-1, 5])
    with pytest.raises(DraftError, match="2 tokens but 1 parents"):
        Draft([1, 2], parents=[-1])
    assert Draft([1, 2, 3], parents=[-1, 0, 0]).is_tree
    assert not Draft([1, 2], parents=[-1, 0]).is_tree
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError, match="invalid session id"):
        SessionRef("bad id!")
    with pytest.raises(ConfigError, match="invalid tenant id"):
        SessionRef("ok", tenant="")
    assert isinstance(ConfigError("x"), ValueError)
    assert VerifyResult([1], 0).exceptions == 0
