"""Occurrence counts of the suffix automaton (``SuffixIndex``) under random operations.

A bf16 bench once raised ``ZeroDivisionError`` in ``speculate_tree``: after the tree's last
node was added, the children of that node (strings one token longer than the
``max_depth + max_draft`` cap, whose counts the index does not maintain) were still
expanded, and a state with count 0 gave a zero total.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.drafters.suffix.automaton import SuffixIndex, spec_limit
from agentspec.drafters.suffix.index import PyTree

FACTORS = (0.5, 1.0, 2.0)
OFFSETS = (0.0, 1.0, 8.0)
MIN_PROBS = (0.0, 0.1, 0.3)

# (op, seq id, tokens): "append" extends a sequence, "remove" drops it (a rebuild, as when
# the drafter drops the oldest turns of a history over max_scope_tokens).
_op = st.one_of(
    st.tuples(st.just("append"), st.integers(0, 2),
              st.lists(st.integers(0, 3), min_size=0, max_size=8)),
    st.tuples(st.just("remove"), st.integers(0, 2), st.just([])),
)


def _occurrences(seqs: Sequence[Sequence[int]], w: Sequence[int]) -> int:
    n = len(w)
    return sum(1 for s in seqs for i in range(len(s) - n + 1) if list(s[i : i + n]) == list(w))


def _check_counts(idx: SuffixIndex, seqs: Sequence[Sequence[int]]) -> None:
    """Every string of length <= cap has its state's count equal to its occurrences."""
    cap = idx.max_depth + idx.max_draft
    frontier: list[tuple[int, list[int]]] = [(0, [])]
    while frontier:
        v, w = frontier.pop()
        if w:
            assert idx._cnt[v] == _occurrences(seqs, w) >= 1, (w, seqs)
        if len(w) < cap:
            frontier.extend((x, [*w, t]) for t, x in idx.children(v))


def _check_tree(idx: SuffixIndex, ctx: list[int], max_tokens: int, f: float, o: float,
                mp: float) -> None:
    tree = idx.speculate_tree(ctx, max_tokens, idx.max_depth, f, o, mp)
    limit = spec_limit(tree.match_len, min(max_tokens, idx.max_draft), f, o)
    assert len(tree.tokens) <= limit
    assert len(tree.parents) == len(tree.probs) == len(tree.tokens)
    for i, (p, parent) in enumerate(zip(tree.probs, tree.parents, strict=True)):
        assert math.isfinite(p) and 0.0 < p <= 1.0, (ctx, tree)
        assert p >= mp
        assert -1 <= parent < i
    assert math.isfinite(tree.score)


def _check_chain(idx: SuffixIndex, ctx: list[int], max_tokens: int, f: float, o: float,
                 mp: float) -> None:
    out, ell, score = idx.speculate(ctx, max_tokens, idx.max_depth, f, o, mp)
    assert len(out) <= spec_limit(ell, min(max_tokens, idx.max_draft), f, o)
    assert math.isfinite(score) and 0.0 <= score <= len(out)
    assert (score > 0.0) == bool(out)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    depth=st.integers(1, 4),
    draft=st.integers(1, 4),
    ops=st.lists(_op, min_size=1, max_size=8),
    extra=st.lists(st.lists(st.integers(0, 4), max_size=6), max_size=3),
    params=st.tuples(st.sampled_from(FACTORS), st.sampled_from(OFFSETS),
                     st.sampled_from(MIN_PROBS), st.integers(1, 5)),
)
def test_random_operations_keep_counts_and_probabilities_valid(
    depth: int, draft: int, ops: list[tuple[str, int, list[int]]],
    extra: list[list[int]], params: tuple[float, float, float, int],
) -> None:
    f, o, mp, max_tokens = params
    tree = PyTree(depth, draft)
    seqs: dict[int, list[int]] = {}
    for op, sid, toks in ops:
        if op == "append":
            tree.extend(sid, toks)
            seqs.setdefault(sid, []).extend(toks)
        else:
            tree.remove(sid)
            seqs.pop(sid, None)
        idx = tree._index
        _check_counts(idx, list(seqs.values()))
        # Speculate at every position of every sequence (as a drafter does while its
        # answer is generated), and from a few contexts that need not occur at all.
        ctxs = [s[: i + 1] for s in seqs.values() for i in range(len(s))] + extra
        for ctx in ctxs:
            _check_tree(idx, ctx, max_tokens, f, o, mp)
            _check_chain(idx, ctx, max_tokens, f, o, mp)
            for use_tree in (False, True):
                spec = tree.speculate(ctx, max_tokens, f, o, mp, use_tree)
                assert math.isfinite(spec.score)


def test_tree_does_not_expand_past_the_count_cap() -> None:
    # Minimal failing example found by hypothesis: cap = 2, "000" is a state of count 0
    # (its strings are longer than the cap); expanding the tree's last node "00" read it.
    idx = SuffixIndex(max_depth=1, max_draft=1)
    idx.append(0, [0, 0, 0])
    tree = idx.speculate_tree([0], 1, 1, 0.5, 1.0, 0.0)
    assert tree.tokens == [0]
    assert tree.parents == [-1]
    assert tree.probs == [1.0]
    assert tree.match_len == 1
    assert idx.speculate([0], 1, 1, 0.5, 1.0, 0.0) == ([0], 1, 1.0)


def test_tree_at_full_depth_and_draft_is_unchanged() -> None:
    # Longest match and longest draft: the tree reaches exactly the cap and stops there.
    idx = SuffixIndex(max_depth=2, max_draft=2)
    idx.append(0, [1, 2, 1, 2, 1, 2, 1, 2])
    idx.append(1, [1, 2, 3])
    tree = idx.speculate_tree([1, 2], 2, 2, 1.0, 0.0, 0.0)
    assert tree.match_len == 2
    assert tree.tokens[0] == 1
    assert len(tree.tokens) == 2
    assert all(0.0 < p <= 1.0 for p in tree.probs)
