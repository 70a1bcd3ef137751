"""The multi-draft decode loop: K i.i.d. drafts per step, scored in one batched forward and
verified together (SpecTr-GBV style, :mod:`agentspec.verifiers.multi_draft`).

Same state invariant as :class:`~agentspec.engine.SpeculativeDecoder`: between steps the
target's cache holds every committed token but the last one, ``pending``. A step asks the
drafter for K drafts of one length k, scores the K rows ``[pending, *draft_j]`` in a single
forward (the cache is expanded to K rows), lets the verifier pick a draft j and an accepted
prefix, keeps cache row j and rolls back its rejected tail. Stop strings, EOS, max_tokens,
streaming and statistics behave exactly as in the single-draft engine: the decode loop is
:meth:`SpeculativeDecoder.steps`; this class only overrides its per-request hooks and the
per-step ``_step`` (propose K drafts, score them in one batch, verify).

:class:`~agentspec.interfaces.BatchTarget` and :class:`~agentspec.interfaces.MultiDrafter`
are declared in :mod:`agentspec.interfaces` (re-exported here).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from agentspec.engine import Decode, EngineConfig, SpeculativeDecoder, Step
from agentspec.errors import ConfigError
from agentspec.interfaces import (
    BatchTarget,
    Constraint,
    MultiDrafter,
)
from agentspec.penalties import PenaltyState, chain_prefixes
from agentspec.sampling import default_generator
from agentspec.types import Draft, DraftContext, SamplingParams, VerifyResult
from agentspec.verifiers.keyed import KeyedVerifier
from agentspec.verifiers.multi_draft import MultiDraftVerifier

__all__ = ["BatchTarget", "MultiDraftDecoder", "MultiDrafter"]


class MultiDraftDecoder(SpeculativeDecoder):
    """Runs requests with K drafts per step.

    Args:
        target: The model being accelerated (with ``score_batch``).
        drafter: Source of K i.i.d. drafts.
        verifier: Multi-draft verification rule (lossless SpecTr-GBV style by default;
            ``KeyedVerifier(MultiDraftVerifier())`` keeps seeded requests reproducible).
        num_drafts: K.
        decode: Token ids -> text (stop strings, streaming).
        eos_token_ids: Tokens that end a request.
        config: Loop settings (``max_draft`` is the draft length k).
    """

    supports_constraints = False  # K-row verification has no grammar hook yet

    def __init__(
        self,
        target: BatchTarget,
        drafter: MultiDrafter,
        verifier: MultiDraftVerifier | KeyedVerifier | None = None,
        num_drafts: int = 2,
        decode: Decode | None = None,
        eos_token_ids: Sequence[int] = (),
        config: EngineConfig | None = None,
    ) -> None:
        if num_drafts < 1:
            raise ConfigError(f"num_drafts must be >= 1, got {num_drafts}")
        self.multi_verifier = verifier or MultiDraftVerifier()
        super().__init__(target, None, self.multi_verifier, decode, eos_token_ids, config)
        self.batch_target = target
        self.multi_drafter = drafter
        self.num_drafts = num_drafts

    # The decode loop is SpeculativeDecoder.steps; only these hooks differ.

    def _request_rng(self, sampling: SamplingParams) -> torch.Generator:
        # Drafts and verification draw from one seeded generator, greedy requests too.
        return default_generator(None, sampling)

    def _request_parts(self) -> tuple[object, ...]:
        return (self.multi_verifier, self.multi_drafter)

    def _learner(self) -> Any:
        return self.multi_drafter

    def _step(
        self, ctx: DraftContext, max_draft: int, sampling: SamplingParams,
        rng: torch.Generator | None, grammar: Constraint | None = None,
        penalties: PenaltyState | None = None,
    ) -> Step:
        """K drafts, one batched forward, one verification (see the module docstring);
        ``grammar`` is always ``None`` here (``supports_constraints`` is False)."""
        assert rng is not None  # _request_rng always makes one
        t0 = time.perf_counter()
        position = len(ctx.generated)  # output position of verify-logits row 0
        drafts = [replace(d, position=position)
                  for d in self._propose_many(ctx, max_draft, rng)]
        draft_s = time.perf_counter() - t0
        result, k, source = self._verify(ctx.tokens[-1], drafts, sampling, rng, position,
                                         penalties)
        return Step(result, k, source, draft_s)

    def _propose_many(
        self, ctx: DraftContext, max_tokens: int, rng: torch.Generator
    ) -> list[Draft]:
        if max_tokens < self.config.min_draft:
            return []
        drafts = self.multi_drafter.propose_many(ctx, max_tokens, self.num_drafts, rng)
        drafts = [d.truncated(max_tokens) for d in drafts]
        if not drafts or len(drafts[0].tokens) < self.config.min_draft:
            return []
        for d in drafts:
            self._check_ids(d)  # DraftError, as in the single-draft engine
        return drafts

    def _verify(
        self, pending: int, drafts: list[Draft], sampling: SamplingParams,
        rng: torch.Generator, position: int = 0, penalties: PenaltyState | None = None,
    ) -> tuple[VerifyResult, int, str]:
        """Score and verify one step; leave the cache holding pending + accepted tokens
        (rows penalised by their own draft prefix, see :mod:`agentspec.penalties`)."""
        if not drafts:  # plain decoding step
            logits = self.target.score([pending])  # [1, V]
            if penalties is not None:
                penalties.apply(logits, [[]])
            plain = Draft(position=position)
            return self.multi_verifier.verify(plain, logits, sampling, rng), 0, "none"
        k = len(drafts[0].tokens)
        logits = self.batch_target.score_batch([[pending, *d.tokens] for d in drafts])
        if penalties is not None:  # [K, k+1, V]: draft j's row i follows d_j[:i]
            for j, d in enumerate(drafts):
                penalties.apply(logits[j], chain_prefixes(d.tokens))
        out = self.multi_verifier.verify_many(drafts, logits, sampling, rng)  # [K, k+1, V]
        self.batch_target.select_row(out.draft_index)
        self.target.rollback(k - out.result.num_accepted)
        return out.result, k, drafts[0].source
