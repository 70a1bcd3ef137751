"""The draft gate: verify a cache draft whole, cut it, or decode one token, whichever is
expected to commit the most tokens per second at the request's context length.

Why. Verifying ``k`` draft tokens costs one forward over ``k + 1`` tokens, c(k + 1, L), and
over a long context that cost grows steeply with k: every verified token attends to the
whole cache, accepted or not (:mod:`agentspec.targets.costs`). On real agent sessions
many cache drafts are refuted at their first token, mostly those from short suffix matches,
and verifying such a draft whole costs several plain steps; so a draft is verified only as
far as its expected committed tokens pay for the forward, priced at the request's context
as the machine is loaded now.

The rule. For a draft of n tokens the drafter's score s (its expected accepted length
under the index's own frequencies) is calibrated per match-length bucket b (power-of-two
buckets, as the drafter's own level calibration): ŷ = min(n, r_b · s) with
r_b = (Σ y + P·r₀) / (Σ s + P) over the tenant's recent drafts of that bucket (decayed
sums, prior P pseudo-tokens at r = r₀, a cautious quarter), where y is a draft's
*full-length* accepted length. The
acceptance of the first k tokens follows the cache drafts' copy mixture of
:func:`agentspec.payoff.policy.fit_copy_acceptance` (with probability q the whole draft is
right, else tokens are accepted at rate β), and the gate verifies the k maximising
(E_k + 1) / c(k + 1, L), or nothing (plain decoding, 1 / c(1, L)) when that is better.
Lossless either way: the gate only chooses which draft tokens get verified.

Labels. A draft verified whole shows its y at once; a cut or skipped one shows it in the
tokens committed in the following steps (y is the longest root path of the draft that the
committed continuation follows: :meth:`~agentspec.types.Draft.followed_length`), so
each request keeps its drafts until their labels are known, and drops the unresolved ones
when it ends.

The rule prices drafts by the measured curve, so where short verifies are cheap
(``agentspec/targets/linear.py``) it verifies more, shorter drafts. What it saves:
``docs/draft-cost.md`` and ``BENCHMARKS.md``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from agentspec.errors import ConfigError
from agentspec.lru import LRU
from agentspec.payoff.estimators import DecayedRatios
from agentspec.payoff.policy import best_length, fit_copy_acceptance
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
        miss_rate: β, the per-token acceptance rate of drafts that get refuted (HVD's
            prior; learning it per tenant from the labels changed nothing replayed on
            the driven SWE-agent sessions).
        decay: Per-draft forgetting of each bucket's calibration sums (0.98: about the
            last 50 labelled drafts of that bucket).
        prior: Pseudo-tokens of the prior ratio (before evidence r = ``prior_ratio``).
        prior_ratio: r before evidence: the share of the drafter's score a new tenant's
            drafts are expected to realise. Cautious (a quarter): on open chat a new
            tenant's first drafts are long prompt matches that the answer does not follow,
            and verifying them whole costs several plain steps each; on copying workloads
            the first labelled draft moves r most of the way to what the tenant realises.
        max_tenants: Tenants whose calibration is kept (least recently used dropped).
        max_pending: Unlabelled drafts kept per request (oldest dropped).
    """

    miss_rate: float = 0.5
    decay: float = 0.98
    prior: float = 4.0
    prior_ratio: float = 0.25
    max_tenants: int = 1024
    max_pending: int = 64

    def __post_init__(self) -> None:
        if not 0.0 < self.miss_rate < 1.0:
            raise ConfigError(f"miss_rate must be in (0, 1), got {self.miss_rate!r}")
        if not 0.0 < self.decay <= 1.0:
            raise ConfigError(f"decay must be in (0, 1], got {self.decay!r}")
        if self.prior <= 0:
            raise ConfigError(f"prior must be > 0, got {self.prior!r}")
        if not 0.0 < self.prior_ratio <= 1.0:
            raise ConfigError(f"prior_ratio must be in (0, 1], got {self.prior_ratio!r}")
        if self.max_tenants < 1 or self.max_pending < 1:
            raise ConfigError(f"max_tenants and max_pending must be >= 1, got "
                              f"{self.max_tenants!r}, {self.max_pending!r}")


def bucket(match_len: int) -> int:
    """Calibration cell of a draft: its match length's power-of-two bucket."""
    return min(max(match_len, 0), 64).bit_length()


class _Calibration(DecayedRatios[int]):
    """One tenant's decayed sums ``[Σ y, Σ s]`` per match-length bucket (the session
    cache's level calibration keeps the same sums: one class, one formula)."""

    __slots__ = ()


@dataclass
class _Pending:
    """A draft whose full-length label is not known yet."""

    start: int  # len(ctx.tokens) when drafted: its continuation starts there
    draft: Draft
    tenant: str


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

    def length(self, draft: Draft, context: int, ratio: float) -> int:
        """Draft tokens worth verifying at ``context`` cached positions (0: none), for the
        calibration ``ratio`` r of the draft's bucket."""
        n = len(draft.tokens)
        if n == 0 or draft.score <= 0:
            return n  # nothing to gate, or a drafter that does not score its drafts
        y = min(float(n), draft.score * ratio)
        mix = fit_copy_acceptance(y, n, self.config.miss_rate)
        costs = [self.cost(j, context) for j in range(1, n + 2)]  # costs[j - 1] = c(j, L)
        k, rate = best_length(mix.expected, n, lambda j: costs[j - 1])
        return k if rate > 1.0 / costs[0] else 0

    def cut(self, ctx: DraftContext, draft: Draft) -> Draft:
        """The part of ``draft`` to verify this step (an empty draft: decode one token)."""
        if not draft.tokens:
            return draft
        tenant = ctx.session.tenant if ctx.session is not None else ""
        with self._lock:
            ratio = self._calibration(tenant).ratio(bucket(draft.match_len), self.config.prior,
                                                   self.config.prior_ratio)
            pending = self._pending.get_or_put(ctx.state_key, list)
            pending.append(_Pending(len(ctx.tokens), draft, tenant))
            del pending[: -self.config.max_pending]
        k = self.length(draft, len(ctx.tokens), ratio)
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
                label = p.draft.followed_length([*tokens[p.start:], *result.tokens])
                if label is None:
                    keep.append(p)
                    continue
                self._calibration(p.tenant).learn(bucket(p.draft.match_len), label,
                                                  p.draft.score, self.config.decay)
            pending[:] = keep

    def finish(self, ctx: DraftContext) -> None:
        """Drop the request's unlabelled drafts (a drafter's end of request; the engine's
        end of a request drops them with the rest of its state: :mod:`agentspec.requests`)."""
        self._pending.pop(ctx.state_key)
