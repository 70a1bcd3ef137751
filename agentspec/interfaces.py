"""The Protocols that components implement. Dispatch goes through these, never through
``getattr`` probes or ``isinstance`` checks on concrete classes.

Terms:

* **target**: the model being accelerated; it holds a KV cache of the tokens fed so far.
  Required: :class:`Target`. Optional capabilities the engine checks with ``isinstance``:
  :class:`PositionLimited` (a context window), :class:`PrefixReuseTarget` (prompt
  prefixes' KV reused across requests of a tenant; :class:`FeatureReuseTarget`: with the
  hidden states of the reused positions), :class:`BatchTarget` (K cache rows scored in
  one forward: tree drafts, multi-draft) and :class:`FeatureTarget` (hidden states).
* **drafter**: a source of draft tokens (:class:`Drafter`); optional capabilities:
  :class:`MultiDrafter` (K i.i.d. drafts), :class:`FeatureDrafter` (drafts from the target's
  hidden states) and :class:`RequestAware` (request-scoped state).
* **verifier**: turns a draft and the target's logits into committed tokens
  (:class:`Verifier`); optional: :class:`RequestAware` and :class:`RequestEnding` (state
  kept per request between steps: the ASD regret budget).

Request state is keyed by request id everywhere (the id the engine or vLLM gives a request:
:attr:`~agentspec.types.DraftContext.state_key` for drafters, ``request_id`` for
verifiers): no part holds "the current request", so requests may interleave.
* **store**: where finished turns persist (:class:`TurnStore`); the runtime writes it,
  the session cache reads it.

The chat runtime's contract (:class:`agentspec.chat.api.ChatRuntime`) lives with the chat
types it returns, above this module: contracts here import only :mod:`agentspec.types`.

Tensor shapes use ``k`` for the number of draft tokens, ``K`` for the number of drafts (cache
rows), ``V`` for the vocabulary size and ``H`` for the hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from agentspec.types import Draft, DraftContext, SamplingParams, SessionRef, VerifyResult

if TYPE_CHECKING:
    import torch


@runtime_checkable
class ServedModel(Protocol):
    """What the faces read of a served model (reported to clients, keys of its artifacts)."""

    @property
    def name(self) -> str:
        """The model's name (the embedded model's, or its folder's)."""
        ...


@runtime_checkable
class Target(ServedModel, Protocol):
    """The model being accelerated, holding a KV cache of the tokens fed so far."""

    @property
    def vocab_size(self) -> int:
        """Number of logits per position."""
        ...

    @property
    def num_cached(self) -> int:
        """Positions currently held in the KV cache."""
        ...

    def prefill(self, tokens: Sequence[int], *, scope: str | None = None) -> torch.Tensor:
        """Start a request whose cache holds ``tokens``; return the last position's logits
        ``[V]``. ``scope`` (the tenant) lets a target that keeps KV across requests reuse
        a prefix fed under the same scope; ``None``, or a target without reuse, feeds
        every token on a reset cache. The logits are the same either way up to rounding
        (reused KV is recomputed KV up to the rounding of a k-row forward, which can flip
        a near-tie: docs/prefix-cache.md)."""
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
class ContextCostTarget(Protocol):
    """A target that knows what a forward costs at a given context length: the draft gate
    (:mod:`agentspec.drafters.gate`) prices drafts with it."""

    def context_cost(self, k: int, context: int) -> float:
        """Seconds of one forward over ``k`` new tokens on a cache of ``context``
        positions, ``c(k, L)``."""
        ...


@runtime_checkable
class ModelTarget(Target, Protocol):
    """A target running an in-process transformers model: drafters built from its own
    weights (the distilled drafter, an EAGLE head) and tokenizer-aware parts need it."""

    @property
    def model(self) -> Any:
        """The transformers causal LM (eval mode)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        ...


@runtime_checkable
class PositionLimited(Protocol):
    """A target with a context window: requests past it fail before any forward."""

    @property
    def max_positions(self) -> int:
        """Most positions (prompt + generated tokens) one request may hold."""
        ...


@runtime_checkable
class PrefixReuseTarget(Target, Protocol):
    """A target that reuses KV of earlier requests' prefixes (scoped by tenant)."""

    @property
    def reused_tokens(self) -> int:
        """Tokens of the latest :meth:`Target.prefill` taken from reused KV, not fed."""
        ...


