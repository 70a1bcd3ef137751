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

Acceptance models. Greedy acceptance stops at the first miss, so E[min(accepted, k)] =
Σ_{j=1..k} P(accepted ≥ j).

* The model drafter: a constant per-token rate α, P(accepted ≥ j) = α^j, so
  E_k = Σ_{j≤k} α^j. α is estimated online from its verified steps (accepted tokens over
  accepted tokens plus first misses, a Beta-style prior and exponential forgetting).
* The cache draft: copy runs are bursty, not geometric. A long match is either refuted
  within a few tokens (the copied text diverged) or accepted to its end (the model re-emits
  the document), so a single rate undervalues the tail and truncates long copy drafts
  hard (on copying workloads a geometric model lost to the ungated cache). The cache draft's
  model is a mixture: with probability q the whole draft of length n is right, otherwise
  acceptance is geometric with the *refuted-draft* rate β,

      P(accepted ≥ j) = q + (1 − q) β^j  (j ≤ n),   E_k = q·k + (1 − q) Σ_{j≤k} β^j.

  β is learned online from the cache steps that were refuted (same estimator as α); q is
  solved from the predictor's ŷ for the full draft: q = (ŷ − G_n(β)) / (n − G_n(β)) with
  G_n(β) = Σ_{j≤n} β^j. When ŷ < G_n(β) the draft is worse than a typical refuted one and
  q = 0 with a geometric rate solved from ŷ instead (the two agree at ŷ = G_n(β)).

Online calibration. The predictor is trained offline on a few dozen sessions, so on a new
workload it can be off by a factor (it can underrate long copies, and cut them). The policy
therefore keeps a calibration factor r = Σ y / Σ ŷ over recent cache drafts and uses r·ŷ,
where y is the draft's *full-length* accepted length — the label the predictor was trained
on. Verification only shows y censored at the verified length (a cut draft that is wholly
accepted says "y ≥ k"), and nothing at all when the model drafted instead, so
:class:`~agentspec.drafters.hybrid.HybridDrafter` recovers y from the tokens committed in
the following steps (the label trace replay computes offline) and reports it through
:meth:`CostAwarePolicy.outcome`. Decayed sums with a prior of r = 1: this is
calibration-in-the-large per policy instance; the predictor still ranks drafts, r fixes its
scale on the traffic at hand.

Fallback to the cache's own score. On a workload unlike its training data the predictor
can rank drafts badly, which no scale factor fixes (on document domains it never saw it
accepted clearly less per step than the ungated cache; ``docs/hvd.md``). The suffix
index's score (the sum of its path probabilities) is a second estimate of the same y, the
one the ungated cache effectively trusts. Both are calibrated the same way. A smaller
error in y is not what matters (an estimate can err less on average and still cut the
wrong drafts); the decisions are. A full-length label y tells what *any* cut of the draft
would have committed (min(y, k) + 1 tokens in c(k + 1) seconds; plain decoding: 1 in
c(1)), so every labelled draft scores both estimates' decisions counterfactually, before
either calibration moves, and so is a third rule, verifying every cache draft whole (the
ungated cache). The policy gates by whichever of the three would have committed the most
tokens per second over the last ~50 drafts (:attr:`CostAwarePolicy.estimator`), the
predictor on a tie: hybrid does not stay worse than the cache it gates.

Truncating a draft at the k maximising (E_k + 1) / c(k + 1) is the "predicted useful
length": under the mixture the qk term keeps long likely-copied drafts whole, because c(k)
grows far slower than k on this hardware.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from agentspec.errors import ConfigError
from agentspec.payoff.predictor import PayoffPredictor
from agentspec.types import ContextCost, Draft

CACHE, MODEL, NONE = "cache", "model", "none"
GATE_MARGIN = 0.1
GATES = ("predictor", "score", "whole")  # how the cost-aware policy gates cache drafts
Cost = Callable[[int], float]  # c(k): seconds of one target forward over k tokens
PRELOAD_K = 32  # draft lengths whose c(k + 1) is read when a policy is built


@dataclass(frozen=True)
class Choice:
    """What to verify this step.

    Attributes:
        source: ``"cache"``, ``"model"`` or ``"none"`` (plain one-token decoding).
        length: Draft tokens to verify (the cache draft is cut to it; the model drafts it).
        predicted: ŷ of the cache draft as the policy used it (after calibration;
            ``nan`` when no predictor was consulted).
        raw: The predictor's own ŷ for the whole cache draft (``nan``: none).
        score: The cache draft's own score (its index's expected accepted length).
    """

    source: str
    length: int
    predicted: float = math.nan
    raw: float = math.nan
    score: float = math.nan


