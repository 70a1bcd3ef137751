"""Hybrid Verified Decoding as a drafter: a cache drafter, a model drafter and a policy.

Each step the cache drafter drafts first (microseconds); the policy
(:class:`~agentspec.payoff.policy.SourcePolicy`) then decides — from the cache draft, its
features φ_t and, for the cost-aware policy, the target's c(k) — whether to verify the
cache draft (possibly truncated), to draft with the model instead, or to decode plainly.
The model drafter only runs when chosen, so a step the cache wins costs no model forward.

The returned :class:`~agentspec.types.Draft` keeps the winning sub-drafter's ``source``,
so the engine's per-step records (``StepStats.source`` / ``drafter_wins``) show which
source won each step. ``observe`` / ``finish`` / ``begin_request`` go to *both*
sub-drafters every step, whichever won: the cache indexes every committed token and the
model drafter re-syncs its KV cache from the context, so neither falls out of step. An
EAGLE model drafter also receives the target's features of every committed position
(``observe_features``), whichever source won.

Policy state is per tenant: the cost-aware policy learns acceptance rates, model cost and
its calibration from the traffic it sees, and one tenant's traffic must not move another's
estimates. With a ``policy_factory`` the drafter keeps one policy per tenant (made on the
tenant's first request, at most ``max_tenants`` kept, least recently used dropped).

Request state (the step history the features read, the pending step, the cache drafts
waiting for their label, the request's tenant policy) is kept per request, keyed by
:attr:`~agentspec.types.DraftContext.state_key` like the session cache's: nothing on the
instance is "the current request", so requests may interleave.

With a :class:`~agentspec.drafters.gate.DraftGate` (the product's default under lossless
greedy-or-sampled single-draft verification), every cache draft is also priced by the gate,
whole, at the request's context length with the tenant's calibration, as the engine gates
the ``suffix`` method's drafts; a cache step verifies the shorter of the policy's cut and the
gate's (none at all when the gate declines the draft). The gate sees the whole draft so its
labels are the whole draft's, as under ``suffix``.

Verification is untouched, so HVD is exactly as lossless as the verifier it runs under.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentspec.drafters.gate import DraftGate
from agentspec.errors import ConfigError
from agentspec.interfaces import Drafter, FeatureDrafter, RequestAware
from agentspec.lru import LRU
from agentspec.payoff.features import TokenTable, features
from agentspec.payoff.labels import ShadowLabels
from agentspec.payoff.policy import CACHE, MODEL, NONE, SourcePolicy
from agentspec.requests import REQUESTS, Slot
from agentspec.types import Draft, DraftContext, SessionRef, VerifyResult

__all__ = ["HybridDrafter"]

_RECENT_KEEP = 16  # steps of (draft_len, accepted) kept for the features


@dataclass
class _Request:
    """One request's state.

    Attributes:
        policy: The policy of the request's tenant.
        recent: ``(draft_len, accepted)`` of its latest steps (the features read them).
        pending: ``(source, draft_len, draft_s)`` of the step drafted, not yet verified.
        last_source: The previous step's source.
        shadow: The cache drafts of recent steps waiting for their full-length label
            (:class:`~agentspec.payoff.labels.ShadowLabels`).
    """

    policy: SourcePolicy
    recent: list[tuple[int, int]] = field(default_factory=list)
    pending: tuple[str, int, float] | None = None
    last_source: str = NONE
    shadow: ShadowLabels = field(default_factory=ShadowLabels)


class HybridDrafter:
    """Chooses between a cache drafter and a model drafter each step.

    Args:
        cache: The cache drafter (e.g. :class:`~agentspec.drafters.SuffixDrafter`).
        model: The model drafter (e.g. :class:`~agentspec.drafters.model.causal.ModelDrafter`).
        policy: Which source to verify (learned, cost-aware or a hand rule).
        table: Character classes of the vocabulary (features); a blank table when the
            policy needs no features.
        model_max: Most tokens the model drafter drafts per step.
        name: This drafter's name (the sources of its drafts are the sub-drafters').
        policy_factory: Makes a fresh policy like ``policy``: with it each tenant gets its
            own (``policy`` serves requests without a session); without it ``policy`` is
            shared by every request.
        max_tenants: Most per-tenant policies kept (least recently used are dropped).
        gate: Prices every cache draft at the request's context (module docstring);
            ``None``: the policy alone cuts them.

    Attributes:
        policy: The policy of requests without a session (and of every request without a
            ``policy_factory``).
        wins: Steps won per source (``"cache"``, ``"model"``, ``"none"``) since creation.
        last_choice: The policy's latest :class:`~agentspec.payoff.policy.Choice`, of any
            request (a diagnostic: nothing reads it back).
    """

    def __init__(
        self,
        cache: Drafter,
        model: Drafter,
        policy: SourcePolicy,
        table: TokenTable | None = None,
        model_max: int = 6,
        name: str = "hybrid",
        policy_factory: Callable[[], SourcePolicy] | None = None,
        max_tenants: int = 1024,
        gate: DraftGate | None = None,
    ) -> None:
        if model_max < 1:
            raise ConfigError(f"model_max must be >= 1, got {model_max!r}")
        if max_tenants < 1:
            raise ConfigError(f"max_tenants must be >= 1, got {max_tenants!r}")
        if policy.needs_features and table is None:
            raise ConfigError(f"policy {policy.name!r} needs features: pass a TokenTable")
        self.cache = cache
        self.model = model
        self.policy = policy
        self.table = table
        self.model_max = model_max
        self.name = name
        self.policy_factory = policy_factory
        self.max_tenants = max_tenants
        self.gate = gate
        # What the sub-drafters can do, asked once (not per step or request).
        self._feature_model = model if isinstance(model, FeatureDrafter) else None
        self._starters = tuple(p for p in (cache, model) if isinstance(p, RequestAware))
        self._policies: LRU[str, SourcePolicy] = LRU(max_tenants)  # tenant -> policy
        self._requests: Slot[_Request] = REQUESTS.slot("hybrid")
        self.wins: dict[str, int] = {CACHE: 0, MODEL: 0, NONE: 0}
        self.last_choice: Any = None

    def _request(self, ctx: DraftContext) -> _Request:
        """The state of ``ctx``'s request; a new one at its first step (or when unknown)."""
        key = ctx.state_key
        req = self._requests.touch(key)
        if req is None or ctx.step == 0:
            req = _Request(self.policy_for(ctx.session))
            self._requests.put(key, req)
        return req

    # -- the Drafter protocol -------------------------------------------------------------

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Draft with the source the policy picks (at most ``max_tokens`` tokens)."""
        req = self._request(ctx)
        if max_tokens < 1:
            req.pending = None
            return Draft(source=NONE)
        cache = self.cache.propose(ctx, max_tokens)
        gate_len = len(cache.tokens)
        if self.gate is not None and cache.tokens:
            gate_len = len(self.gate.cut(ctx, cache).tokens)
        phi = None
        if req.policy.needs_features and self.table is not None:
            phi = features(ctx.tokens, ctx.prompt_len, cache, req.recent, self.table)
        model_len = min(self.model_max, max_tokens)
        choice = req.policy.choose(cache, model_len, phi, len(ctx.tokens))
        self.last_choice = choice
        if cache.tokens and math.isfinite(choice.raw):
            req.shadow.add(len(ctx.tokens), cache, choice.raw, choice.score)
        source = choice.source
        if source == CACHE and gate_len == 0:
            source = NONE  # the gate: plain decoding commits more per second here
        t0 = time.perf_counter()
        timed = True
        if source == CACHE:
            draft = cache.truncated(min(max(1, choice.length), gate_len))
        elif source == MODEL:
            draft = self.model.propose(ctx, max(1, min(choice.length, model_len)))
            # A model draft after a step of another source (or the request's first) also
            # syncs the drafter with every token committed meanwhile: the whole prompt, or a
            # cache step's 30-token copy (a KV-cache prefill, an EAGLE head's catch-up). That
            # is not a per-token drafting cost; learned as one it priced the model out of
            # every later step. Only back-to-back model steps are cost samples.
            timed = req.last_source == MODEL
        else:
            draft = Draft(source=NONE)
        self.wins[source] = self.wins.get(source, 0) + 1
        req.last_source = source
        draft_s = time.perf_counter() - t0 if timed else math.nan
        req.pending = (source, len(draft.tokens), draft_s)
        return draft

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Forward to both sub-drafters; record the step for features and the policy."""
        self.cache.observe(ctx, result)
        self.model.observe(ctx, result)
        if self.gate is not None:
            self.gate.observe(ctx, result)
        req = self._requests.get(ctx.state_key)
        if req is None:  # observed without a propose: nothing of this drafter's to learn
            return
        if req.pending is not None:
            source, k, draft_s = req.pending
            req.recent.append((k, result.num_accepted))
            del req.recent[:-_RECENT_KEEP]
            req.policy.update(source, k, result.num_accepted, draft_s)
            req.pending = None
        # The full-length label of every earlier cache draft whose continuation is now
        # committed (verified or not: a cut draft or a step the model won still says how
        # good the cache draft was).
        if req.shadow:
            req.shadow.label(req.policy.outcome, ctx.tokens, result.tokens)

    def finish(self, ctx: DraftContext) -> None:
        """Forward to both sub-drafters; the request's state ends (unlabelled cache drafts
        with it: their continuation never came)."""
        self.cache.finish(ctx)
        self.model.finish(ctx)
        if self.gate is not None:
            self.gate.finish(ctx)
        self._requests.pop(ctx.state_key)

    @property
    def wants_features(self) -> bool:
        """Whether the model drafter drafts from the target's hidden states (EAGLE)."""
        return self._feature_model is not None and self._feature_model.wants_features

    def observe_features(self, ctx: DraftContext, start: int, features: Any) -> None:
        """Forward the target's features to the model drafter every step, whichever source
        won, so its head's cache stays in step with the committed tokens."""
        if self._feature_model is not None:
            self._feature_model.observe_features(ctx, start, features)

    def policy_for(self, session: SessionRef | None) -> SourcePolicy:
        """The policy serving ``session``'s tenant (made on the tenant's first request)."""
        if self.policy_factory is None or session is None:
            return self.policy
        return self._policies.get_or_put(session.tenant, self.policy_factory)

    def begin_request(
        self, session: SessionRef | None, rng: Any, request_id: str | None = None
    ) -> None:
        """Forward the request start to the sub-drafters that take it (this drafter's own
        request state starts with the request's first :meth:`propose`)."""
        for part in self._starters:
            part.begin_request(session, rng, request_id=request_id)
