"""The speculative decoding loop: prefill -> (propose -> verify -> commit)*.

State invariant between steps: the target's KV cache holds every committed token except the
last one, ``pending``. A step scores ``[pending] + draft`` in one forward, so row i of the
logits ``[k+1, V]`` is the target's distribution after ``pending, d_1..d_i``. The verifier
commits an accepted prefix plus one token of its own; the cache keeps ``pending`` and the
accepted tokens and rolls back the rest, and the verifier's own token becomes the new
``pending``. An empty draft makes this plain one-token-per-forward decoding, so the same
loop is also the greedy baseline.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from agentspec.drafters.gate import DraftGate
from agentspec.errors import (
    ConfigError,
    DraftError,
    PromptTooLongError,
)
from agentspec.interfaces import (
    BatchTarget,
    Constraint,
    Drafter,
    FeatureDrafter,
    FeatureReuseTarget,
    FeatureTarget,
    PositionLimited,
    PrefixReuseTarget,
    RequestAware,
    Target,
    TreeTarget,
    Verifier,
)
from agentspec.penalties import PenaltyState, chain_prefixes, tree_prefixes
from agentspec.requests import REQUESTS
from agentspec.sampling import default_generator
from agentspec.stopping import Decode, StopChecker, certain_length, check_cancel
from agentspec.types import (
    Draft,
    DraftContext,
    RequestStats,
    SamplingParams,
    SessionRef,
    StepStats,
    VerifyResult,
    state_key,
)
from agentspec.verifiers.greedy import GreedyVerifier
from agentspec.verifiers.tree import (
    branch_rows,
    greedy_branch_accept,
    greedy_tree_accept,
    tree_rows,
)

FeatureLink = tuple[Callable[[DraftContext, int, torch.Tensor], None], Callable[[], torch.Tensor]]


_REQUEST_IDS = itertools.count()  # process-wide: ids of concurrent requests differ

@dataclass(frozen=True)
class EngineConfig:
    """Settings of the decode loop.

    Attributes:
        max_draft: Longest draft verified in one forward. A forward over many tokens costs
            far less than as many one-token forwards, so long drafts pay off when they hit.
        min_draft: Drafts shorter than this are dropped (decoded one token at a time):
            with some CPU BLAS builds a 2-3-token forward costs as much as a longer one.
        max_branches: Most branches of a tree draft verified per step (one batch row
            each, see :mod:`agentspec.verifiers.tree`); the longest are kept.
    """

    max_draft: int = 16
    min_draft: int = 1
    max_branches: int = 4

    def __post_init__(self) -> None:
        if self.max_draft < 0:
            raise ConfigError(f"max_draft must be >= 0, got {self.max_draft}")
        if self.min_draft < 1:
            raise ConfigError(f"min_draft must be >= 1, got {self.min_draft}")
        if self.max_branches < 1:
            raise ConfigError(f"max_branches must be >= 1, got {self.max_branches}")


@dataclass(frozen=True)
class Step:
    """One verified step, as the decode loop records it.

    Attributes:
        result: What the verifier committed.
        draft_len: Draft tokens verified (the chosen draft's, for multi-draft steps).
        source: The drafter that produced the verified draft (``"none"``: plain step).
        draft_s: Seconds spent drafting (and gating).
        offered: Draft tokens the drafter offered, before the draft gate cut them.
    """

    result: VerifyResult
    draft_len: int
    source: str
    draft_s: float
    offered: int = 0


@dataclass
class Generation:
    """The result of one request.

    Attributes:
        tokens: Generated token ids (an EOS token that ended the request is included).
        text: Decoded text, without special tokens and cut before any stop string.
        finish_reason: ``"stop"`` (EOS or stop string) or ``"length"`` (max_tokens).
        stats: The request's speculative decoding numbers.
    """

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    stats: RequestStats = field(default_factory=RequestStats)


@dataclass(frozen=True)
class _Wiring:
    """What an engine's parts can do, asked once per engine instead of per request or step.

    Attributes:
        starters: Parts told about each new request before its prefill (``begin_request``).
        learner: The drafter told about committed tokens and completed requests.
        features: ``(drafter.observe_features, target.last_features)`` when the drafter
            drafts from the target's hidden states and the target gives them.
        reuse: The target, when it reuses prefix KV (it reports the reused tokens).
        feature_reuse: The target, when its reuse can also give reused positions' rows.
        tree: The target, when it scores a tree draft in one row (tree attention).
        batch: The target, when it scores one batch row per branch.
        max_positions: The target's context window (``None``: unbounded).
    """

    starters: tuple[RequestAware, ...]
    learner: Drafter | None
    features: FeatureLink | None
    reuse: PrefixReuseTarget | None
    feature_reuse: FeatureReuseTarget | None
    tree: TreeTarget | None
    batch: BatchTarget | None
    max_positions: int | None


class SpeculativeDecoder:
    """Runs requests through a target, an optional drafter and a verifier.

    Args:
        target: The model being accelerated.
        drafter: Source of draft tokens; ``None`` decodes one token per forward.
        verifier: Acceptance rule; strict greedy by default (lossless).
        decode: Token ids -> text (a tokenizer's decode without special tokens). Needed
            for stop strings and streaming.
        eos_token_ids: Tokens that end a request.
        config: Loop settings.
    """

    #: Whether :meth:`steps` honours a grammar ``constraint`` (subclasses that verify
    #: differently say False, and a constrained request is refused rather than ignored).
    supports_constraints = True

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        verifier: Verifier | None = None,
        decode: Decode | None = None,
        eos_token_ids: Sequence[int] = (),
        config: EngineConfig | None = None,
        gate: DraftGate | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.verifier: Verifier = verifier or GreedyVerifier()
        self.decode = decode
        self.eos_token_ids = set(eos_token_ids)
        self.config = config or EngineConfig()
        # Cuts or skips drafts not worth their forward at the request's context length
        # (agentspec.drafters.gate); None: every draft is verified as drafted.
        self.gate = gate

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        sampling: SamplingParams | None = None,
        session: SessionRef | None = None,
        constraint: Constraint | None = None,
    ) -> Generation:
        """Decode one request to completion. See :meth:`steps` for the arguments."""
        gen = self.steps(prompt, max_tokens, stop, sampling, session, constraint)
        while True:
            try:
                next(gen)
            except StopIteration as done:
                result: Generation = done.value
                return result

    def stream(
        self,
        prompt: Sequence[int],
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        sampling: SamplingParams | None = None,
        session: SessionRef | None = None,
        constraint: Constraint | None = None,
        cancel: threading.Event | None = None,
    ) -> Generator[str, None, Generation]:
        """Yield text deltas as tokens are committed, then return the :class:`Generation`.

        Text that could still turn into a stop string, or that ends inside a multi-byte
        character, is held back until it is certain. The result is the generator's return
        value: ``gen = yield from engine.stream(...)`` in a generator, or
        :class:`~agentspec.chat.stream.ResultStream` around it (``.result`` once iterated).
        ``cancel``: see :meth:`steps`.
        """
        if self.decode is None:
            raise ConfigError("streaming needs a decode function (a tokenizer)")
        checker = StopChecker(set(), stop, self.decode, max_tokens)
        emitted = 0
        gen = self.steps(prompt, max_tokens, stop, sampling, session, constraint, cancel)
        while True:
            try:
                tokens = next(gen)
            except StopIteration as done:
                final: Generation = done.value
                if len(final.text) > emitted:
                    yield final.text[emitted:]
                return final
            text = checker.final_text(tokens)
            safe = certain_length(text, stop)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe

    def steps(
        self,
        prompt: Sequence[int],
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        sampling: SamplingParams | None = None,
        session: SessionRef | None = None,
        constraint: Constraint | None = None,
        cancel: threading.Event | None = None,
    ) -> Generator[list[int], None, Generation]:
        """The decode loop as a generator: yields all generated tokens after each step and
        returns the :class:`Generation`.

        Args:
            prompt: Prompt token ids (at least one).
            max_tokens: Most tokens to generate.
            stop: Stop strings; the output ends at the token that completes one.
            sampling: Greedy by default.
            session: Passed to drafters (session-scoped caches).
            constraint: The request's output grammar (fresh per request): every verified
                row is masked by it and draft tokens it forbids end the accepted prefix.
            cancel: Set by the caller to stop the request: checked before the prefill,
                between its chunks (passed to the target's ``prefill`` only when given),
                and before every step. A cancelled request ends as one whose consumer
                closed the stream: its request state is released, nothing is returned.

        Penalties in ``sampling`` (frequency, presence, repetition) are applied to every
        verified row with the counts of the tokens before it, draft tokens of its own
        prefix included (:mod:`agentspec.penalties`): the output is that of penalised
        decoding without drafts.

        Raises:
            ConfigError: empty prompt or ``max_tokens < 1``, or a constraint given to an
                engine that cannot honour one.
            PromptTooLongError: prompt plus ``max_tokens`` exceed the context window.
            Cancelled: ``cancel`` was set before the request finished.
        """
        sampling = sampling or SamplingParams()
        self.check_request(prompt, max_tokens)
        if constraint is not None and not self.supports_constraints:
            raise ConfigError(f"{type(self).__name__} cannot decode under a grammar constraint")
        rng = self._request_rng(sampling)
        # Request-scoped counts of the committed tokens, updated after every step.
        penalties = (PenaltyState(sampling, self.target.vocab_size, prompt)
                     if sampling.penalised else None)
        # Request-scoped state: the ASD regret budget (verifier) and a sampling drafter's
        # draws, which must come from the request's generator (same seed, same output).
        # Stateful drafters key per-request state by this id (concurrent requests of one
        # session must not share it).
        rid = f"engine-{next(_REQUEST_IDS)}"
        wiring = self._wiring
        try:
            for part in wiring.starters:
                part.begin_request(session, rng, request_id=rid)
            learner = wiring.learner
            stats = RequestStats(prompt_tokens=len(prompt))
            checker = StopChecker(self.eos_token_ids, stop, self.decode, max_tokens)
            t_start = time.perf_counter()

            # Prefill everything but the last prompt token: it is the first `pending` token,
            # so the very first step can already verify a draft. The tenant scopes prefix KV
            # reuse (never across tenants); a drafter reading the target's hidden states needs
            # a row for every prompt position, so it reuses only where the target keeps the
            # reused positions' rows (else reuse is off).
            link = wiring.features
            keeps = (link is not None and wiring.feature_reuse is not None
                     and wiring.feature_reuse.reuse_keeps_features)
            scope = session.tenant if session is not None and (link is None or keeps) else None
            check_cancel(cancel)
            # Only a caller that cancels needs a target taking `cancel` (HFTarget does), and
            # only a feature link a target taking `features`.
            kwargs: dict[str, object] = {"cancel": cancel} if cancel is not None else {}
            if keeps and scope is not None:
                kwargs["features"] = True
            self.target.prefill(list(prompt[:-1]), scope=scope, **kwargs)
            if wiring.reuse is not None:
                stats.cached_prompt_tokens = wiring.reuse.reused_tokens
            if link is not None:
                link[0](DraftContext(prompt, len(prompt), session, 0, rid, sampling), 0,
                        link[1]())
            stats.prefill_s = time.perf_counter() - t_start
            context = list(prompt)
            generated: list[int] = []
            finish: str | None = None
            while finish is None:
                check_cancel(cancel)  # also right after a prefill that was one forward
                ctx = DraftContext(context, len(prompt), session, len(stats.steps), rid,
                                   sampling)
                room = max_tokens - len(generated) - 1  # the verifier always adds one token
                t0 = time.perf_counter()
                step = self._step(ctx, min(self.config.max_draft, room), sampling, rng, constraint,
                                  penalties)
                result = step.result
                if link is not None:  # pending + accepted rows: the positions now committed
                    rows = link[1]()  # [k+1, H]
                    link[0](ctx, len(context) - 1, rows[: result.num_accepted + 1])
                t2 = time.perf_counter()
                if learner is not None:
                    learner.observe(ctx, result)
                if self.gate is not None:
                    self.gate.observe(ctx, result)
                block, finish = checker.cut(generated, result.tokens)
                generated.extend(block)
                context.extend(block)
                if penalties is not None:
                    penalties.commit(block)
                stats.forwards += 1
                stats.draft_s += step.draft_s
                stats.verify_s += t2 - t0 - step.draft_s
                stats.exceptions += result.exceptions
                stats.regret += result.regret
                stats.steps.append(
                    StepStats(step.source, step.draft_len, result.num_accepted, len(block),
                              step.draft_s, t2 - t0 - step.draft_s, step.offered)
                )
                yield list(generated)
            if learner is not None:
                learner.finish(DraftContext(context, len(prompt), session, len(stats.steps), rid))
            stats.generated_tokens = len(generated)
            stats.total_s = time.perf_counter() - t_start
            return Generation(generated, checker.final_text(generated), finish, stats)
        finally:
            # Every part's state of this request (agentspec.requests) is released however
            # the request stops: finished, failed, cancelled, or abandoned by its consumer.
            REQUESTS.end(state_key(rid))

    # -- the per-request and per-step hooks (MultiDraftDecoder overrides them) -------------

    def _request_rng(self, sampling: SamplingParams) -> torch.Generator | None:
        """The request's seeded generator (``None`` for greedy requests)."""
        return None if sampling.greedy else default_generator(None, sampling)

    def _request_parts(self) -> tuple[object, ...]:
        """The parts told about each new request (``begin_request``, where they have it)."""
        return (self.verifier, self.drafter)

    @cached_property
    def _wiring(self) -> _Wiring:
        """The parts' capabilities, asked once (on the engine's first request)."""
        target = self.target
        learner = self._learner()
        features = None
        if (isinstance(learner, FeatureDrafter) and learner.wants_features
                and isinstance(target, FeatureTarget)):
            features = (learner.observe_features, target.last_features)
        return _Wiring(
            starters=tuple(p for p in self._request_parts() if isinstance(p, RequestAware)),
            learner=learner,
            features=features,
            reuse=target if isinstance(target, PrefixReuseTarget) else None,
            feature_reuse=target if isinstance(target, FeatureReuseTarget) else None,
            tree=target if isinstance(target, TreeTarget) else None,
            batch=target if isinstance(target, BatchTarget) else None,
            max_positions=target.max_positions if isinstance(target, PositionLimited) else None,
        )

    def _learner(self) -> Drafter | None:
        """The drafter told about committed tokens (``observe``) and request ends."""
        return self.drafter

    def _step(
        self, ctx: DraftContext, max_draft: int, sampling: SamplingParams,
        rng: torch.Generator | None, grammar: Constraint | None = None,
        penalties: PenaltyState | None = None,
    ) -> Step:
        """Draft, score and verify one step; leave the cache holding pending + accepted.

        Everything request-scoped (``sampling``, ``rng``, the ``grammar``, the
        ``penalties``' counts) comes in as an argument: the engine holds no request's state
        between calls.
        """
        t0 = time.perf_counter()
        draft = self._propose(ctx, max_draft)
        offered = len(draft.tokens)
        if self.gate is not None and offered:  # verify what is worth its forward here
            draft = self.gate.cut(ctx, draft)
            if len(draft.tokens) < self.config.min_draft:
                draft = Draft(source="none")
        # Row 0 of the verify logits predicts output position len(generated): keyed
        # (seeded) verification draws each row's noise by its position.
        draft = replace(draft, position=len(ctx.generated))
        draft_s = time.perf_counter() - t0
        pending = ctx.tokens[-1]
        if grammar is not None:  # cut at the first forbidden token; trees -> one branch
            draft = grammar.prepare(draft)
        if draft.is_tree and not self._tree_ok(sampling):
            draft = draft.first_branch()
        if draft.is_tree:
            result = self._verify_tree(pending, draft, penalties)
        else:
            logits = self.target.score([pending, *draft.tokens])  # [k+1, V]
            if penalties is not None:  # row i: committed counts + d_1..d_i
                penalties.apply(logits, chain_prefixes(draft.tokens))
            if grammar is not None:
                grammar.mask(logits)
            result = self.verifier.verify(draft, logits, sampling, rng,
                                          request_id=ctx.request_id)
            # Keep pending + accepted tokens in the cache, drop the rejected rest.
            self.target.rollback(len(draft.tokens) - result.num_accepted)
        if grammar is not None:
            grammar.commit(result)
        return Step(result, len(draft.tokens), draft.source, draft_s, offered)

    def check_request(self, prompt: Sequence[int], max_tokens: int) -> None:
        """Raise for an empty prompt, ``max_tokens < 1`` or a request past the context window.

        Raises:
            ConfigError: empty prompt or ``max_tokens < 1``.
            PromptTooLongError: prompt plus ``max_tokens`` exceed the context window.
        """
        if not prompt:
            raise ConfigError("prompt must hold at least one token")
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
        limit = self._wiring.max_positions
        if limit is not None and len(prompt) + max_tokens > limit:
            raise PromptTooLongError(
                f"prompt of {len(prompt)} tokens + max_tokens={max_tokens} exceeds the "
                f"context window of {limit} positions"
            )

    def _propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        if self.drafter is None or max_tokens < self.config.min_draft:
            return Draft(source="none")
        draft = self.drafter.propose(ctx, max_tokens)
        self._check_ids(draft)
        if len(draft.tokens) < self.config.min_draft:
            return Draft(source="none")
        return draft.truncated(max_tokens)

    def _check_ids(self, draft: Draft) -> None:
        """Raise :class:`DraftError` for a draft with ids outside ``[0, V)`` (both engines
        refuse an out-of-vocabulary draft the same way)."""
        vocab = self.target.vocab_size
        if draft.tokens and not 0 <= min(draft.tokens) <= max(draft.tokens) < vocab:
            raise DraftError(f"drafter {draft.source!r} proposed token ids outside [0, {vocab})")

    def _verify_tree(
        self, pending: int, draft: Draft, penalties: PenaltyState | None = None
    ) -> VerifyResult:
        """Verify a tree draft greedily (lossless; see :mod:`agentspec.verifiers.tree`),
        leaving pending + accepted tokens cached: with tree attention in one row when the
        target has it, else one batch row per branch (``max_branches`` longest). Each row
        is penalised by the draft tokens on its own path."""
        wiring = self._wiring
        if wiring.tree is not None:
            tokens, parents = tree_rows(draft, pending)
            logits = wiring.tree.score_tree(tokens, parents)  # [k+1, V]
            if penalties is not None:  # row n + 1: counts + node n's ancestors
                ancestors = tree_prefixes(draft.tokens, [p - 1 for p in parents[1:]])
                penalties.apply(logits, ancestors)
            path, token = greedy_tree_accept(tokens, parents, logits)
            wiring.tree.keep_tree_path([i + 1 for i in path])
            return VerifyResult([*(draft.tokens[i] for i in path), token], len(path), path)
        target = wiring.batch
        assert target is not None  # _tree_ok
        rows, paths = branch_rows(draft, pending, self.config.max_branches)
        logits = target.score_batch(rows)  # [K, k+1, V]
        if penalties is not None:  # each batch row is a chain of its own
            for j, row_tokens in enumerate(rows):
                penalties.apply(logits[j], chain_prefixes(row_tokens[1:]))
        row, n, token = greedy_branch_accept(rows, logits)
        target.select_row(row)
        self.target.rollback(len(rows[row]) - 1 - n)
        accepted = list(rows[row][1 : n + 1])
        # Accepted padding (a short branch's repeated last token) has no tree node.
        return VerifyResult([*accepted, token], n, paths[row][:n])

    def _tree_ok(self, sampling: SamplingParams) -> bool:
        """Whether a tree draft can be verified as a tree: strict greedy decoding (trees
        under sampling would need a tree-aware acceptance rule) on a target that scores
        trees or batches, and whose forwards are not shape-stable (a tree's nodes would not
        get their chain's bits there). Otherwise the tree's first branch is verified as a
        chain."""
        wiring = self._wiring
        return (sampling.greedy and self.verifier.lossless
                and not getattr(self.target, "shape_stable", False)
                and (wiring.tree is not None or wiring.batch is not None))