@runtime_checkable
class SourcePolicy(Protocol):
    """Chooses the draft source each step and learns from verified steps."""

    name: str
    needs_features: bool

    def choose(self, cache: Draft, model_len: int, phi: list[float] | None,
               context: int = 0) -> Choice:
        """Pick a source for the step.

        Args:
            cache: The cache drafter's draft (possibly empty).
            model_len: Most tokens the model drafter may draft this step (0: unavailable).
            phi: Features of ``cache`` when ``needs_features`` (else ``None``).
            context: Tokens the request holds (prompt and committed tokens): what the
                step's verify forward attends to.
        """
        ...

    def update(self, source: str, draft_len: int, accepted: int, draft_s: float) -> None:
        """A step of ``source`` verified ``draft_len`` tokens and accepted ``accepted``;
        drafting it took ``draft_s`` seconds (``nan``: not representative, e.g. the
        model drafter's first step of a request, which also syncs it with the prompt)."""
        ...

    def outcome(self, raw: float, accepted: int, score: float = math.nan,
                length: int = 0) -> None:
        """A cache draft of ``length`` tokens the predictor rated ``raw``
        (:attr:`Choice.raw`) and its index scored ``score`` would have had ``accepted``
        tokens accepted at its full length, whichever source was verified."""
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


@dataclass(frozen=True)
class CopyAcceptance:
    """The cache draft's acceptance mixture: P(accepted ≥ j) = q + (1 − q) β^j, j ≤ n.

    Attributes:
        full: q, the probability that the whole draft is accepted.
        rate: β, the per-token rate of a draft that will be refuted.
    """

    full: float
    rate: float

    def expected(self, k: int) -> float:
        """E[min(accepted, k)] = q·k + (1 − q) Σ_{j≤k} β^j."""
        return self.full * k + (1.0 - self.full) * expected_accepted(self.rate, k)


def fit_copy_acceptance(y_hat: float, length: int, miss_rate: float) -> CopyAcceptance:
    """The mixture whose E_length equals ŷ, given the refuted-draft rate β = ``miss_rate``.

    q = (ŷ − G) / (length − G) with G = Σ_{j≤length} β^j; when ŷ ≤ G, q = 0 and the rate
    is solved from ŷ alone (a draft predicted worse than a typical refuted one).
    """
    if length <= 0 or y_hat <= 0.0:
        return CopyAcceptance(0.0, 0.0)
    g = expected_accepted(miss_rate, length)
    if y_hat <= g or g >= length:
        return CopyAcceptance(0.0, solve_alpha(y_hat, length))
    return CopyAcceptance(min(1.0, (y_hat - g) / (length - g)), miss_rate)


def best_length(
    expected: Callable[[int], float], max_len: int, cost: Cost, per_token_s: float = 0.0
) -> tuple[int, float]:
    """The draft length k in 1..max_len maximising (E_k + 1) / (c(k + 1) + k · per_token_s),
    and that rate (expected committed tokens per second); ``expected(k)`` is E_k."""
    best_k, best_rate = 0, -1.0
    for k in range(1, max_len + 1):
        rate = (expected(k) + 1.0) / (cost(k + 1) + k * per_token_s)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k, best_rate


def geometric(alpha: float) -> Callable[[int], float]:
    """E_k under a constant per-token acceptance rate α."""
    return lambda k: expected_accepted(alpha, k)


class _RateEstimate:
    """A per-token acceptance rate from verified steps: accepted tokens over accepted tokens
    plus first misses, with Beta-style prior pseudo-counts and exponential forgetting."""

    def __init__(self, prior: float, prior_steps: float, decay: float) -> None:
        self.prior_hits = self.hits = prior * prior_steps / (1.0 - prior)
        self.prior_misses = self.misses = prior_steps
        self.decay = decay

    @property
    def rate(self) -> float:
        return self.hits / (self.hits + self.misses)

    def add(self, accepted: int, missed: bool) -> None:
        self.hits = self.decay * self.hits + accepted
        self.misses = self.decay * self.misses + (1.0 if missed else 0.0)

    def relax(self) -> None:
        """One step without evidence: drift back toward the prior. A source that is not
        chosen is not observed, and without this an estimate learned on one workload (a
        tool agent's JSON, which the model drafts badly) would price the source out of
        every later workload (open chat, which it drafts well) for good."""
        d = self.decay
        self.hits = d * self.hits + (1 - d) * self.prior_hits
        self.misses = d * self.misses + (1 - d) * self.prior_misses


