"""Grammar-constrained decoding inside the speculative loop, with llguidance.

A :class:`GrammarConstraint` holds one request's grammar state (an llguidance ``LLMatcher``)
and plugs into :class:`~agentspec.engine.SpeculativeDecoder` through three calls per step:

1. :meth:`GrammarConstraint.prepare` walks the matcher along the draft, filling one
   allowed-token mask per verified row (row i: the state after ``pending, d_1..d_i``), and
   cuts the draft at the first token the grammar forbids: such a token could never be
   committed, so it ends the accepted prefix before the target even scores it.
2. :meth:`GrammarConstraint.mask` sets the forbidden logits of every row to ``-inf`` in
   place, so any verifier (greedy, rejection sampling, block, budgeted) only ever commits
   allowed tokens, and greedy output equals constrained greedy decoding without drafts.
3. :meth:`GrammarConstraint.commit` rolls the matcher back over the rejected draft tokens
   and advances it over the verifier's own token: the matcher then holds exactly the
   committed tokens again.

Each mask is computed once, for a state the verifier needs (no mask is recomputed between
steps: row 0 of a step is the state after the previous step's new token, which no earlier
step has seen). A mask costs a small fraction of one target forward
(``scripts/measure_grammar_engines.py``).

Why llguidance rather than xgrammar: both have CPU wheels and rollback; on this tokenizer
xgrammar fills a mask faster, but its wheel requires ``triton`` (about 1 GB installed) while
llguidance has no dependencies at all; both costs are negligible against a forward, so the
smaller install wins (numbers in ``docs/structured-outputs.md``).

Grammars are llguidance Lark text; :mod:`agentspec.chat.grammar_sources` builds them from JSON
schemas, ``response_format`` and tool schemas. A grammar is client input compiled on the
serving thread, so :meth:`GrammarCompiler.constraint` bounds it first
(:class:`~agentspec.chat.grammar_sources.GrammarLimits`: bytes and the schema features whose
compile time grows fastest, checked before compiling; llguidance's fuel and size counters
while it compiles) and raises :class:`~agentspec.errors.GrammarError` past a bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from agentspec.chat.grammar_sources import DEFAULT_GRAMMAR_LIMITS, GrammarLimits, check_grammar
from agentspec.errors import GrammarError
from agentspec.types import Draft, VerifyResult

# Longest llguidance error text put into a GrammarError: its messages may quote the grammar.
_MAX_ERROR_CHARS = 500


def _short(message: str) -> str:
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + " ..."


@dataclass
class MaskStats:
    """What grammar masking cost in one request.

    Attributes:
        masks: Allowed-token masks computed (one per verified row).
        mask_s: Seconds spent computing masks.
        apply_s: Seconds spent applying masks to logits.
        steps: Decode steps the constraint took part in.
        cut_drafts: Steps whose draft the grammar cut short.
    """

    masks: int = 0
    mask_s: float = 0.0
    apply_s: float = 0.0
    steps: int = 0
    cut_drafts: int = 0

    def to_dict(self) -> dict[str, float]:
        """A JSON-ready summary with per-step and per-mask averages in milliseconds."""
        return {
            "masks": self.masks,
            "steps": self.steps,
            "cut_drafts": self.cut_drafts,
            "mask_ms_per_step": round(1e3 * self.mask_s / max(self.steps, 1), 4),
            "mask_ms_per_mask": round(1e3 * self.mask_s / max(self.masks, 1), 4),
            "apply_ms_per_step": round(1e3 * self.apply_s / max(self.steps, 1), 4),
        }


class GrammarConstraint:
    """One request's grammar state; implements :class:`agentspec.interfaces.Constraint`.

    Args:
        matcher: A fresh ``llguidance.LLMatcher`` for the request's grammar.
        vocab_size: The target's logits per row (masks cover exactly this many tokens).
    """

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import llguidance.torch as llt

        self._llt = llt
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.stats = MaskStats()
        self.tokens: list[int] = []  # the committed tokens the matcher has consumed
        self._words = (vocab_size + 31) // 32
        self._masks: torch.Tensor | None = None
        self._ahead = 0  # draft tokens consumed by prepare() and not yet committed
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"grammar state is invalid: {_short(self.matcher.get_error())}")

    def prepare(self, draft: Draft) -> Draft:
        """Fill the masks of the rows to verify; return the draft cut at its first
        forbidden token (a tree draft is reduced to its longest branch first)."""
        if draft.is_tree:
            path = draft.branches()[0]
            draft = Draft([draft.tokens[i] for i in path], None, None, draft.score,
                          draft.match_len, draft.source)
        t0 = time.perf_counter()
        # validate_tokens checks the draft without consuming it (a forbidden token would
        # put the matcher into its error state).
        allowed = self.matcher.validate_tokens(list(draft.tokens)) if draft.tokens else 0
        if allowed < len(draft.tokens):
            self.stats.cut_drafts += 1
            draft = draft.truncated(allowed) if allowed else Draft(source=draft.source)
        masks = torch.zeros((allowed + 1, self._words), dtype=torch.int32)
        ahead = 0
        for i in range(allowed + 1):
            self._llt.fill_next_token_bitmask(self.matcher, masks, i)
            if i == allowed:
                break
            if self.matcher.is_stopped():
                # Complete grammar: the only allowed token is EOS, which ends the request;
                # nothing is drafted past it, and it is not fed (a stopped matcher keeps
                # no history for it, so it could not be rolled back).
                draft = draft.truncated(i + 1)
                masks = masks[: i + 2]
                self._llt.fill_next_token_bitmask(self.matcher, masks, i + 1)
                allowed = i + 1
                break
            if not self.matcher.consume_token(draft.tokens[i]):
                raise GrammarError(f"grammar rejected validated draft token {draft.tokens[i]}")
            ahead += 1
        self._masks, self._ahead = masks, ahead
        self.stats.masks += allowed + 1
        self.stats.mask_s += time.perf_counter() - t0
        self.stats.steps += 1
        return draft

    def mask(self, logits: torch.Tensor) -> None:
        """Set forbidden logits to ``-inf`` in place (``logits``: ``[k+1, V]``, the rows of
        the draft :meth:`prepare` returned)."""
        if self._masks is None:
            raise GrammarError("mask() called before prepare()")
        t0 = time.perf_counter()
        if logits.shape[0] != self._masks.shape[0]:
            raise GrammarError(
                f"logits have {logits.shape[0]} rows, masks {self._masks.shape[0]}"
            )
        # Unpack the 32-bit words to one bool per token (token 32*w + b is bit b of word w,
        # little-endian). llguidance's own apply kernel is torch.compile'd: a C++ build on
        # first use and recompiles per shape on CPU, seconds per step on this machine.
        packed = self._masks.numpy().view(np.uint8)
        bits = np.unpackbits(packed, axis=1, bitorder="little").view(np.bool_)
        forbidden = ~torch.from_numpy(bits[:, : logits.shape[1]]).to(logits.device)
        with torch.inference_mode():  # the target's logits are inference tensors
            logits.masked_fill_(forbidden, float("-inf"))
        self.stats.apply_s += time.perf_counter() - t0

    def commit(self, result: VerifyResult) -> None:
        """Roll back the rejected draft tokens and consume the verifier's own token."""
        if self._masks is None:
            raise GrammarError("commit() called before prepare()")
        rejected = self._ahead - min(result.num_accepted, self._ahead)
        if rejected and not self.matcher.rollback(rejected):
            raise GrammarError(f"grammar rollback failed: {self.matcher.get_error()}")
        if result.num_accepted <= self._ahead:  # else an accepted EOS already ended it
            token = result.tokens[-1]
            if not self.matcher.is_stopped() and not self.matcher.consume_token(token):
                raise GrammarError(
                    f"verifier committed token {token}, which the grammar forbids: "
                    f"{self.matcher.get_error()}"
                )
        self.tokens.extend(result.tokens)
        self._masks, self._ahead = None, 0

    @property
    def done(self) -> bool:
        """True once the grammar allows nothing but the end of the output."""
        return bool(self.matcher.is_stopped())

    def state_mask(self) -> torch.Tensor:
        """The allowed-token mask ``[1, words]`` of the committed state (for tests)."""
        out = torch.zeros((1, self._words), dtype=torch.int32)
        self._llt.fill_next_token_bitmask(self.matcher, out, 0)
        return out


