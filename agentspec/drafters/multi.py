"""Any drafter as a source of K i.i.d. drafts, so ``sampler="multi_draft"`` works with every
drafting method.

Multi-draft verification (SpecTr-GBV, :mod:`agentspec.verifiers.multi_draft`) needs K drafts
drawn i.i.d. from the drafter's distribution ``q`` (:class:`~agentspec.interfaces.
MultiDrafter`). :class:`IIDDrafts` gets them from a plain :class:`~agentspec.interfaces.
Drafter`:

* a drafter with a batched sampler of its own (a sampling ``ModelDrafter``'s
  ``propose_many``) is used as is;
* a deterministic draft (``probs is None``: a point mass, e.g. the session cache's) *is* K
  i.i.d. draws of itself, so it is repeated K times;
* a sampled draft (``probs`` filled) is drawn K times by K calls, each from the request's
  generator (the drafter re-syncs to ``ctx`` every call), then cut to their common length.

Either way the verifier sees drafts distributed as the drafter says, which is all its
losslessness needs.
"""

from __future__ import annotations

from typing import Any

import torch

from agentspec.interfaces import Drafter, FeatureDrafter, MultiDrafter, RequestAware
from agentspec.types import Draft, DraftContext, SessionRef, VerifyResult

__all__ = ["IIDDrafts"]


class IIDDrafts:
    """A :class:`~agentspec.interfaces.MultiDrafter` over one drafter.

    Args:
        drafter: The drafter whose distribution the K drafts are drawn from.

    Attributes:
        calls: ``propose_many`` calls so far (multi-draft steps that asked for drafts).
    """

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self.calls = 0

    def propose_many(
        self, ctx: DraftContext, max_tokens: int, num_drafts: int, rng: torch.Generator
    ) -> list[Draft]:
        """``num_drafts`` i.i.d. chain drafts of one length (``[]``: no draft this step)."""
        self.calls += 1
        inner = self.drafter
        config = getattr(inner, "config", None)
        if isinstance(inner, MultiDrafter) and getattr(config, "temperature", 0.0) > 0:
            return inner.propose_many(ctx, max_tokens, num_drafts, rng)
        first = inner.propose(ctx, max_tokens)
        if not first.tokens or first.is_tree:
            return []  # trees are verified greedily by the single-draft engine only
        if first.probs is None:  # a point mass: K i.i.d. draws are K copies
            return [first] * num_drafts
        drafts = [first] + [inner.propose(ctx, max_tokens) for _ in range(num_drafts - 1)]
        k = min(len(d.tokens) for d in drafts)
        return [d.truncated(k) for d in drafts] if k > 0 else []

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Forward the committed tokens to the drafter."""
        self.drafter.observe(ctx, result)

    def finish(self, ctx: DraftContext) -> None:
        """Forward the request's end to the drafter."""
        self.drafter.finish(ctx)

    def begin_request(
        self, session: SessionRef | None, rng: torch.Generator | None,
        request_id: str | None = None,
    ) -> None:
        """Forward the request's start (and its seeded generator) to the drafter."""
        if isinstance(self.drafter, RequestAware):
            self.drafter.begin_request(session, rng, request_id=request_id)

    @property
    def wants_features(self) -> bool:
        """Whether the drafter drafts from the target's hidden states."""
        return isinstance(self.drafter, FeatureDrafter) and self.drafter.wants_features

    def observe_features(self, ctx: DraftContext, start: int, features: Any) -> None:
        """Forward the target's features of committed positions to the drafter."""
        if isinstance(self.drafter, FeatureDrafter):
            self.drafter.observe_features(ctx, start, features)
