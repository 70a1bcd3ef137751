"""Tree drafts: branches verified in one batched forward, output token-identical to greedy."""

from __future__ import annotations

import random

import pytest
import torch

from agentspec.drafters import SuffixDrafter
from agentspec.drafters.session_cache import SuffixConfig
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError
from agentspec.types import Draft, DraftContext, SamplingParams, SessionRef, VerifyResult
from agentspec.verifiers import BudgetConfig, BudgetedVerifier
from agentspec.verifiers.tree import branch_rows, greedy_branch_accept
from tests.conftest import TINY_VOCAB
from tests.unit.test_engine_lossless import hf_greedy

EOS = 1


def test_branches_of_a_tree() -> None:
    #      0 - 1 - 2
    #       \- 3        4 (second root) - 5
    d = Draft([10, 11, 12, 13, 14, 15], parents=[-1, 0, 1, 0, -1, 4])
    assert d.is_tree
    assert d.branches() == [[0, 1, 2], [0, 3], [4, 5]]
    assert Draft([1, 2, 3]).branches() == [[0, 1, 2]]
    assert Draft().branches() == []
    rows, paths = branch_rows(d, pending=7, max_branches=2)
    assert rows == [[7, 10, 11, 12], [7, 10, 13, 13]]  # short branch padded
    assert paths == [[0, 1, 2], [0, 3]]
    with pytest.raises(ConfigError, match="max_branches"):
        branch_rows(d, 7, 0)


def test_greedy_branch_accept_picks_the_longest_confirmed_branch() -> None:
    rows = [[0, 5, 6, 7], [0, 5, 8, 9]]
    logits = torch.full((2, 4, 12), -1.0)
    for j, want in enumerate([[5, 6, 2, 3], [5, 8, 9, 4]]):  # target argmax per position
        for i, t in enumerate(want):
            logits[j, i, t] = 1.0
    # Row 0 accepts [5, 6] (then 7 != 2); row 1 accepts all three drafted tokens.
    assert greedy_branch_accept(rows, logits) == (1, 3, 4)


class TreeDrafter:
    """A tree whose branches are: a wrong branch, the greedy continuation cut at a random
    point then wrong, and random junk (the order shuffled)."""

    name = "tree"

    def __init__(self, ref: list[int], rng: random.Random) -> None:
        self.ref, self.rng = ref, rng

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        pos = len(ctx.generated)
        k = self.rng.randint(1, 6)
        right = self.ref[pos : pos + k]
        cut = self.rng.randint(0, len(right))
        branches = [
            [(t + 1) % TINY_VOCAB for t in right] or [3],
            right[:cut] + [(t + 2) % TINY_VOCAB for t in right[cut:]] or [4],
            [self.rng.randrange(TINY_VOCAB) for _ in range(self.rng.randint(1, 4))],
        ]
        self.rng.shuffle(branches)
        tokens: list[int] = []
        parents: list[int] = []
        for b in branches:  # independent branches, each a chain under the root
            for i, t in enumerate(b):
                parents.append(-1 if i == 0 else len(tokens) - 1)
                tokens.append(t)
        return Draft(tokens, parents, source=self.name)

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        pass

    def finish(self, ctx: DraftContext) -> None:
        pass


def test_tree_drafts_are_lossless(tiny_model, tiny_target) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(5)
    for trial in range(10):
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(1, 25))]
        max_new = rng.randint(1, 40)
        eos = EOS if trial % 2 == 0 else None
        expected = hf_greedy(tiny_model, prompt, max_new, eos)
        ref = hf_greedy(tiny_model, prompt, max_new + 20, None)
        engine = SpeculativeDecoder(
            tiny_target, TreeDrafter(ref, rng), eos_token_ids=[eos] if eos is not None else [],
            config=EngineConfig(max_draft=16, max_branches=rng.choice([1, 2, 3])),
        )
        got = engine.generate(prompt, max_tokens=max_new)
        assert got.tokens == expected, (trial, prompt, max_new)
        # A later plain request on the same target still decodes correctly (cache rows
        # collapsed back to one).
        assert SpeculativeDecoder(tiny_target).generate(prompt, 5).tokens == ref[:5]


def test_tree_drafts_refuse_sampling_and_asd(tiny_model, tiny_target) -> None:  # type: ignore[no-untyped-def]
    ref = hf_greedy(tiny_model, [4, 5, 6], 30, None)
    engine = SpeculativeDecoder(tiny_target, TreeDrafter(ref, random.Random(1)))
    with pytest.raises(ConfigError, match="strict greedy"):
        engine.generate([4, 5, 6], 10, sampling=SamplingParams(temperature=1.0, seed=0))
    asd = SpeculativeDecoder(
        tiny_target, TreeDrafter(ref, random.Random(1)), BudgetedVerifier(BudgetConfig(4.0))
    )
    with pytest.raises(ConfigError, match="strict greedy"):
        asd.generate([4, 5, 6], 10)


def test_suffix_tree_drafter_is_lossless(tiny_model, tiny_target) -> None:  # type: ignore[no-untyped-def]
    # A session that repeats itself: the history index offers several continuations.
    rng = random.Random(11)
    drafter = SuffixDrafter(SuffixConfig(tree=True, max_tokens=12))
    engine = SpeculativeDecoder(tiny_target, drafter, config=EngineConfig(max_draft=12))
    ref = SessionRef("s1", tenant="t")
    base = [rng.randrange(2, TINY_VOCAB) for _ in range(12)]
    trees = 0
    for turn in range(4):
        prompt = base + [rng.randrange(2, TINY_VOCAB) for _ in range(3)] + base[:6]
        got = engine.generate(prompt, max_tokens=30, session=ref)
        assert got.tokens == hf_greedy(tiny_model, prompt, 30, None), turn
        trees += sum(s.draft_len > s.accepted for s in got.stats.steps)
    assert trees > 0  # drafts were made (and some rejected): the path was exercised
