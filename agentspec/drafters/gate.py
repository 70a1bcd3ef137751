"""The draft gate: verify a cache draft whole, cut it, or decode one token, whichever is
expected to commit the most tokens per second at the request's context length.

Why. Verifying ``k`` draft tokens costs one forward over ``k + 1`` tokens, c(k + 1, L), and
over a long context that cost grows steeply with k: every verified token attends to the
whole cache, accepted or not (:mod:`agentspec.targets.cost.costs`). On real agent sessions
many cache drafts are refuted at their first token, mostly those from short suffix matches,
and verifying such a draft whole costs several plain steps; so a draft is verified only as
far as its expected committed tokens pay for the forward, priced at the request's context
as the machine is loaded now.

The rule. What a draft is worth is how far into it the target follows it. For each tenant
the gate learns, per match-length bucket b (power-of-two buckets, as the drafter's own level
calibration), the conditional acceptance p_b(j) of draft position j: of the tenant's recent
drafts of that bucket that had a j-th token and were followed to j − 1, the share followed
to j (decayed counts, position groups 1, 2, 3-4, 5-8, … sharing counts:
:class:`~agentspec.payoff.estimators.DecayedSurvival`). Each bucket's counts are shrunk to
the tenant's pooled ones (P pseudo-drafts), and those to a prior p₀(j) = 1 − (1 − p₁)/j
(p₁ = ``first_rate``: a first token is a coin toss; a copy that survives its first tokens
tends to run on). Then P(y ≥ j) = Π_{i≤j} p_b(i), E_k = Σ_{j≤k} P(y ≥ j), and the gate
verifies the k maximising (E_k + 1) / c(k + 1, L), or nothing (plain decoding, 1 / c(1, L))
when that is better. A tree draft's E_k runs to the depth its first k nodes reach.
Lossless either way: the gate only chooses which draft tokens get verified.

Why survival and not a share of the drafter's score: on agent logs the share of the score
that drafts realise falls as the score grows (long matches that the answer leaves after a
few tokens), so one ratio per bucket, fitted mostly on short drafts, priced the long ones as
whole copies (measured: ``BENCHMARKS.md`` question 15).

Labels. A draft verified whole shows its y at once; a cut or skipped one shows it in the
tokens committed in the following steps (y is the longest root path of the draft that the
committed continuation follows: :meth:`~agentspec.types.Draft.followed`). Each request
keeps its drafts until their labels are known, and counts each one as the committed tokens
come: every position it is seen to survive at once, its failure when a mismatch shows it
(right-censored at the request's end). So a gate that declines drafts learns from them
step by step: in a new tenant whose first drafts it prices too low (a verbatim repeat of
the last request), the next steps' drafts are priced by the copy being followed, not only
once the whole repeat is decoded.

The rule prices drafts by the measured curve, so where short verifies are cheap
(``agentspec/targets/linear.py``) it verifies more, shorter drafts. What it saves:
``docs/draft-cost.md`` and ``BENCHMARKS.md``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from agentspec.errors import ConfigError
from agentspec.lru import LRU
from agentspec.payoff.estimators import DecayedSurvival
from agentspec.payoff.policy import best_length
from agentspec.requests import REQUESTS, Slot
from agentspec.types import (
    ContextCost,
    Draft,
    DraftContext,
    VerifyResult,
)


@dataclass(frozen=True)
class GateConfig:
    """Settings of :class:`DraftGate`.

    Attributes:
        first_rate: p₁, the prior acceptance of a draft's first token; the prior at
            position j is 1 − (1 − p₁)/j.
        decay: Per-draft forgetting of the counts (0.98: about the last 50 labelled drafts
            of a bucket, and of the tenant for the pooled counts).
        prior: Pseudo-drafts of the tenant's pooled rates in each bucket's rates.
        pooled_prior: Pseudo-drafts of the prior in the tenant's pooled rates.
        max_tenants: Tenants whose calibration is kept (least recently used dropped).
        max_pending: Unlabelled drafts kept per request (oldest dropped).
    """

    first_rate: float = 0.5
    decay: float = 0.98
    prior: float = 2.0
    pooled_prior: float = 2.0
    max_tenants: int = 1024
    max_pending: int = 64

    def __post_init__(self) -> None:
        if not 0.0 < self.first_rate < 1.0:
            raise ConfigError(f"first_rate must be in (0, 1), got {self.first_rate!r}")
        if not 0.0 < self.decay <= 1.0:
            raise ConfigError(f"decay must be in (0, 1], got {self.decay!r}")
        if self.prior <= 0 or self.pooled_prior <= 0:
            raise ConfigError(f"prior and pooled_prior must be > 0, got {self.prior!r}, "
                              f"{self.pooled_prior!r}")
        if self.max_tenants < 1 or self.max_pending < 1:
            raise ConfigError(f"max_tenants and max_pending must be >= 1, got "
                              f"{self.max_tenants!r}, {self.max_pending!r}")

    def prior_rate(self, j: int) -> float:
        """p₀(j), the prior conditional acceptance of draft position ``j``."""
        return 1.0 - (1.0 - self.first_rate) / j


def bucket(match_len: int) -> int:
    """Calibration cell of a draft: its match length's power-of-two bucket."""
    return min(max(match_len, 0), 64).bit_length()


#: The cell of a tenant's pooled counts (buckets are 0..7).
POOLED = -1


