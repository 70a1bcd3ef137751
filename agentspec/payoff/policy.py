"""Which draft to verify: the cache draft (and how much of it), the model drafter's, or none.

Three policies share the :class:`SourcePolicy` Protocol, so :class:`HybridDrafter` never
asks which one it holds:

* :class:`ArcticRule` — ArcticInference's hand rule: verify the cache draft when its score
  (the suffix tree's expected accepted length) is at least the model draft's length.
* :class:`ThresholdPolicy` — the paper's HVD: verify the cache draft when the predicted
  accepted length ŷ ≥ τ, else draft with the model.
* :class:`CostAwarePolicy` — beyond the paper: maximise expected committed tokens per
  second of the step, using the target's measured verify cost c(k).

Cost model. A step verifying k draft tokens scores ``[pending] + draft``, one forward of
k + 1 tokens costing c(k + 1), plus the drafter's own time (≈0 for the cache; k drafter
forwards for the model, measured online). It commits ``accepted + 1`` tokens.

Acceptance model. Greedy acceptance stops at the first miss; with a per-token acceptance
rate α, P(accepted ≥ j) = α^j and E[min(accepted, k)] = Σ_{j=1..k} α^j. For the cache draft
α is solved from the predictor's ŷ for its full length L (Σ_{j≤L} α^j = ŷ); for the model
drafter α is estimated online from its verified steps (accepted tokens over accepted
tokens plus first misses, a Beta-style prior and exponential forgetting). Truncating the
cache draft at the k maximising (E_k + 1) / c(k + 1) is the "predicted useful length".
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from agentspec.errors import ConfigError
from agentspec.payoff.predictor import PayoffPredictor
from agentspec.types import Draft

CACHE, MODEL, NONE = "cache", "model", "none"
Cost = Callable[[int], float]  # c(k): seconds of one target forward over k tokens
PRELOAD_K = 32  # draft lengths whose c(k + 1) is read when a policy is built


@dataclass(frozen=True)
class Choice:
    """What to verify this step.

    Attributes:
        source: ``"cache"``, ``"model"`` or ``"none"`` (plain one-token decoding).
        length: Draft tokens to verify (the cache draft is cut to it; the model drafts it).
        predicted: ŷ of the cache draft (``nan`` when no predictor was consulted).
    """

    source: str
    length: int
    predicted: float = math.nan


@runtime_checkable
class SourcePolicy(Protocol):
    """Chooses the draft source each step and learns from verified steps."""

    name: str
    needs_features: bool

    def choose(self, cache: Draft, model_len: int, phi: list[float] | None) -> Choice:
        """Pick a source for the step.

        Args:
            cache: The cache drafter's draft (possibly empty).
            model_len: Most tokens the model drafter may draft this step (0: unavailable).
            phi: Features of ``cache`` when ``needs_features`` (else ``None``).
        """
        ...

    def update(self, source: str, draft_len: int, accepted: int, draft_s: float) -> None:
        """A step of ``source`` verified ``draft_len`` tokens and accepted ``accepted``;
        drafting it took ``draft_s`` seconds (``nan``: not representative, e.g. the
        model drafter's first step of a request, which also syncs it with the prompt)."""
        ...


def expected_accepted(alpha: float, k: int) -> float:
    """E[min(accepted, k)] = Σ_{j=1..k} α^j under a constant per-token acceptance rate."""
    if alpha >= 1.0:
        return float(k)
    return alpha * (1.0 - alpha**k) / (1.0 - alpha) if alpha > 0.0 else 0.0


def solve_alpha(y_hat: float, length: int) -> float:
    """The α with Σ_{j=1..length} α^j = ŷ (bisection; ŷ is clipped to [0, length])."""
    if length <= 0 or y_hat <= 0.0:
        return 0.0
    if y_hat >= length:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(30):  # 2^-30: far below any effect on the choice
        mid = (lo + hi) / 2
        if expected_accepted(mid, length) < y_hat:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def best_length(
    alpha: float, max_len: int, cost: Cost, per_token_s: float = 0.0
) -> tuple[int, float]:
    """The draft length k in 1..max_len maximising (E_k + 1) / (c(k + 1) + k · per_token_s),
    and that rate (expected committed tokens per second)."""
    best_k, best_rate = 0, -1.0
    for k in range(1, max_len + 1):
        rate = (expected_accepted(alpha, k) + 1.0) / (cost(k + 1) + k * per_token_s)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k, best_rate


class ArcticRule:
    """Cache draft if its score ≥ the model draft's length, else the model (ArcticInference).

    The suffix tree's score is the sum of its path probabilities, i.e. the draft's expected
    accepted length under the tree's own frequencies, so the rule reads "trust the cache
    when it expects to beat a fully accepted model draft".
    """

    name = "arctic_rule"
    needs_features = False

    def choose(self, cache: Draft, model_len: int, phi: list[float] | None) -> Choice:
        """Compare the cache score with the model's draft length."""
        if cache.tokens and (model_len == 0 or cache.score >= model_len):
            return Choice(CACHE, len(cache.tokens))
        return Choice(MODEL, model_len) if model_len else Choice(NONE, 0)

    def update(self, source: str, draft_len: int, accepted: int, draft_s: float) -> None:
        """Stateless."""


class ThresholdPolicy:
    """HVD as in the paper: verify the cache draft when ŷ ≥ τ, else draft with the model.

    Args:
        predictor: The payoff predictor (its ``tau`` is used unless ``tau`` is given).
        tau: Override of the threshold.
    """

    name = "hvd_threshold"
    needs_features = True

    def __init__(self, predictor: PayoffPredictor, tau: float | None = None) -> None:
        self.predictor = predictor
        self.tau = predictor.tau if tau is None else tau

    def choose(self, cache: Draft, model_len: int, phi: list[float] | None) -> Choice:
        """Threshold the predicted accepted length of the cache draft."""
        if not cache.tokens:
            return Choice(MODEL, model_len) if model_len else Choice(NONE, 0)
        y = self.predictor.predict(phi) if phi is not None else 0.0
        if y >= self.tau or model_len == 0:
            return Choice(CACHE, len(cache.tokens), y)
        return Choice(MODEL, model_len, y)

    def update(self, source: str, draft_len: int, accepted: int, draft_s: float) -> None:
        """Stateless."""


class CostAwarePolicy:
    """Maximise expected committed tokens per second (see the module docstring).

    Args:
        predictor: The payoff predictor (ŷ of the cache draft).
        cost: The target's measured c(k) in seconds (``HFTarget.verify_cost``).
        model_alpha: Prior per-token acceptance rate of the model drafter.
        prior_steps: Weight of that prior, in steps.
        decay: Per-step forgetting of the model's acceptance counts (adapts to the
            workload: chat and copying turns differ).
        keep_factor: A cache draft chosen for verification keeps at least this many times
            its predicted accepted length ŷ (see :meth:`choose`).
    """

    name = "cost_aware"
    needs_features = True

    def __init__(
        self,
        predictor: PayoffPredictor,
        cost: Cost,
        model_alpha: float = 0.6,
        prior_steps: float = 4.0,
        decay: float = 0.98,
        keep_factor: float = 2.0,
    ) -> None:
        if keep_factor < 0:
            raise ConfigError(f"keep_factor must be >= 0, got {keep_factor!r}")
        self.keep_factor = keep_factor
        if not 0.0 < model_alpha < 1.0:
            raise ConfigError(f"model_alpha must be in (0, 1), got {model_alpha!r}")
        self.predictor = predictor
        self.cost = _memo(cost)
        # Read c(k) now: a target measures its cost curve on first use (seconds), which
        # must not land inside the first decode step's drafting time.
        for k in range(1, 2 * PRELOAD_K + 2):
            self.cost(k)
        self.decay = decay
        # Beta-style pseudo counts: accepted tokens vs. first misses.
        self._hits = model_alpha * prior_steps / (1.0 - model_alpha)
        self._misses = prior_steps
        # Model drafting seconds per token: the median of recent steps (0 until measured,
        # so the model gets tried). A median, because the first model step after a run of
        # cache steps also feeds the drafter every token it missed, an outlier.
        self._token_costs: deque[float] = deque(maxlen=9)

    @property
    def model_alpha(self) -> float:
        """Current estimate of the model drafter's per-token acceptance rate."""
        return self._hits / (self._hits + self._misses)

    @property
    def model_token_s(self) -> float:
        """Current estimate of the model drafter's seconds per drafted token."""
        if not self._token_costs:
            return 0.0
        return sorted(self._token_costs)[len(self._token_costs) // 2]

    def choose(self, cache: Draft, model_len: int, phi: list[float] | None) -> Choice:
        """The source and length with the highest expected committed tokens per second."""
        options = [(1.0 / self.cost(1), Choice(NONE, 0))]  # plain decoding: 1 token/forward
        y = math.nan
        if cache.tokens:
            n = len(cache.tokens)
            y = min(self.predictor.predict(phi), n) if phi is not None else 0.0
            k, rate = best_length(solve_alpha(y, n), n, self.cost)
            # Copy runs are bursty, not geometric: a long match is either refuted within a
            # few tokens or accepted to its end, so the geometric model undervalues the
            # tail and truncates relay drafts too hard (measured: 0.82x `suffix` on the
            # relay). Keep at least keep_factor x the predicted accepted length.
            k = max(k, min(n, math.ceil(self.keep_factor * y)))
            options.append((rate, Choice(CACHE, k, y)))
        if model_len > 0:
            k, rate = best_length(self.model_alpha, model_len, self.cost, self.model_token_s)
            options.append((rate, Choice(MODEL, k, y)))
        # max keeps the first of equal rates: none < cache < model in list order, so ties
        # go to the cheaper source.
        best = max(options, key=lambda o: o[0])[1]
        return Choice(best.source, best.length, y)

    def update(self, source: str, draft_len: int, accepted: int, draft_s: float) -> None:
        """Learn the model drafter's acceptance rate and drafting cost from its steps."""
        if source != MODEL or draft_len == 0:
            return
        self._hits = self.decay * self._hits + accepted
        self._misses = self.decay * self._misses + (1.0 if accepted < draft_len else 0.0)
        if math.isfinite(draft_s):  # nan: a step whose time is not a per-token cost
            self._token_costs.append(draft_s / draft_len)


def _memo(cost: Cost) -> Cost:
    """Cache c(k) per k: the target interpolates a measured curve on every call."""
    table: dict[int, float] = {}

    def lookup(k: int) -> float:
        if k not in table:
            table[k] = float(cost(k))
        return table[k]

    return lookup