class _Calibrated:
    """One estimate x of a cache draft's full-length accepted length y, calibrated online:
    r = Σ y / Σ x over recent outcomes (decayed sums relaxing to the prior r = 1).

    In exact arithmetic this is :class:`~agentspec.payoff.estimators.DecayedRatios`' ratio
    at r₀ = 1, but the prior enters every update here (S ← d·S + x + (1 − d)·P) and the
    ratio is clipped, so the floating-point numbers differ: it keeps its own formula."""

    def __init__(self, prior: float, decay: float) -> None:
        self.prior, self.decay = prior, decay
        self.seen = self.expected = prior

    @property
    def ratio(self) -> float:
        """r, clipped to [0.2, 5]."""
        return min(5.0, max(0.2, self.seen / self.expected))

    def add(self, x: float, y: int) -> None:
        """One outcome: the estimate was ``x`` (uncalibrated), the truth ``y``."""
        d = self.decay
        prior = (1 - d) * self.prior
        self.seen = d * self.seen + y + prior
        self.expected = d * self.expected + x + prior


class _Value:
    """The decayed mean tokens per second one gating rule's decisions would have committed
    (a longer memory than the calibration: single decisions are noisy)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.gain = self.weight = 0.0

    @property
    def value(self) -> float:
        """Mean committed tokens per second of recent decisions (0: none yet)."""
        return self.gain / self.weight if self.weight else 0.0

    def add(self, rate: float) -> None:
        """One decision that would have committed ``rate`` tokens per second."""
        self.gain = self.decay * self.gain + rate
        self.weight = self.decay * self.weight + 1.0


class ArcticRule:
    """Cache draft if its score ≥ the model draft's length, else the model (ArcticInference).

    The suffix tree's score is the sum of its path probabilities, i.e. the draft's expected
    accepted length under the tree's own frequencies, so the rule reads "trust the cache
    when it expects to beat a fully accepted model draft".
    """

    name = "arctic_rule"
    needs_features = False

    def choose(self, cache: Draft, model_len: int, phi: list[float] | None,
               context: int = 0) -> Choice:
        """Compare the cache score with the model's draft length."""
        if cache.tokens and (model_len == 0 or cache.score >= model_len):
            return Choice(CACHE, len(cache.tokens))
        return Choice(MODEL, model_len) if model_len else Choice(NONE, 0)

    def update(self, source: str, draft_len: int, accepted: int, draft_s: float) -> None:
        """Stateless."""

    def outcome(self, raw: float, accepted: int, score: float = math.nan,
                length: int = 0) -> None:
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

    def choose(self, cache: Draft, model_len: int, phi: list[float] | None,
               context: int = 0) -> Choice:
        """Threshold the predicted accepted length of the cache draft."""
        if not cache.tokens:
            return Choice(MODEL, model_len) if model_len else Choice(NONE, 0)
        y = self.predictor.predict(phi) if phi is not None else 0.0
        if y >= self.tau or model_len == 0:
            return Choice(CACHE, len(cache.tokens), y, y)
        return Choice(MODEL, model_len, y, y)

    def update(self, source: str, draft_len: int, accepted: int, draft_s: float) -> None:
        """Stateless."""

    def outcome(self, raw: float, accepted: int, score: float = math.nan,
                length: int = 0) -> None:
        """Stateless (the paper's rule uses τ as trained)."""