class _Calibration(DecayedSurvival[int]):
    """One tenant's counts per match-length bucket, and pooled (:data:`POOLED`)."""

    __slots__ = ()

    def bucket_rates(self, cell: int, length: int, config: GateConfig) -> list[float]:
        """p_b(j) for j = 1..``length``: the bucket's counts shrunk to the pooled rates,
        those shrunk to the prior."""
        pooled = self.rates(POOLED, length, config.pooled_prior, config.prior_rate)
        return self.rates(cell, length, config.prior, lambda j: pooled[j - 1])

    def age(self, cell: int, decay: float) -> None:
        """Age the bucket's and the pooled counts for one new draft."""
        super().age(cell, decay)
        super().age(POOLED, decay)

    def note(self, cell: int, known: int, followed: int, decided: bool, depth: int) -> None:
        """Count what the committed tokens newly show of one draft, in its bucket and
        pooled (:meth:`DecayedSurvival.count`)."""
        self.count(cell, known, followed, decided, depth)
        self.count(POOLED, known, followed, decided, depth)


@dataclass
class _Pending:
    """A draft whose full-length label is not known yet."""

    start: int  # len(ctx.tokens) when drafted: its continuation starts there
    draft: Draft
    tenant: str
    cell: int  # its match-length bucket
    depth: int  # the depth it reaches (a chain: its length)
    counted: int = -1  # positions counted so far (-1: none, its cells not aged for it yet)


class DraftGate:
    """Cuts or skips cache drafts by expected committed tokens per second (module doc).

    Args:
        cost: c(k, L) in seconds (``HFTarget.context_cost``: the measured curve as the
            target's timed forwards correct it, so the gate prices drafts by the machine as
            loaded now). It must not measure anything: it is read inside requests.
        config: Calibration settings.
    """

    name = "cost"

    def __init__(self, cost: ContextCost, config: GateConfig | None = None) -> None:
        self.cost = cost
        self.config = config or GateConfig()
        self._tenants: LRU[str, _Calibration] = LRU(self.config.max_tenants)
        # Each live request's unlabelled drafts, in the one home of per-request state.
        self._pending: Slot[list[_Pending]] = REQUESTS.slot("gate")
        self._lock = threading.Lock()

    def _calibration(self, tenant: str) -> _Calibration:
        return self._tenants.get_or_put(tenant, _Calibration)

    def length(self, draft: Draft, context: int, rates: list[float]) -> int:
        """Draft tokens worth verifying at ``context`` cached positions (0: none), for the
        conditional acceptance ``rates`` of positions 1, 2, … (at least the draft's depth)."""
        n = len(draft.tokens)
        if n == 0 or draft.score <= 0:
            return n  # nothing to gate, or a drafter that does not score its drafts
        reach = _reach(draft)  # reach[k - 1]: the depth the first k nodes reach
        if len(rates) < reach[-1]:
            raise ConfigError(f"the gate needs a rate for each of the draft's {reach[-1]} "
                              f"positions, got {len(rates)}")
        survive, expected = 1.0, [0.0]  # expected[d] = E over the first d positions
        for p in rates[: reach[-1]]:
            survive *= p
            expected.append(expected[-1] + survive)
        costs = [self.cost(j, context) for j in range(1, n + 2)]  # costs[j - 1] = c(j, L)
        k, rate = best_length(lambda j: expected[reach[j - 1]], n, lambda j: costs[j - 1])
        return k if rate > 1.0 / costs[0] else 0

    def cut(self, ctx: DraftContext, draft: Draft) -> Draft:
        """The part of ``draft`` to verify this step (an empty draft: decode one token)."""
        if not draft.tokens:
            return draft
        tenant = ctx.session.tenant if ctx.session is not None else ""
        cell, depth = bucket(draft.match_len), _reach(draft)[-1]
        with self._lock:
            rates = self._calibration(tenant).bucket_rates(cell, depth, self.config)
            pending = self._pending.get_or_put(ctx.state_key, list)
            pending.append(_Pending(len(ctx.tokens), draft, tenant, cell, depth))
            del pending[: -self.config.max_pending]
        k = self.length(draft, len(ctx.tokens), rates)
        if k >= len(draft.tokens):
            return draft
        return draft.truncated(k) if k else Draft(source="none", position=draft.position)

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Label the request's drafts the committed tokens now decide."""
        with self._lock:
            pending = self._pending.get(ctx.state_key)
            if not pending:
                return
            tokens = ctx.tokens
            keep = []
            for p in pending:
                followed, decided = p.draft.followed([*tokens[p.start:], *result.tokens])
                calibration = self._calibration(p.tenant)
                if p.counted < 0:
                    calibration.age(p.cell, self.config.decay)
                    p.counted = 0
                calibration.note(p.cell, p.counted, followed, decided, p.depth)
                p.counted = followed
                if not decided:
                    keep.append(p)
            pending[:] = keep

    def finish(self, ctx: DraftContext) -> None:
        """Drop the request's unlabelled drafts (a drafter's end of request; the engine's
        end of a request drops them with the rest of its state: :mod:`agentspec.requests`)."""
        self._pending.pop(ctx.state_key)


def _reach(draft: Draft) -> list[int]:
    """``reach[k - 1]``: the depth the draft's first k nodes reach (a chain: k; a tree's
    nodes come after their parents, as ``Draft.truncated`` keeps them)."""
    parents = draft.parents
    if parents is None:
        return list(range(1, len(draft.tokens) + 1))
    depth: list[int] = []
    reach: list[int] = []
    for i, p in enumerate(parents):
        depth.append(1 if p < 0 else depth[p] + 1)
        reach.append(max(depth[i], reach[-1] if reach else 0))
    return reach
