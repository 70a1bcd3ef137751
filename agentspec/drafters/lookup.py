"""Prompt lookup decoding: the classic n-gram baseline.

Find the most recent earlier occurrence of the context's last n tokens (longest n first)
and propose the tokens that followed it. No state, no training; it only sees the current
request's context (prompt plus generated tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agentspec.errors import ConfigError
from agentspec.types import Draft, DraftContext, VerifyResult


@dataclass(frozen=True)
class PromptLookupConfig:
    """Settings of :class:`PromptLookupDrafter`.

    Attributes:
        max_ngram: Longest suffix tried as the lookup key.
        min_ngram: Shortest suffix tried.
        num_pred: Most tokens proposed (the engine may ask for fewer).
    """

    max_ngram: int = 3
    min_ngram: int = 1
    num_pred: int = 10

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}"
            )
        if self.num_pred < 1:
            raise ConfigError(f"num_pred must be >= 1, got {self.num_pred}")


def find_ngram_continuation(
    tokens: np.ndarray, max_ngram: int, min_ngram: int, num_pred: int
) -> tuple[list[int], int]:
    """Continuation of the latest earlier match of the longest matching suffix.

    Args:
        tokens: ``[n]`` context ids.

    Returns:
        ``(proposed ids, matched n-gram length)``; ``([], 0)`` when nothing matches.
    """
    n_tok = tokens.shape[0]
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        key = tokens[n_tok - n :]  # [n]
        # windows[i] = tokens[i:i+n] for every start i that leaves a following token.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tok - 1], n)  # [m, n]
        hits = np.flatnonzero((windows == key).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # latest match: most relevant in multi-turn contexts
            cont = tokens[start : start + num_pred]
            if cont.size:
                return cont.tolist(), n
    return [], 0


class PromptLookupDrafter:
    """Drafts by copying what followed the last n-gram's earlier occurrence."""

    name = "prompt_lookup"

    def __init__(self, config: PromptLookupConfig | None = None) -> None:
        self.config = config or PromptLookupConfig()

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Propose up to ``min(num_pred, max_tokens)`` tokens."""
        cfg = self.config
        toks, n = find_ngram_continuation(
            np.asarray(ctx.tokens, dtype=np.int64),
            cfg.max_ngram,
            cfg.min_ngram,
            min(cfg.num_pred, max_tokens),
        )
        return Draft(tokens=toks, match_len=n, score=float(n), source=self.name)

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Stateless: nothing to learn."""

    def finish(self, ctx: DraftContext) -> None:
        """Stateless: nothing to remember."""
