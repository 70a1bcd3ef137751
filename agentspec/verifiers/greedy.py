"""Strict greedy verification: accept the longest draft prefix that equals the target's
argmax, then commit the target's argmax at the first mismatch (or after the last token).

This is lossless by construction: every committed token is the target's argmax given the
committed prefix, which is exactly what plain greedy decoding would produce.
"""

from __future__ import annotations

import torch

from agentspec.errors import ConfigError
from agentspec.types import Draft, SamplingParams, VerifyResult


def greedy_accept_len(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> int:
    """Length of the longest prefix where ``draft_tokens[i] == target_argmax[i]``.

    Args:
        draft_tokens: ``[k]`` draft ids.
        target_argmax: ``[k+1]`` (or ``[k]``) target argmax per row.
    """
    k = draft_tokens.shape[0]
    if k == 0:
        return 0
    match = draft_tokens == target_argmax[:k]  # [k] bool
    # cumprod turns the first False and everything after it into 0.
    return int(match.to(torch.int64).cumprod(0).sum())


class GreedyVerifier:
    """The strict greedy acceptance rule (temperature 0 only)."""

    lossless = True

    def verify(
        self,
        draft: Draft,
        logits: torch.Tensor,  # [k+1, V]
        sampling: SamplingParams,
        rng: torch.Generator | None = None,
        *,
        request_id: str | None = None,
    ) -> VerifyResult:
        """Accept the longest argmax-matching prefix plus the target's next token."""
        if not sampling.greedy:
            raise ConfigError(
                f"GreedyVerifier needs temperature 0, got {sampling.temperature}; "
                "use a sampling verifier"
            )
        k = len(draft.tokens)
        if logits.shape[0] != k + 1:
            raise ConfigError(
                f"expected {k + 1} logit rows for a {k}-token draft, got {logits.shape[0]}"
            )
        argmax = logits.argmax(dim=-1).cpu()  # [k+1] (a no-op: target logits are on the CPU)
        n = greedy_accept_len(torch.tensor(draft.tokens, dtype=torch.long), argmax)
        tokens = [*draft.tokens[:n], int(argmax[n])]
        return VerifyResult(tokens=tokens, num_accepted=n, accepted_path=list(range(n)))
