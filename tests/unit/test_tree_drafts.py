"""Tree drafts: verified with tree attention (or one batch row per branch), output
token-identical to greedy."""

from __future__ import annotations

import random

import pytest
import torch

from agentspec.drafters import SuffixDrafter
from agentspec.drafters.suffix.drafter import SuffixConfig
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError
from agentspec.interfaces import BatchTarget, TreeTarget
from agentspec.types import Draft, DraftContext, SamplingParams, SessionRef, VerifyResult
from agentspec.verifiers import BudgetConfig, BudgetedVerifier, KeyedVerifier
from agentspec.verifiers.tree import (
    branch_rows,
    greedy_branch_accept,
    greedy_tree_accept,
    tree_rows,
)
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


def test_sampled_and_asd_requests_verify_the_first_branch(tiny_model, tiny_target) -> None:  # type: ignore[no-untyped-def]
    # Trees need strict greedy verification; sampled (keyed) and ASD requests get the
    # tree's first branch as a chain. Keyed sampling is draft-independent: the output
    # equals plain keyed sampling with the same seed, whatever was drafted.
    ref = hf_greedy(tiny_model, [4, 5, 6], 30, None)
    sp = SamplingParams(temperature=1.0, seed=0)
    plain = SpeculativeDecoder(tiny_target, None, KeyedVerifier()).generate([4, 5, 6], 20,
                                                                          sampling=sp)
    engine = SpeculativeDecoder(tiny_target, TreeDrafter(ref, random.Random(1)),
                                KeyedVerifier())
    got = engine.generate([4, 5, 6], 20, sampling=sp)
    assert got.tokens == plain.tokens
    assert any(s.draft_len for s in got.stats.steps)
    asd = SpeculativeDecoder(
        tiny_target, TreeDrafter(ref, random.Random(1)), BudgetedVerifier(BudgetConfig(4.0))
    )
    assert len(asd.generate([4, 5, 6], 10).tokens) == 10


def test_first_branch_follows_first_children() -> None:
    d = Draft([10, 11, 12, 13, 14, 15], parents=[-1, 0, 1, 0, -1, 4])
    assert d.first_branch() == Draft([10, 11, 12])
    assert Draft([1, 2]).first_branch() == Draft([1, 2])


class _BatchOnly:
    """The target without tree attention: trees are verified one branch per batch row."""

    def __init__(self, target) -> None:  # type: ignore[no-untyped-def]
        self._t = target

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name in ("score_tree", "keep_tree_path"):
            raise AttributeError(name)
        return getattr(self._t, name)


@pytest.mark.parametrize("attention", ["tree", "branch_rows"])
def test_tree_verification_matches_greedy(tiny_model, tiny_target, attention) -> None:  # type: ignore[no-untyped-def]
    target = tiny_target if attention == "tree" else _BatchOnly(tiny_target)
    assert isinstance(target, TreeTarget) == (attention == "tree")
    assert isinstance(target, BatchTarget)
    rng = random.Random(9)
    for trial in range(6):
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(1, 20))]
        expected = hf_greedy(tiny_model, prompt, 25, None)
        engine = SpeculativeDecoder(target, TreeDrafter(expected + [3] * 20, rng),
                                    config=EngineConfig(max_draft=16, max_branches=3))
        got = engine.generate(prompt, max_tokens=25)
        assert got.tokens == expected, (attention, trial)
        assert SpeculativeDecoder(tiny_target).generate(prompt, 5).tokens == expected[:5]


def test_greedy_tree_accept_walks_the_target_choices() -> None:
    # root (pending) -> 5 -> 6, and 5 -> 8 -> 9
    draft = Draft([5, 6, 8, 9], parents=[-1, 0, 0, 2])
    tokens, parents = tree_rows(draft, pending=0)
    assert tokens == [0, 5, 6, 8, 9] and parents == [-1, 0, 1, 1, 3]
    logits = torch.full((5, 12), -1.0)
    for node, want in enumerate([5, 8, 2, 9, 4]):  # target argmax after each node
        logits[node, want] = 1.0
    assert greedy_tree_accept(tokens, parents, logits) == ([0, 2, 3], 4)


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
