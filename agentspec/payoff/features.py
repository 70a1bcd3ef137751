"""The payoff predictor's runtime features φ_t (Hybrid Verified Decoding, docs/hvd.md).

Everything here is computed from what a drafter already holds before verification: the
context ids (:class:`~agentspec.types.DraftContext`), the cache drafter's
:class:`~agentspec.types.Draft` (match length, score, tokens), the accepted lengths of the
last few decode steps, and a per-token table of character classes built once from the
tokenizer. The cost is O(window) integer operations per step (~20 µs), negligible next to a
target forward (tens of milliseconds on CPU).

Counts and lengths enter as ``log1p`` so that a 40-token match and a 60-token match differ
less than a 1-token and a 3-token match: acceptance saturates with evidence, and the MLP
then sees inputs of similar scale without per-feature tuning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentspec.types import Draft

# The order of the feature vector; saved with a predictor and checked on load.
FEATURE_NAMES: tuple[str, ...] = (
    "log_match_len",        # suffix match length of the cache draft
    "log_draft_len",        # tokens in the cache draft
    "log_score",            # sum of path probabilities (suffix-tree expected acceptance)
    "score_per_token",      # score / draft length: mean path probability
    "log_position",         # tokens generated so far in the request
    "log_prompt_len",       # long prompts (documents, tool results) are copied more
    "log_last_accepted",    # accepted tokens of the previous step
    "log_mean_accepted",    # mean accepted tokens of the last RECENT steps
    "full_accept_share",    # share of the last RECENT steps that accepted their whole draft
    "inside_json",          # unclosed '{' / '[' in the recent context
    "inside_code",          # an odd number of ``` fences in the output so far
    "ctx_space_share",      # whitespace-only tokens among the last WINDOW context tokens
    "ctx_punct_share",      # punctuation-only tokens among them
    "draft_space_share",    # the same shares within the cache draft
    "draft_punct_share",
    "log_newline_dist",     # tokens since the last newline
    "draft_newlines",       # newline tokens in the draft / draft length
)
NUM_FEATURES = len(FEATURE_NAMES)
RECENT = 4  # decode steps summarised by the recent-acceptance features
WINDOW = 32  # context tokens summarised by the share features
DEPTH_WINDOW = 256  # context tokens scanned for unclosed brackets

# Bit flags per vocabulary entry.
SPACE, NEWLINE, PUNCT, FENCE = 1, 2, 4, 8
_PUNCT_CHARS = set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


@dataclass(frozen=True)
class TokenTable:
    """Character classes of every token id, built once per tokenizer.

    Attributes:
        flags: Per token id, OR of ``SPACE`` (only whitespace), ``NEWLINE`` (contains a
            newline), ``PUNCT`` (only punctuation and whitespace, at least one punctuation
            char) and ``FENCE`` (contains a ```` ``` ```` fence).
        depth: Per token id, opened minus closed ``{`` / ``[`` brackets.
    """

    flags: list[int]
    depth: list[int]

    @classmethod
    def from_strings(cls, texts: Sequence[str]) -> TokenTable:
        """Classify each token's decoded text (index = token id)."""
        flags, depth = [], []
        for text in texts:
            f = 0
            if text and text.isspace():
                f |= SPACE
            if "\n" in text:
                f |= NEWLINE
            stripped = text.strip()
            if stripped and all(c in _PUNCT_CHARS for c in stripped):
                f |= PUNCT
            if "```" in text:
                f |= FENCE
            flags.append(f)
            depth.append(text.count("{") + text.count("[") - text.count("}") - text.count("]"))
        return cls(flags, depth)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int) -> TokenTable:
        """Decode every id once with a Hugging Face tokenizer (~1 s for 49k ids)."""
        texts = tokenizer.batch_decode([[i] for i in range(vocab_size)])
        return cls.from_strings(texts)

    @classmethod
    def from_decode(cls, decode: Callable[[list[int]], str], vocab_size: int) -> TokenTable:
        """Build from any ids -> text function (e.g. a test's character decoder)."""
        return cls.from_strings([decode([i]) for i in range(vocab_size)])

    @classmethod
    def blank(cls, vocab_size: int) -> TokenTable:
        """No character information (all structure features read 0)."""
        return cls([0] * vocab_size, [0] * vocab_size)

    def flag(self, tok: int) -> int:
        """Flags of ``tok`` (0 for ids outside the table)."""
        return self.flags[tok] if 0 <= tok < len(self.flags) else 0


def _share(tokens: Sequence[int], table: TokenTable, bit: int) -> float:
    if not tokens:
        return 0.0
    return sum(1 for t in tokens if table.flag(t) & bit) / len(tokens)


def features(
    tokens: Sequence[int],
    prompt_len: int,
    draft: Draft,
    recent: Sequence[tuple[int, int]],
    table: TokenTable,
) -> list[float]:
    """The feature vector φ_t of one cache draft, ordered as :data:`FEATURE_NAMES`.

    Args:
        tokens: Context ids (prompt + output so far).
        prompt_len: Prompt tokens at the start of ``tokens``.
        draft: The cache drafter's draft for this step (may be empty).
        recent: ``(draft_len, accepted)`` of the previous decode steps, oldest first
            (only the last :data:`RECENT` are read).
        table: Character classes of the vocabulary.

    Returns:
        ``NUM_FEATURES`` floats.
    """
    k = len(draft.tokens)
    n = len(tokens)
    last = list(recent[-RECENT:])
    accepted = [a for _, a in last]
    full = [1.0 if a >= d > 0 else 0.0 for d, a in last]
    ctx = tokens[max(0, n - WINDOW):]
    # Unclosed brackets: a running depth floored at 0, so stray closers in prose do not
    # cancel a JSON object opened later.
    depth = 0
    dep = table.depth
    for t in tokens[max(0, n - DEPTH_WINDOW):]:
        if 0 <= t < len(dep):
            depth = max(0, depth + dep[t])
    fences = sum(1 for t in tokens[prompt_len:] if table.flag(t) & FENCE)
    nl_dist = WINDOW * 4
    for i in range(1, min(n, nl_dist) + 1):
        if table.flag(tokens[n - i]) & NEWLINE:
            nl_dist = i - 1
            break
    dtoks = draft.tokens
    return [
        math.log1p(draft.match_len),
        math.log1p(k),
        math.log1p(max(draft.score, 0.0)),
        draft.score / k if k else 0.0,
        math.log1p(max(n - prompt_len, 0)),
        math.log1p(prompt_len),
        math.log1p(accepted[-1]) if accepted else 0.0,
        math.log1p(sum(accepted) / len(accepted)) if accepted else 0.0,
        sum(full) / len(full) if full else 0.0,
        1.0 if depth > 0 else 0.0,
        float(fences % 2),
        _share(ctx, table, SPACE),
        _share(ctx, table, PUNCT),
        _share(dtoks, table, SPACE),
        _share(dtoks, table, PUNCT),
        math.log1p(nl_dist),
        _share(dtoks, table, NEWLINE),
    ]