class GrammarCompiler:
    """Turns grammar text into request constraints for one tokenizer.

    Building llguidance's token trie takes ~0.4 s for a 49k vocabulary, so it is built
    once (lazily, on the first grammar) and shared by every request of the model.

    Args:
        make_tokenizer: Returns the ``llguidance.LLTokenizer`` (called once).
        vocab_size: The target's logits per row.
        limits: Bounds on every grammar it compiles (default: :data:`DEFAULT_GRAMMAR_LIMITS
            <agentspec.chat.grammar_sources.DEFAULT_GRAMMAR_LIMITS>`).
    """

    def __init__(self, make_tokenizer: Callable[[], Any], vocab_size: int,
                 limits: GrammarLimits | None = None) -> None:
        self._make = make_tokenizer
        self._tok: Any = None
        self.vocab_size = vocab_size
        self.limits = limits or DEFAULT_GRAMMAR_LIMITS

    @classmethod
    def from_hf(cls, tokenizer: Any, vocab_size: int,
                limits: GrammarLimits | None = None) -> GrammarCompiler:
        """A compiler for a Hugging Face (fast) tokenizer."""

        def make() -> Any:
            import llguidance.hf

            return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

        return cls(make, vocab_size, limits)

    @classmethod
    def from_tokens(
        cls, tokens: Sequence[bytes], eos_token_id: int, special: Sequence[int] = (),
        limits: GrammarLimits | None = None,
    ) -> GrammarCompiler:
        """A compiler for a plain byte vocabulary (token i is ``tokens[i]``); special
        tokens (EOS among them) never match grammar text."""

        class _Vocab:
            def __init__(self) -> None:
                self.eos_token_id = eos_token_id
                self.bos_token_id = None
                self.special_token_ids = sorted({eos_token_id, *special})
                self.tokens = [b"\xff[%d]" % i if i in self.special_token_ids else t
                               for i, t in enumerate(tokens)]
                self._by_byte = {t: i for i, t in reversed(list(enumerate(self.tokens)))}

            def __call__(self, s: bytes) -> list[int]:
                return [self._by_byte[bytes([b])] for b in s]

        def make() -> Any:
            import llguidance

            return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab()),
                                          n_vocab=len(tokens))

        return cls(make, len(tokens), limits)

    @property
    def tokenizer(self) -> Any:
        """The llguidance tokenizer (built on first use)."""
        if self._tok is None:
            self._tok = self._make()
        return self._tok

    def constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh request constraint for llguidance Lark ``grammar``.

        The grammar is checked against :attr:`limits` first (no compile work for a grammar
        past a bound), then compiled under llguidance's counters from the same limits (its
        compiler stops once one is spent, and so does each later mask computation).

        Raises:
            GrammarError: the grammar does not compile (the message says where), or
                :class:`~agentspec.chat.grammar_sources.GrammarLimitError`: it is past a
                bound (the message names it).
        """
        import llguidance

        check_grammar(grammar, self.limits)
        matcher = llguidance.LLMatcher(
            self.tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0,
            limits=self.limits.llguidance(),
        )
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {_short(matcher.get_error())}")
        return GrammarConstraint(matcher, self.vocab_size)
