"""The target's verification cost c(k, L): seconds of one forward over ``k`` new tokens on a
cache of ``L`` positions, from a few measured points.

Why the context length matters. A forward over k new tokens reads every weight once (the
same for any context) and attends each new token to the whole cache: ~4·d·L·layers
FLOPs per token (d = 576, 30 layers on SmolLM2-135M: ~480 MFLOP per token at 7k positions,
against ~270 for all the weights). At short contexts c(k) grows slowly with k, so a draft
that is mostly wrong costs little; at long ones every verified draft token pays attention
over the whole cache, hit or miss, so c(33)/c(1) itself grows with L
(``docs/draft-cost.md``). A gate that prices drafts with the short-context curve verifies
too much at long contexts.

The curves: c(k) measured at :data:`SHORT_CONTEXT` positions (the curve HVD has always
used) and, for :func:`at_context`, at one long context. Between measured k the cost is
interpolated linearly, beyond the last k extrapolated along the last slope (never falling:
timing noise can measure c(32) below c(24)). Between the two contexts the cost is
interpolated linearly in L, and beyond the long one extrapolated along the same line: the
attention term is linear in L (in practice it grows a little faster at long contexts, as
the cache leaves the CPU's caches; the gate compares rates at one L, where a common
underestimate mostly cancels).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

#: Draft lengths at which c(k) is measured; others are interpolated linearly.
COST_POINTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
#: The order measuring takes the points in: the two ends first (the others are then
#: interpolated between measured points, never extrapolated), then the points that split
#: the widest gaps left. Under a time budget the points not reached are interpolated.
MEASURE_ORDER = (1, 32, 8, 2, 16, 4, 24, 12, 3, 6)
#: Seconds one curve's measuring may take at load before its remaining points are
#: interpolated (the ends are always measured). c(k) is close to linear in k between the
#: points measured first, and the live estimate refines it from real verifies
#: (:mod:`agentspec.targets.cost.live_cost`): a first load should not cost minutes of
#: timing on a large model or a busy machine.
MEASURE_BUDGET_S = 4.0
#: Cache positions of the base curve ``verify_cost`` reads.
SHORT_CONTEXT = 500
#: Cache positions of the long curve (or the model's window less room for the draft).
LONG_CONTEXT = 4096

Curve = dict[int, float]  # k -> seconds

#: A measured point more than this many times the next one (or, for the last point, above
#: the previous one scaled by the row counts) was slowed by something else: timed again.
GLITCH = 1.5


def glitches(curve: Mapping[int, float]) -> list[int]:
    """The points of ``curve`` that look slowed by another process: those
    :func:`without_glitches` lowers. A forward over fewer rows costs no more than one over
    more (up to noise: :data:`GLITCH`), and its cost grows at most in proportion to its
    rows (the last point, which has no point above it)."""
    fixed = without_glitches(curve)
    return [k for k in sorted(curve) if fixed[k] < curve[k]]


def without_glitches(curve: Mapping[int, float]) -> Curve:
    """``curve`` with each glitch left after timing again clamped to the bound it broke:
    :data:`GLITCH` times the next point's cost, the last point GLITCH times the previous
    one's scaled by the row counts (right to left, so a run of glitches is bounded by the
    first sound point above it). A sound curve comes back unchanged."""
    out = dict(curve)
    points = sorted(out)
    if len(points) > 1:
        lo, hi = points[-2], points[-1]
        out[hi] = min(out[hi], GLITCH * out[lo] * hi / lo)
    for lo, hi in reversed(list(itertools.pairwise(points))):
        out[lo] = min(out[lo], GLITCH * out[hi])
    return out


def interpolate(costs: Mapping[int, float], k: int) -> float:
    """c(k) from measured points: linear between them, along the last slope beyond them
    (never falling), the first point below them."""
    points = sorted(costs)
    if len(points) == 1:
        return costs[points[0]]
    if k >= points[-1]:
        hi, lo = points[-1], points[-2]
        slope = max(0.0, (costs[hi] - costs[lo]) / (hi - lo))
        return costs[hi] + slope * (k - hi)
    for lo, hi in itertools.pairwise(points):
        if lo <= k <= hi:
            w = (k - lo) / (hi - lo)
            return (1 - w) * costs[lo] + w * costs[hi]
    return costs[points[0]]


def at_context(curves: Mapping[int, Curve], k: int, context: int) -> float:
    """c(k, L) from curves measured at several contexts ``{L_i: curve}``: linear in L
    between the two nearest measured contexts (beyond the last two, along their line, never
    below the last curve; below the first, the first curve)."""
    if not curves:
        raise ValueError("no measured cost curve")
    ctxs = sorted(curves)
    if len(ctxs) == 1 or context <= ctxs[0]:
        return interpolate(curves[ctxs[0]], k)
    lo, hi = ctxs[-2], ctxs[-1]
    for a, b in itertools.pairwise(ctxs):
        if context <= b:
            lo, hi = a, b
            break
    c_lo, c_hi = interpolate(curves[lo], k), interpolate(curves[hi], k)
    w = (context - lo) / (hi - lo)
    value = (1 - w) * c_lo + w * c_hi
    return max(value, c_hi) if context > hi else value


def short_context(max_positions: int) -> int:
    """The base curve's context: :data:`SHORT_CONTEXT`, or less on a model whose window
    cannot hold it plus a warm-up draft and the longest measured draft."""
    return max(1, min(SHORT_CONTEXT, max_positions - 2 * COST_POINTS[-1]))


def long_context(max_positions: int) -> int | None:
    """The long curve's context for a model with ``max_positions`` (``None``: the window is
    too short for a second curve to add anything)."""
    ctx = min(LONG_CONTEXT, max_positions - 2 * COST_POINTS[-1])
    return ctx if ctx >= 2 * SHORT_CONTEXT else None


def parse_curve(raw: Any) -> Curve | None:
    """A stored curve ``{"k": seconds}`` with every :data:`COST_POINTS` entry, positive;
    ``None`` when absent or malformed (it is then measured again). Glitches are clamped
    (:func:`without_glitches`: files written before the measurement timed them again)."""
    try:
        curve = {int(k): float(v) for k, v in raw.items()}
    except (AttributeError, TypeError, ValueError):
        return None
    if set(curve) != set(COST_POINTS) or not all(v > 0 for v in curve.values()):
        return None
    return without_glitches(curve)

