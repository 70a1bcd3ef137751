"""The Protocols that components implement. Dispatch goes through these, never through
``isinstance`` checks on method names.

Tensor shapes use ``k`` for the number of draft tokens and ``V`` for the vocabulary size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from agentspec.types import Draft, DraftContext, SamplingParams, SessionRef, VerifyResult

if TYPE_CHECKING:
    import torch


@runtime_checkable
class Target(Protocol):
    """The model being accelerated, holding a KV cache of the tokens fed so far."""

    @property
    def vocab_size(self) -> int:
        """Number of logits per position."""
        ...

    @property
    def num_cached(self) -> int:
        """Positions currently held in the KV cache."""
        ...

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        """Reset the cache, feed ``tokens``; return the last position's logits ``[V]``."""
        ...

    def score(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` to the cache in one forward; return logits ``[len, V]``."""
        ...

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` cached positions exactly."""
        ...

    def verify_cost(self, k: int) -> float:
        """Measured seconds of one forward over ``k`` new tokens, ``c(k)``."""
        ...


@runtime_checkable
class Drafter(Protocol):
    """A source of draft tokens. Drafters never see target logits."""

    name: str

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Propose at most ``max_tokens`` tokens continuing ``ctx.tokens``."""
        ...

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Learn from the committed tokens (``ctx`` is the context before the commit)."""
        ...

    def finish(self, ctx: DraftContext) -> None:
        """The request ended; ``ctx.tokens`` is the prompt plus the final output."""
        ...


@runtime_checkable
class Verifier(Protocol):
    """Turns a draft and the target's logits into committed tokens."""

    lossless: bool

    def verify(
        self,
        draft: Draft,
        logits: torch.Tensor,  # [k+1, V]: row i predicts the token after draft prefix i
        sampling: SamplingParams,
        rng: torch.Generator | None,
    ) -> VerifyResult:
        """Accept a prefix (or tree path) of the draft plus one target-chosen token."""
        ...


@runtime_checkable
class Constraint(Protocol):
    """A request's output grammar (structured outputs, tool calls): the engine masks the
    target's logits with it at every verified position (see :mod:`agentspec.grammar`)."""

    def prepare(self, draft: Draft) -> Draft:
        """Walk the grammar along ``draft``; return it cut at its first forbidden token."""
        ...

    def mask(self, logits: torch.Tensor) -> None:
        """Mask the rows ``[k+1, V]`` of the prepared draft in place (forbidden: -inf)."""
        ...

    def commit(self, result: VerifyResult) -> None:
        """Advance the grammar over the committed tokens, rolling back the rejected."""
        ...


@runtime_checkable
class FeatureTarget(Protocol):
    """A target that exposes its final hidden states (the features an EAGLE-style head
    drafts from). Optional: the engine feeds features only when both sides support them."""

    def last_features(self) -> torch.Tensor:
        """The final-norm hidden states ``[n, H]`` of the positions fed by the latest
        :meth:`Target.prefill` / :meth:`Target.score` (the kept row after a batch)."""
        ...


@runtime_checkable
class FeatureDrafter(Protocol):
    """A drafter that drafts from the target's hidden states.

    Drafters still never see logits; they see the target's features of *committed*
    positions only, in order: after the prefill the rows of positions ``0..n-2`` (all of
    the prompt but its last token, which is the first pending token), after each step the
    rows of ``pending`` and the accepted draft tokens.
    """

    @property
    def wants_features(self) -> bool:
        """Whether the engine should fetch and pass features (False skips the copy)."""
        ...

    def observe_features(self, start: int, features: torch.Tensor) -> None:
        """Feature rows ``[m, H]`` of the committed positions ``start .. start+m-1``.
        ``start == 0`` begins a new request."""
        ...


@runtime_checkable
class RequestAware(Protocol):
    """A drafter or verifier with request-scoped state (optional): the ASD regret budget,
    a sampling drafter's generator. The engine calls this before each request's prefill."""

    def begin_request(self, session: SessionRef | None, rng: torch.Generator | None) -> None:
        """A request of ``session`` starts; ``rng`` is its seeded generator (``None``
        for greedy requests)."""
        ...
