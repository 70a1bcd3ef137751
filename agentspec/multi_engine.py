"""The multi-draft decode loop: K i.i.d. drafts per step, scored in one batched forward and
verified together (SpecTr-GBV style, :mod:`agentspec.verifiers.multi_draft`).

Same state invariant as :class:`~agentspec.engine.SpeculativeDecoder`: between steps the
target's cache holds every committed token but the last one, ``pending``. A step asks the
drafter for K drafts of one length k, scores the K rows ``[pending, *draft_j]`` in a single
forward (the cache is expanded to K rows), lets the verifier pick a draft j and an accepted
prefix, keeps cache row j and rolls back its rejected tail. Stop strings, EOS, max_tokens,
streaming and statistics behave exactly as in the single-draft engine (this class only
replaces :meth:`steps`).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import Protocol, runtime_checkable

import torch

from agentspec.engine import Decode, EngineConfig, Generation, SpeculativeDecoder, _StopChecker
from agentspec.errors import ConfigError
from agentspec.interfaces import Target
from agentspec.types import (
    Draft,
    DraftContext,
    RequestStats,
    SamplingParams,
    SessionRef,
    StepStats,
    VerifyResult,
)
from agentspec.verifiers.multi_draft import MultiDraftVerifier

__all__ = ["BatchTarget", "MultiDraftDecoder", "MultiDrafter"]


@runtime_checkable
class MultiDrafter(Protocol):
    """A drafter that draws K i.i.d. drafts (e.g. a sampling ``ModelDrafter``)."""

    name: str

    def propose_many(
        self, ctx: DraftContext, max_tokens: int, num_drafts: int, rng: torch.Generator
    ) -> list[Draft]:
        """``num_drafts`` i.i.d. chain drafts of one length, ``probs`` filled."""
        ...

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Learn from the committed tokens."""
        ...

    def finish(self, ctx: DraftContext) -> None:
        """The request ended."""
        ...


@runtime_checkable
class BatchTarget(Target, Protocol):
    """A target that scores K continuations of its cached prefix in one forward."""

    def score_batch(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append row j to cache row j; return logits ``[K, n, V]``."""
        ...

    def select_row(self, row: int) -> None:
        """Keep cache row ``row`` only."""
        ...


class MultiDraftDecoder(SpeculativeDecoder):
    """Runs requests with K drafts per step.

    Args:
        target: The model being accelerated (with ``score_batch``).
        drafter: Source of K i.i.d. drafts.
        verifier: Multi-draft verification rule (lossless SpecTr-GBV style by default).
        num_drafts: K.
        decode: Token ids -> text (stop strings, streaming).
        eos_token_ids: Tokens that end a request.
        config: Loop settings (``max_draft`` is the draft length k).
    """

    def __init__(
        self,
        target: BatchTarget,
        drafter: MultiDrafter,
        verifier: MultiDraftVerifier | None = None,
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

    def steps(
        self,
        prompt: Sequence[int],
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        sampling: SamplingParams | None = None,
        session: SessionRef | None = None,
    ) -> Generator[list[int], None, Generation]:
        """The decode loop (see :meth:`SpeculativeDecoder.steps`)."""
        sampling = sampling or SamplingParams()
        self.check_request(prompt, max_tokens)
        # Drafts and verification draw from one seeded generator: same seed, same output.
        rng = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)
        for part in (self.multi_verifier, self.multi_drafter):
            begin_request = getattr(part, "begin_request", None)
            if begin_request is not None:
                begin_request(session, rng)
        stats = RequestStats(prompt_tokens=len(prompt))
        checker = _StopChecker(self.eos_token_ids, stop, self.decode, max_tokens)
        t_start = time.perf_counter()
        self.target.prefill(list(prompt[:-1]))
        stats.prefill_s = time.perf_counter() - t_start
        context: list[int] = list(prompt)
        generated: list[int] = []
        finish: str | None = None
        while finish is None:
            ctx = DraftContext(context, len(prompt), session, len(stats.steps))
            room = max_tokens - len(generated) - 1  # the verifier always adds one token
            t0 = time.perf_counter()
            drafts = self._propose_many(ctx, min(self.config.max_draft, room), rng)
            t1 = time.perf_counter()
            result, k, source = self._verify(context[-1], drafts, sampling, rng)
            t2 = time.perf_counter()
            self.multi_drafter.observe(ctx, result)
            block, finish = checker.cut(generated, result.tokens)
            generated.extend(block)
            context.extend(block)
            stats.forwards += 1
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.steps.append(
                StepStats(source, k, result.num_accepted, len(block), t1 - t0, t2 - t1)
            )
            yield list(generated)
        self.multi_drafter.finish(DraftContext(context, len(prompt), session, len(stats.steps)))
        stats.generated_tokens = len(generated)
        stats.total_s = time.perf_counter() - t_start
        return Generation(generated, checker.final_text(generated), finish, stats)

    def _propose_many(
        self, ctx: DraftContext, max_tokens: int, rng: torch.Generator
    ) -> list[Draft]:
        if max_tokens < self.config.min_draft:
            return []
        drafts = self.multi_drafter.propose_many(ctx, max_tokens, self.num_drafts, rng)
        drafts = [d.truncated(max_tokens) for d in drafts]
        if not drafts or len(drafts[0].tokens) < self.config.min_draft:
            return []
        vocab = self.target.vocab_size
        for d in drafts:
            if d.tokens and not 0 <= min(d.tokens) <= max(d.tokens) < vocab:
                raise ConfigError(f"drafter {d.source!r} proposed ids outside [0, {vocab})")
        return drafts

    def _verify(
        self, pending: int, drafts: list[Draft], sampling: SamplingParams, rng: torch.Generator
    ) -> tuple[VerifyResult, int, str]:
        """Score and verify one step; leave the cache holding pending + accepted tokens."""
        if not drafts:  # plain decoding step
            logits = self.target.score([pending])  # [1, V]
            return self.multi_verifier.verify(Draft(), logits, sampling, rng), 0, "none"
        k = len(drafts[0].tokens)
        logits = self.batch_target.score_batch([[pending, *d.tokens] for d in drafts])
        out = self.multi_verifier.verify_many(drafts, logits, sampling, rng)  # [K, k+1, V]
        self.batch_target.select_row(out.draft_index)
        self.target.rollback(k - out.result.num_accepted)
        return out.result, k, drafts[0].source
