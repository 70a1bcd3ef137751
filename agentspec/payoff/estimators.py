"""Decayed estimates per cell of what the target accepts of cache drafts.

:class:`DecayedRatios`: how much of a draft score s (its index's expected accepted
length) the target really accepts, y, per cell: the session cache's per-level calibration
(:class:`agentspec.drafters.suffix.levels.Calibration`, from every candidate of each step)
keeps decayed sums and reads the ratio with pseudo-counts at a prior ratio:

    Σy ← Σy·d + y,  Σs ← Σs·d + s,  r = (Σy + P·r₀) / (Σs + P).

A cell never learned from reads as empty sums (r = r₀), and reading never creates a cell.

:class:`DecayedSurvival`: how far into a draft the target follows it, position by position
(the draft gate's model, :mod:`agentspec.drafters.gate`). A draft whose full-length label is
y (its tokens the target followed) was *at risk* at position j when it had a j-th token and
y ≥ j − 1, and *survived* it when y ≥ j. Per cell and position group g(j) (1, 2, 3-4, 5-8,
…: later positions are rarer, so they share counts) it keeps decayed counts A and S, and
reads the conditional acceptance at j with pseudo-counts at a prior rate p₀(j):

    p(j) = (S_g + P·p₀(j)) / (A_g + P),   P(y ≥ j) = Π_{i ≤ j} p(i).

A draft can be counted as the committed tokens come (:meth:`DecayedSurvival.count`): each
position it is seen to survive at once, its failure when a mismatch shows it. That is the
Kaplan-Meier estimate with right-censoring: a draft still being followed when its request
ends has counted its survivals and nothing more, and a learner that declines drafts learns
from them step by step instead of only once a whole draft's continuation is known.

Why not a ratio of the score: on agent logs the realised share of a draft's score falls as
the score grows (long matches that the answer leaves after a few tokens), so one ratio per
cell, fitted mostly on short drafts, prices the long ones as copies.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["POSITION_GROUPS", "DecayedRatios", "DecayedSurvival", "position_group"]

K = TypeVar("K", bound=Hashable)


class DecayedRatios(Generic[K]):
    """Decayed sums ``[Σ y, Σ s]`` per cell and their prior-weighted ratio.

    Attributes:
        sums: Cell -> ``[Σ y, Σ s]`` (cells learned from only).
    """

    __slots__ = ("sums",)

    def __init__(self) -> None:
        self.sums: dict[K, list[float]] = {}

    def ratio(self, cell: K, prior: float, prior_ratio: float = 1.0) -> float:
        """r = (Σ y + P·r₀) / (Σ s + P) of ``cell``, with ``prior`` P pseudo-units of score
        at ratio ``prior_ratio`` r₀ (a cell never learned from: r₀)."""
        y, s = self.sums.get(cell, (0.0, 0.0))
        return (y + prior * prior_ratio) / (s + prior)

    def learn(self, cell: K, y: float, s: float, decay: float) -> None:
        """One observation of ``cell``: score ``s``, accepted ``y``; older ones weigh
        ``decay`` less."""
        st = self.sums.setdefault(cell, [0.0, 0.0])
        st[0] = st[0] * decay + y
        st[1] = st[1] * decay + s


#: Position groups of :class:`DecayedSurvival`: 1, 2, 3-4, 5-8, 9-16, 17-32, 33-64, 65+.
POSITION_GROUPS = 8


def position_group(j: int) -> int:
    """The count group of draft position ``j`` (1-based): ⌈log₂ j⌉, capped."""
    return min((j - 1).bit_length(), POSITION_GROUPS - 1)


class DecayedSurvival(Generic[K]):
    """Decayed at-risk and survival counts per cell and position group (module doc).

    Attributes:
        counts: Cell -> ``[A_g for each group, S_g for each group]`` (cells learned from
            only).
    """

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[K, list[float]] = {}

    def rates(self, cell: K, length: int, prior: float,
              prior_rate: Callable[[int], float]) -> list[float]:
        """p(j) for j = 1..``length`` in ``cell``: ``prior`` P pseudo-drafts at
        ``prior_rate(j)`` (a cell never learned from: the prior's rates)."""
        c = self.counts.get(cell)
        out = []
        for j in range(1, length + 1):
            g = position_group(j)
            at, ok = (c[g], c[POSITION_GROUPS + g]) if c is not None else (0.0, 0.0)
            out.append((ok + prior * prior_rate(j)) / (at + prior))
        return out

    def age(self, cell: K, decay: float) -> None:
        """Weigh ``cell``'s counts ``decay`` less: once per draft, when it is first counted."""
        c = self.counts.setdefault(cell, [0.0] * (2 * POSITION_GROUPS))
        for i in range(len(c)):
            c[i] *= decay

    def count(self, cell: K, known: int, followed: int, decided: bool, depth: int) -> None:
        """What the committed tokens newly show of one draft ``depth`` tokens deep, of
        which ``known`` positions were counted before: it survived positions ``known + 1``
        to ``followed``; when ``decided`` (a mismatch, or the leaf) and ``followed < depth``
        it was at risk at ``followed + 1`` and failed there. A draft counted step by step
        (a right-censored label, then the rest) ends with the counts of one call with
        ``known = 0`` and its final label."""
        c = self.counts.setdefault(cell, [0.0] * (2 * POSITION_GROUPS))
        for j in range(known + 1, min(followed, depth) + 1):
            g = position_group(j)
            c[g] += 1.0
            c[POSITION_GROUPS + g] += 1.0
        if decided and followed < depth:
            c[position_group(followed + 1)] += 1.0