@runtime_checkable
class FeatureReuseTarget(PrefixReuseTarget, Protocol):
    """A prefix-reusing target that keeps the final hidden states of the reused positions
    with their KV, so a request whose drafter reads them (an EAGLE head needs a row for
    every prompt position) can reuse a prefix too."""

    @property
    def reuse_keeps_features(self) -> bool:
        """Whether ``prefill(..., features=True)`` reuses prefixes with their rows."""
        ...

    def prefill(self, tokens: Sequence[int], *, scope: str | None = None,
                features: bool = False) -> torch.Tensor:
        """As :meth:`Target.prefill`; with ``features`` only a prefix whose rows are kept
        is reused, and :meth:`FeatureTarget.last_features` then covers every position
        of ``tokens``, as after a prefill without reuse."""
        ...


@runtime_checkable
class BatchTarget(Target, Protocol):
    """A target that scores K continuations of its cached prefix in one forward (tree
    drafts' branches, multi-draft's K drafts)."""

    def score_batch(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Expand the cache to ``K = len(rows)`` rows and append row j to cache row j; the
        rows have one length ``n``. Returns logits ``[K, n, V]``."""
        ...

    def select_row(self, row: int) -> None:
        """Keep cache row ``row`` of the last :meth:`score_batch` only (back to one row)."""
        ...


@runtime_checkable
class TreeTarget(Target, Protocol):
    """A target that verifies a token tree in one row with tree attention: each node sees
    the cached prefix and its own ancestors, so a tree costs one forward over its nodes
    (branch rows would pay for every branch's shared prefix again)."""

    def score_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Append the tree (``tokens[0]`` the root, ``parents[0] == -1``, parents before
        children) to the cached prefix; returns logits ``[len(tokens), V]``."""
        ...

    def keep_tree_path(self, path: Sequence[int]) -> None:
        """Keep the root and the tree nodes ``path`` (indices into the last
        :meth:`score_tree`'s tokens, root side first) in the cache, drop the rest."""
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
class MultiDrafter(Protocol):
    """A drafter that draws K i.i.d. drafts per step (multi-draft verification)."""

    name: str

    def propose_many(
        self, ctx: DraftContext, max_tokens: int, num_drafts: int, rng: torch.Generator
    ) -> list[Draft]:
        """``num_drafts`` i.i.d. chain drafts of one length (at most ``max_tokens``), each
        with ``probs`` ``[k, V]`` filled, or ``None`` for a point mass; ``[]``: no draft."""
        ...

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Learn from the committed tokens."""
        ...

    def finish(self, ctx: DraftContext) -> None:
        """The request ended."""
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
        *,
        request_id: str | None = None,
    ) -> VerifyResult:
        """Accept a prefix (or tree path) of the draft plus one target-chosen token.
        ``request_id`` names the request the step belongs to (the id its
        :meth:`RequestAware.begin_request` received); stateless verifiers ignore it."""
        ...


@runtime_checkable
class Constraint(Protocol):
    """A request's output grammar (structured outputs, tool calls): the engine masks the
    target's logits with it at every verified position (see :mod:`agentspec.chat.grammar`)."""

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
        :meth:`Target.prefill` / :meth:`Target.score` (the kept row after a batch); after a
        :class:`FeatureReuseTarget`'s ``prefill(..., features=True)``, of every position
        of the prompt, the reused ones included."""
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

    def observe_features(self, ctx: DraftContext, start: int, features: torch.Tensor) -> None:
        """Feature rows ``[m, H]`` of ``ctx``'s request's committed positions
        ``start .. start+m-1`` (its stream is keyed by ``ctx.state_key``).
        ``start == 0`` begins the request's stream (the prefill's rows)."""
        ...


@runtime_checkable
class RequestAware(Protocol):
    """A drafter or verifier with request-scoped state (optional): the ASD regret budget,
    a sampling drafter's generator. The engine calls this before each request's prefill."""

    def begin_request(
        self, session: SessionRef | None, rng: torch.Generator | None,
        request_id: str | None = None,
    ) -> None:
        """A request of ``session`` starts; ``rng`` is its seeded generator (``None``
        for greedy requests). ``request_id`` is the id its contexts will carry
        (:attr:`~agentspec.types.DraftContext.state_key`: keep the request's state under
        it)."""
        ...


@runtime_checkable
class TurnStore(Protocol):
    """Persistent storage of finished turns (implemented by
    :class:`agentspec.storage.sessions.SessionStore`). The runtime appends every finished
    turn; the session cache loads a session's turns when it first meets the session."""

    def load(self, ref: SessionRef) -> list[list[int]]:
        """Token ids of every stored turn of ``ref``'s session, oldest first."""
        ...

    def append_turn(self, ref: SessionRef, tokens: list[int]) -> None:
        """Persist one finished turn (prompt + output) of ``ref``'s session."""
        ...
