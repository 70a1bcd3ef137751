"""Degenerate-loop detection: which output tokens are the model repeating itself.

Small models fall into loops (the same few lines again and again until the token limit).
A cache drafter predicts such loops perfectly, so a speed-up measured on looping outputs
overstates what users get; the benchmark reports the loop share and the speed-up on
loop-free turns next to the headline number.

Definition. A segment ``tokens[s:e]`` is *p-periodic* when ``tokens[j] == tokens[j - p]``
for every ``j`` in ``[s + p, e)``. A periodic segment is a *loop* when its period ``p`` is
in ``[min_period, max_period]``, it spans at least ``min_repeats`` periods
(``e - s >= p * min_repeats``) and at least ``min_span`` tokens. :func:`loop_mask` marks
every token of a loop except its first period, i.e. exactly the tokens that are copies of
the token ``p`` positions earlier. The first period is genuine generation: the model had to
produce it once. The ``min_span`` floor keeps short runs that are legitimate text (``"---"``,
a few blank lines, ``"| | |"``) from counting as loops.

The check is exhaustive over periods: ``O(len(tokens) × (max_period - min_period + 1))``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

DEFAULT_MIN_SPAN = 16


def loop_mask(
    tokens: Sequence[Hashable],
    min_period: int = 1,
    max_period: int = 64,
    min_repeats: int = 3,
    *,
    min_span: int = DEFAULT_MIN_SPAN,
) -> list[bool]:
    """Mark the tokens that repeat a loop (see the module docstring for the definition).

    Args:
        tokens: Token ids (any hashable items work, e.g. lines of text).
        min_period: Shortest period considered (>= 1).
        max_period: Longest period considered.
        min_repeats: Fewest periods a loop spans (>= 2).
        min_span: Fewest tokens a loop spans (first period included).

    Returns:
        One flag per token: True when the token copies the token one period earlier
        inside a loop.

    Raises:
        ValueError: ``min_period`` < 1, ``max_period`` < ``min_period`` or
            ``min_repeats`` < 2.
    """
    if min_period < 1 or max_period < min_period or min_repeats < 2:
        raise ValueError(
            f"need 1 <= min_period <= max_period and min_repeats >= 2, got "
            f"{min_period=} {max_period=} {min_repeats=}"
        )
    n = len(tokens)
    mask = [False] * n
    for p in range(min_period, min(max_period, n // min_repeats) + 1):
        need = max(p * min_repeats, min_span) - p  # matching positions a loop needs
        run_start = p
        for j in range(p, n + 1):
            # A run of matches tokens[j] == tokens[j - p] over [run_start, j) ends at j.
            if j < n and tokens[j] == tokens[j - p]:
                continue
            if j - run_start >= need:
                for k in range(run_start, j):
                    mask[k] = True
            run_start = j + 1
    return mask


def loop_share(
    tokens: Sequence[Hashable],
    min_period: int = 1,
    max_period: int = 64,
    min_repeats: int = 3,
    *,
    min_span: int = DEFAULT_MIN_SPAN,
) -> float:
    """Fraction of ``tokens`` that :func:`loop_mask` marks (0.0 for an empty sequence).

    Args:
        tokens: Token ids.
        min_period: See :func:`loop_mask`.
        max_period: See :func:`loop_mask`.
        min_repeats: See :func:`loop_mask`.
        min_span: See :func:`loop_mask`.

    Returns:
        A number in ``[0, 1]``.
    """
    if not tokens:
        return 0.0
    mask = loop_mask(tokens, min_period, max_period, min_repeats, min_span=min_span)
    return sum(mask) / len(mask)
