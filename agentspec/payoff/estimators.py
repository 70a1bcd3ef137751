"""Decayed ratio estimates per cell: how much of a draft score the target really accepts.

Why. Two parts calibrate a cache draft's score s (its index's expected accepted length)
against what the target accepted, y, per cell (a match-length bucket, and for the session
cache also the history level): the draft gate (:mod:`agentspec.drafters.gate`, per tenant,
from full-length labels) and the session cache's per-level calibration
(:class:`agentspec.drafters.suffix.levels.Calibration`, from every candidate of each step).
Both keep decayed sums and read the ratio with pseudo-counts at a prior ratio, so the two
share this one class and its one floating-point formula:

    Σy ← Σy·d + y,  Σs ← Σs·d + s,  r = (Σy + P·r₀) / (Σs + P).

A cell never learned from reads as empty sums (r = r₀), and reading never creates a cell.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["DecayedRatios"]

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
