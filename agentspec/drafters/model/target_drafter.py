"""A smaller model of the target's family as the model drafter, run as a target of its own.

:class:`~agentspec.drafters.model.causal.ModelDrafter` runs a transformers model through
its own forward and KV cache (one cache, re-synced to whatever context comes next). This
drafter runs the draft model through a :class:`~agentspec.interfaces.Target` instead: the
same forward, kernels and precision the target uses (a 0.5B model drafting for the 1.5B in
w8a16 reads a third of the bytes the target does per token, where the fp32 transformers
forward read as many as the target), and the target's KV bookkeeping:

* **Prefix reuse across turns and sessions.** A request whose context does not extend the
  drafter's cached tokens starts with :meth:`Target.prefill` under the request's tenant
  scope, so a later turn of a conversation feeds only its new tokens through the draft
  model, even after other sessions used it meanwhile (their KV was stored, not dropped).
* **Within a request**, each :meth:`propose` keeps the longest common prefix of the cached
  tokens and the new context (:meth:`Target.rollback` drops the rejected draft tail) and
  feeds the rest in one forward: the accepted tokens plus the verifier's token.

Drafts are greedy or sampled exactly as :class:`ModelDrafter`'s (the same ``propose``);
what changes is only where logits come from (:meth:`_sync`, :meth:`_feed`). Multi-draft
``propose_many`` needs a batched KV cache this drafter does not keep and raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentspec.drafters.model.causal import ModelDrafter, ModelDrafterConfig
from agentspec.errors import ConfigError
from agentspec.interfaces import PositionLimited, Target
from agentspec.tokens import common_prefix
from agentspec.types import Draft, DraftContext

__all__ = ["TargetDrafter"]


class TargetDrafter(ModelDrafter):
    """Drafts with a loaded :class:`~agentspec.interfaces.Target` (the draft model).

    Args:
        draft: The draft model as a target: same tokenizer as the verified target, its
            own KV cache (this drafter is its only user).
        config: Draft length and sampling.
        vocab_size: The verified target's vocabulary ``V`` (logits are cut to it).
    """

    def __init__(self, draft: Target, config: ModelDrafterConfig | None = None,
                 vocab_size: int | None = None) -> None:
        own = int(draft.vocab_size)
        limit = draft.max_positions if isinstance(draft, PositionLimited) else 1 << 30
        self._init_state(config, name=f"model:{draft.name}",
                         vocab=min(own, vocab_size) if vocab_size is not None else own,
                         device=torch.device("cpu"), max_positions=int(limit))
        self.draft = draft
        self._scope: str | None = None  # the tenant whose KV the draft target holds

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens continuing ``ctx.tokens`` (the request's
        tenant scopes the draft model's prefix reuse)."""
        scope = ctx.session.tenant if ctx.session is not None else None
        if scope != self._scope:  # another tenant's KV is never continued
            self._cached, self._scope = [], scope
        return super().propose(ctx, max_tokens)

    def propose_many(self, ctx: DraftContext, max_tokens: int, num_drafts: int,
                     rng: torch.Generator) -> list[Draft]:
        """Not available: K sampled drafts need a batched cache (use the transformers
        :class:`ModelDrafter` for multi-draft verification).

        Raises:
            ConfigError: always.
        """
        raise ConfigError(f"the draft model {self.name!r} run as a target drafts one "
                          "sequence at a time; multi-draft verification (num_drafts > 1) "
                          "needs drafting.method='model' with a transformers draft model")

    def warm(self, tokens: Sequence[int] = (0, 1, 2, 3, 4, 5, 6, 7)) -> None:
        """Run the forwards a draft runs once, outside any request: a draft target does
        one-time work on its first forwards (its direct decode step checks itself against
        transformers' forward on the first one), and HVD prices the model by the drafting
        time it measures, so a first model step that paid for that would price the draft
        model out of the request."""
        if len(tokens) < 4:
            raise ConfigError(f"warm() needs at least 4 tokens, got {len(tokens)}")
        self.draft.prefill(list(tokens[:-3]))
        self.draft.score(list(tokens[-3:-2]))  # one-row steps, as drafting runs them
        self.draft.score(list(tokens[-2:-1]))
        self.draft.score(list(tokens[-1:]) * 2)  # a multi-row sync
        self.reset()  # (ModelDrafter's: the next draft starts with a prefill)

    # -- where the logits come from --------------------------------------------------------

    def _sync(self, tokens: Sequence[int]) -> torch.Tensor:
        """Make the draft target's cache hold ``tokens``; the logits after the last ``[V]``.

        A context extending a shared prefix of what is cached rolls back to it and feeds
        the rest in one forward; any other context (a new request) is a prefill, which
        reuses the tenant's stored prefix KV.
        """
        if not tokens:
            raise ConfigError("the model drafter needs a non-empty context")
        common = min(common_prefix(self._cached, tokens), len(tokens) - 1)
        if common == 0 or self.draft.num_cached != len(self._cached):
            logits = self.draft.prefill(list(tokens), scope=self._scope)  # [V]
            self.forwards += 1
        else:
            if common < len(self._cached):
                self.draft.rollback(len(self._cached) - common)  # the rejected draft tail
            logits = self._score(tokens[common:])
        self._cached = list(tokens)
        return logits[: self.vocab]

    def _feed(self, rows: list[list[int]]) -> torch.Tensor:
        """Append one row of tokens; its last logits ``[1, V]`` (one sequence only)."""
        if len(rows) != 1:
            raise ConfigError(f"{self.name!r} feeds one row at a time, got {len(rows)}")
        return self._score(rows[0])[None, : self.vocab]  # [1, V]

    def _score(self, tokens: Sequence[int]) -> torch.Tensor:
        logits = self.draft.score(list(tokens))  # [n, V]
        self.forwards += 1
        return logits[-1].float()  # [V]