class CostAwarePolicy:
    """Maximise expected committed tokens per second (see the module docstring).

    Args:
        predictor: The payoff predictor (ŷ of the cache draft).
        cost: The target's measured c(k) in seconds (``HFTarget.verify_cost``): a curve
            measured once, at one context length, on a quiet machine.
        context_cost: c(k, L) as the machine is loaded now (``HFTarget.context_cost``);
            when given, each step is priced at its request's context length (the
            ``context`` of :meth:`choose`) instead of by ``cost``: a verified draft token
            attends to the whole cache, so long drafts cost more over long contexts, and
            a loaded machine changes every price. It must not measure anything.
        model_alpha: Prior per-token acceptance rate of the model drafter.
        prior_steps: Weight of the priors, in steps.
        decay: Per-step forgetting of the acceptance counts (adapts to the workload: chat
            and copying turns differ).
        miss_rate: Prior β, the per-token acceptance rate of cache drafts that get refuted.
        calibration_decay: Per-outcome forgetting of the calibration sums (0.9: about the
            last ten cache drafts); a very large ``calibration_prior`` turns calibration off.
        calibration_prior: Weight of the prior r = 1, in expected tokens.
        choice_decay: Per-outcome forgetting of the counterfactual values that pick the
            estimator (0.98: about the last 50 cache drafts).
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
        miss_rate: float = 0.5,
        calibration_decay: float = 0.9,
        calibration_prior: float = 8.0,
        choice_decay: float = 0.98,
        gate_margin: float = GATE_MARGIN,
        context_cost: ContextCost | None = None,
    ) -> None:
        for label, value in (("model_alpha", model_alpha), ("miss_rate", miss_rate)):
            if not 0.0 < value < 1.0:
                raise ConfigError(f"{label} must be in (0, 1), got {value!r}")
        if not 0.0 < choice_decay <= 1.0:
            raise ConfigError(f"choice_decay must be in (0, 1], got {choice_decay!r}")
        if calibration_prior <= 0 or not 0.0 < calibration_decay <= 1.0:
            raise ConfigError(f"need calibration_prior > 0 and calibration_decay in (0, 1], "
                              f"got {calibration_prior!r}, {calibration_decay!r}")
        if prior_steps <= 0 or not 0.0 < decay <= 1.0:
            raise ConfigError(f"need prior_steps > 0 and decay in (0, 1], got "
                              f"{prior_steps!r}, {decay!r}")
        self.predictor = predictor
        self.context_cost = context_cost
        # The cost of the step being priced (and of the labels that arrive meanwhile: a
        # few tokens later, at about the same context): c(k), or c(k, L) at the latest
        # step's context when ``context_cost`` is given.
        self.cost = _memo(cost)
        # Read c(k) now: a target measures its cost curve on first use (seconds), which
        # must not land inside the first decode step's drafting time.
        for k in range(1, 2 * PRELOAD_K + 2):
            self.cost(k)
        self._model = _RateEstimate(model_alpha, prior_steps, decay)
        self._refuted = _RateEstimate(miss_rate, prior_steps, decay)  # β of cache drafts
        # Model drafting seconds per token: the median of recent back-to-back model steps
        # (0 until measured, so the model gets tried); a median, so that one slow step (a
        # garbage collection, a busy machine) does not price the model out.
        self._token_costs: deque[float] = deque(maxlen=9)
        # The two calibrated estimates of y: the predictor's ŷ and the index's own score,
        # and what each gating rule's decisions would have committed (GATES order: the
        # first wins a tie).
        self._pred = _Calibrated(calibration_prior, calibration_decay)
        self._score = _Calibrated(calibration_prior, calibration_decay)
        self._values = {gate: _Value(choice_decay) for gate in GATES}
        if not 0.0 <= gate_margin < 1.0:
            raise ConfigError(f"gate_margin must be in [0, 1), got {gate_margin!r}")
        self.gate_margin = gate_margin

    @property
    def calibration(self) -> float:
        """r = Σ y / Σ ŷ over recent cache drafts (clipped to [0.2, 5])."""
        return self._pred.ratio

    @property
    def estimator(self) -> str:
        """How cache drafts are gated now (see the module docstring): ``"predictor"`` (cut
        by the calibrated ŷ), ``"score"`` (cut by the cache's calibrated score) or
        ``"whole"`` (verified whole, as the ungated cache does). Once whole drafts have
        been scored, a cutting rule must beat them by ``gate_margin`` (its edge has to
        exceed the noise of ~50 decisions: a cut that only ties costs accepted tokens and
        forwards for nothing); before any evidence, the predictor."""
        whole = self._values["whole"]
        if not whole.weight:
            return GATES[0]
        best, name = whole.value * (1.0 + self.gate_margin), "whole"
        for gate in GATES:
            v = self._values[gate]
            if gate != "whole" and v.weight and v.value > best:
                best, name = v.value, gate
        return name

    def _cut(self, y: float, n: int) -> tuple[int, float]:
        """The cache draft cut for an estimate ``y`` of an ``n``-token draft: ``(k, rate)``,
        k = 0 when plain decoding is expected to commit more tokens per second."""
        mix = fit_copy_acceptance(min(y, n), n, self.miss_rate)
        k, rate = best_length(mix.expected, n, self.cost)
        return (k, rate) if rate > 1.0 / self.cost(1) else (0, 1.0 / self.cost(1))

    def _realised(self, k: int, accepted: int) -> float:
        """Tokens per second a step cutting the draft to ``k`` would have committed, given
        its full-length accepted length (k = 0: plain decoding)."""
        return (min(accepted, k) + 1.0) / self.cost(k + 1)

    @property
    def model_alpha(self) -> float:
        """Current estimate of the model drafter's per-token acceptance rate."""
        return self._model.rate

    @property
    def miss_rate(self) -> float:
        """Current estimate of β, the per-token rate of cache drafts that get refuted."""
        return self._refuted.rate

    @property
    def model_token_s(self) -> float:
        """Current estimate of the model drafter's seconds per drafted token."""
        if not self._token_costs:
            return 0.0
        return sorted(self._token_costs)[len(self._token_costs) // 2]

    def choose(self, cache: Draft, model_len: int, phi: list[float] | None,
               context: int = 0) -> Choice:
        """The source and length with the highest expected committed tokens per second."""
        live = self.context_cost
        if live is not None:
            self.cost = _memo(lambda k: live(k, context))
        options = [(1.0 / self.cost(1), Choice(NONE, 0))]  # plain decoding: 1 token/forward
        y = raw = score = math.nan
        if cache.tokens:
            n = len(cache.tokens)
            raw = min(self.predictor.predict(phi), n) if phi is not None else 0.0
            score = min(cache.score, n)
            gate = self.estimator
            if gate == "predictor":
                y = min(self._pred.ratio * raw, n)
            else:
                y = min(self._score.ratio * score, n)
            if gate == "whole":
                # The ungated cache: the whole draft, never plain decoding, and against the
                # model drafter the rate whole drafts have realised lately (the estimates
                # of y are the ones that lost).
                k = n
                rate = max(self._values["whole"].value,
                           math.nextafter(options[0][0], math.inf))
            else:
                k, rate = self._cut(y, n)  # k = 0: plain decoding wins (it is listed first)
            options.append((rate, Choice(CACHE, k, y)))
        if model_len > 0:
            k, rate = best_length(geometric(self.model_alpha), model_len, self.cost,
                                  self.model_token_s)
            if options[-1][1].source == CACHE and options[-1][1].length > 0:
                # Displacing a cache draft that would be verified needs the same edge as a
                # cut (``gate_margin``): the model's rate is an estimate too, and a model
                # draft that only ties can displace a cache draft that would commit more.
                rate /= 1.0 + self.gate_margin
            options.append((rate, Choice(MODEL, k, y)))
        # max keeps the first of equal rates: none < cache < model in list order, so ties
        # go to the cheaper source.
        best = max(options, key=lambda o: o[0])[1]
        return Choice(best.source, best.length, y, raw, score)

    def update(self, source: str, draft_len: int, accepted: int, draft_s: float) -> None:
        """Learn the model drafter's rate and cost, and the refuted cache drafts' rate β."""
        if source != MODEL:
            self._model.relax()
        if draft_len == 0:
            return
        if source == CACHE:
            if accepted < draft_len:  # refuted: a sample of the geometric branch
                self._refuted.add(accepted, True)
            return
        if source != MODEL:
            return
        self._model.add(accepted, accepted < draft_len)
        if math.isfinite(draft_s):  # nan: a step whose time is not a per-token cost
            self._token_costs.append(draft_s / draft_len)


    def outcome(self, raw: float, accepted: int, score: float = math.nan,
                length: int = 0) -> None:
        """Calibrate: a cache draft of ``length`` tokens rated ``raw`` (scored ``score`` by
        its index) had ``accepted`` tokens right at full length.

        S ← d·S + x + (1 − d)·P for both sums: they relax to the prior P (r = 1) when
        evidence stops; with steady evidence r = (ȳ/(1−d) + P) / (ŷ̄/(1−d) + P). Each
        estimate's decision is scored before its ratio moves (``length`` 0: the score is
        not compared and the predictor keeps the gate).
        """
        if not math.isfinite(raw):
            return
        n = max(length, accepted)
        if n > 0 and math.isfinite(score):
            cuts = {"predictor": self._cut(self._pred.ratio * raw, n)[0],
                    "score": self._cut(self._score.ratio * score, n)[0], "whole": n}
            for gate in GATES:
                self._values[gate].add(self._realised(cuts[gate], accepted))
            self._score.add(score, accepted)
        self._pred.add(raw, accepted)


def _memo(cost: Cost) -> Cost:
    """Cache c(k) per k: the target interpolates a measured curve on every call."""
    table: dict[int, float] = {}

    def lookup(k: int) -> float:
        if k not in table:
            table[k] = float(cost(k))
        return table[k]

    return lookup
