"""Merging the indexes' draft trees into one token tree (the session cache's tree mode)."""

from __future__ import annotations

import random

import pytest

from agentspec.drafters import SuffixConfig, SuffixDrafter
from agentspec.drafters.suffix.draft_tree import COMPILED, WeightedTree, merge_trees, merge_trees_py
from agentspec.drafters.suffix.index import arctic_available
from agentspec.types import Draft, DraftContext, SessionRef, VerifyResult

BACKENDS = ["python", "arctic"] if arctic_available() else ["python"]


def test_shared_prefixes_become_one_path() -> None:
    # a: 5 -> 6 -> 7 ; b: 5 -> 8 (shares the 5), 9 (a second root)
    a = (1.0, [5, 6, 7], [-1, 0, 1], [0.9, 0.8, 0.5])
    b = (1.0, [5, 8, 9], [-1, 0, -1], [0.95, 0.4, 0.05])
    toks, parents, score = merge_trees([a, b], limit=10)
    assert toks == [5, 6, 7, 8, 9] and parents == [-1, 0, 1, 0, -1]
    # The shared node keeps the larger value: 0.95 + 0.8 + 0.5 + 0.4 + 0.05
    assert score == pytest.approx(2.7)
    assert Draft(toks, parents).first_branch().tokens == [5, 6, 7]  # the first tree's path


def test_the_cut_keeps_the_most_likely_nodes_and_their_ancestors() -> None:
    # a's first branch 1 -> 2 -> 3 is kept whole; the rest compete by value.
    a = (1.0, [1, 2, 3, 9], [-1, 0, 1, 0], [1.0, 1.0, 0.3, 0.3])
    b = (0.5, [1, 7, 8], [-1, 0, 1], [1.0, 0.9, 0.9])  # weight 0.5: values 0.5, 0.45, 0.45
    for merge in (merge_trees, merge_trees_py):
        toks, parents, _ = merge([a, b], limit=4)
        assert toks == [1, 2, 3, 7] and parents == [-1, 0, 1, 0]
        toks, parents, _ = merge([a, b], limit=5)
        assert toks == [1, 2, 3, 7, 8] and parents == [-1, 0, 1, 0, 3]
        for limit in range(1, 8):
            toks, parents, _ = merge([a, b], limit)
            assert len(toks) == min(limit, 6)
            assert all(-1 <= p < i for i, p in enumerate(parents))  # ancestors kept, first


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_mode_offers_every_index_continuation(backend: str) -> None:
    # The tenant's history continues [1, 2, 3] with [40, 41, 42]; this request's own
    # prompt continues it with [50, 51, 52]. A chain picks one; the tree holds both.
    ref = SessionRef("s2", tenant="t")
    drafts = {}
    for tree in (False, True):
        d = SuffixDrafter(SuffixConfig(backend=backend, tree=tree, max_tokens=16))
        old = SessionRef("s1", tenant="t")
        hist = [9, 1, 2, 3, 40, 41, 42, 9]
        ctx = DraftContext(hist, 1, old, 0, "r0")
        d.propose(ctx, 8)
        d.observe(ctx, VerifyResult([], 0))
        d.finish(ctx)
        prompt = [7, 1, 2, 3, 50, 51, 52, 7, 1, 2, 3]
        drafts[tree] = d.propose(DraftContext(prompt, len(prompt), ref, 0, "r1"), 16)
    chain, tree_draft = drafts[False], drafts[True]
    assert not chain.is_tree and chain.tokens[:3] in ([40, 41, 42], [50, 51, 52])
    assert tree_draft.is_tree
    branches = [[tree_draft.tokens[i] for i in b] for b in tree_draft.branches()]
    assert any(b[:3] == [40, 41, 42] for b in branches)
    assert any(b[:3] == [50, 51, 52] for b in branches)


def _random_trees(rng: random.Random) -> list[WeightedTree]:
    """Up to four trees of up to 20 nodes: small token alphabets (shared and duplicate
    nodes, non-trie trees too), ties in probability and weight."""
    trees = []
    for _ in range(rng.randint(0, 4)):
        n = rng.randint(0, 20)
        toks = [rng.randint(0, 5) for _ in range(n)]
        parents = [rng.randint(-1, i - 1) for i in range(n)]
        probs = [rng.choice([0.5, 0.25, rng.random()]) for _ in range(n)]
        trees.append((rng.choice([1.0, 0.5, rng.random()]), toks, parents, probs))
    return trees


def test_the_compiled_merge_is_built_and_equals_the_reference() -> None:
    # `make venv` compiles _tree_merge.c (a C compiler is on every machine the suite runs
    # on); the product drafts with it, so it must give the reference's result exactly.
    assert COMPILED is not None and merge_trees is COMPILED
    rng = random.Random(5)
    for _ in range(2000):
        trees, limit = _random_trees(rng), rng.randint(1, 30)
        toks, parents, score = COMPILED(trees, limit)
        ref = merge_trees_py(trees, limit)
        # The score is summed in the same order; Python >= 3.12's sum() compensates.
        assert (toks, parents) == ref[:2] and score == pytest.approx(ref[2], rel=1e-12)
    with pytest.raises(ValueError, match="parent"):
        COMPILED([(1.0, [1, 2], [-1, 1], [0.5, 0.5])], 4)  # a node its own parent
    with pytest.raises(ValueError, match="differ in length"):
        COMPILED([(1.0, [1, 2], [-1], [0.5, 0.5])], 4)


def test_the_cut_keeps_the_first_trees_first_branch_whole() -> None:
    # The best index continues a copy for the whole budget (values 0.5: one earlier
    # occurrence of two); the second index's branches have higher values (0.9) but must
    # not cut the copy short.
    copy = (1.0, [1, 2, 3, 4, 5], [-1, 0, 1, 2, 3], [0.5] * 5)
    other = (1.0, [1, 7, 8], [-1, 0, 1], [0.5, 0.9, 0.9])
    for merge in (merge_trees, merge_trees_py):
        toks, parents, _ = merge([copy, other], limit=6)
        assert toks == [1, 2, 3, 4, 5, 7] and parents == [-1, 0, 1, 2, 3, 0]
        toks, _, _ = merge([copy, other], limit=3)  # shorter than the branch: its top
        assert toks == [1, 2, 3]


def test_a_trusted_draft_equals_a_checked_one() -> None:
    """``Draft.trusted`` (the session cache's unchecked constructor) builds the same value
    as the checked ``Draft(...)``, and the drafter's tree drafts pass the check."""
    trusted = Draft.trusted([5, 6, 7], [-1, 0, 0], 1.5, 2, "suffix")
    assert trusted == Draft([5, 6, 7], [-1, 0, 0], None, 1.5, 2, "suffix")
    assert trusted.truncated(2) == Draft([5, 6], [-1, 0], None, 1.5, 2, "suffix")
    drafter = SuffixDrafter(SuffixConfig(tree=True))
    ref = SessionRef("s1")
    doc = random.Random(3).sample(range(100, 900), 120)
    prompt = [1, *doc[:60], 2, *doc[:50]]
    draft = drafter.propose(DraftContext(prompt, len(prompt), ref, request_id="r"), 32)
    assert draft.tokens and Draft(draft.tokens, draft.parents, None, draft.score,
                                  draft.match_len, draft.source) == draft
