"""Degenerate-loop detection: the exact definition in workflows/bench/repetition.py."""

from __future__ import annotations

import random

import pytest

from workflows.bench.repetition import loop_mask, loop_share


def _brute_force(tokens: list[int], lo: int, hi: int, reps: int, span: int) -> list[bool]:
    """The definition, literally: mark j when some loop [s, e) of period p holds j >= s + p."""
    n = len(tokens)
    mask = [False] * n
    for p in range(lo, hi + 1):
        for s in range(n):
            for e in range(s + max(p * reps, span), n + 1):
                if all(tokens[j] == tokens[j - p] for j in range(s + p, e)):
                    for j in range(s + p, e):
                        mask[j] = True
    return mask


def test_repeated_lines_are_marked_after_the_first_copy() -> None:
    line = [10, 11, 12, 13, 14, 15]  # "the same line" of 6 tokens, 4 times
    tokens = [1, 2, 3, *line * 4]
    mask = loop_mask(tokens)
    assert mask == [False] * 3 + [False] * 6 + [True] * 18
    assert loop_share(tokens) == pytest.approx(18 / 27)


def test_short_runs_and_too_few_repeats_are_not_loops() -> None:
    assert not any(loop_mask([5, 5, 5, 5, 1, 2, 3]))  # below min_span
    assert not any(loop_mask(list(range(20)) * 2))  # two copies only (min_repeats=3)
    assert any(loop_mask(list(range(20)) * 2, min_repeats=2))
    assert not any(loop_mask(list(range(70)) * 3))  # period above max_period
    assert any(loop_mask([7] * 40))  # period 1, long run
    assert any(loop_mask([5, 5, 5, 5], min_span=4))


def test_matches_brute_force_definition() -> None:
    rng = random.Random(0)
    for _ in range(60):
        # Small alphabet plus planted loops so both outcomes occur.
        tokens = [rng.randrange(3) for _ in range(rng.randrange(0, 25))]
        if rng.random() < 0.5:
            unit = [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
            at = rng.randrange(len(tokens) + 1)
            tokens[at:at] = unit * rng.randrange(2, 6)
        args = (rng.randrange(1, 3), rng.randrange(3, 6), rng.randrange(2, 4), rng.randrange(1, 8))
        lo, hi, reps, span = args
        assert loop_mask(tokens, lo, hi, reps, min_span=span) == _brute_force(tokens, *args)


def test_edge_cases() -> None:
    assert loop_mask([]) == [] and loop_share([]) == 0.0
    assert loop_share(["a\n"] * 30) > 0.9  # any hashable items, e.g. lines
    with pytest.raises(ValueError):
        loop_mask([1, 2], min_period=0)
    with pytest.raises(ValueError):
        loop_mask([1, 2], min_repeats=1)
