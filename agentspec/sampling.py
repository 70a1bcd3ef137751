"""Logits -> the distribution a request samples from: temperature, top-k, top-p.

Every sampler in agentspec (the rejection, block and multi-draft verifiers, the model
drafter) and plain one-token-at-a-time sampling go through :func:`process_logits`, so
"plain sampling" *is* the reference distribution the lossless verifiers must reproduce:
a verifier is correct iff its committed tokens are distributed as repeated draws from
``process_logits(target_logits, sampling)``.

Order of the warpers (the same as transformers' ``generate``): temperature, then top-k,
then top-p, then renormalise. ``temperature == 0`` gives the point mass on the argmax, so
a sampling verifier run at temperature 0 reduces to greedy verification.
"""

from __future__ import annotations

import torch

from agentspec.errors import ConfigError, DraftError
from agentspec.types import SamplingParams

__all__ = [
    "default_generator",
    "draft_probs",
    "normalise",
    "one_hot",
    "process_logits",
    "sample",
    "sample_token",
]


def process_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Turn raw logits into the sampling distribution of ``sampling``.

    Args:
        logits: ``[..., V]`` raw target (or draft) logits.
        sampling: Temperature, top-k and top-p of the request.

    Returns:
        ``[..., V]`` float32 probabilities; every row sums to 1. At temperature 0 each row
        is the one-hot vector of its argmax.
    """
    logits = logits.float()
    if sampling.greedy:
        return one_hot(logits.argmax(dim=-1), logits.shape[-1])
    z = logits / sampling.temperature  # [..., V]
    vocab = z.shape[-1]
    if 0 < sampling.top_k < vocab:
        # Keep every logit >= the k-th largest (ties at the boundary are all kept, so the
        # result does not depend on how topk breaks ties).
        kth = torch.topk(z, sampling.top_k, dim=-1).values[..., -1:]  # [..., 1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)  # [..., V]
    if sampling.top_p < 1.0:
        probs = _top_p(probs, sampling.top_p)
    return probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest most-likely set whose mass reaches ``top_p``; renormalise."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)  # [..., V]
    # Mass strictly before each token: a token is kept while that mass is < top_p, so
    # the most likely token is always kept and the kept set just reaches top_p.
    before = sorted_p.cumsum(dim=-1) - sorted_p  # [..., V]
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Point masses: ``[...]`` token ids -> ``[..., V]`` float32 one-hot rows."""
    return torch.nn.functional.one_hot(tokens.long(), vocab).float()


def normalise(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Rows of ``weights`` ``[N, V]`` divided by their sums.

    A row of zero mass (an empty residual, which a correct verifier selects with
    probability 0 and only floating-point rounding can reach) is replaced by the matching
    row of ``fallback`` ``[N, V]`` so that sampling never fails.
    """
    mass = weights.sum(dim=-1, keepdim=True)  # [N, 1]
    empty = mass <= 0
    safe = torch.where(empty, torch.ones_like(mass), mass)
    return torch.where(empty, fallback, weights / safe)


def sample(probs: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    """One draw per row: ``[..., V]`` probabilities -> ``[...]`` token ids."""
    flat = probs.reshape(-1, probs.shape[-1])  # [N, V]
    out = torch.multinomial(flat, 1, generator=rng).squeeze(-1)  # [N]
    return out.reshape(probs.shape[:-1])


def sample_token(logits: torch.Tensor, sampling: SamplingParams, rng: torch.Generator) -> int:
    """Plain sampling of one token from ``logits`` ``[V]`` (the reference sampler)."""
    if logits.dim() != 1:
        raise ConfigError(f"sample_token expects logits of shape [V], got {tuple(logits.shape)}")
    if sampling.greedy:
        return int(logits.argmax())
    return int(sample(process_logits(logits, sampling), rng))


def default_generator(rng: torch.Generator | None, sampling: SamplingParams) -> torch.Generator:
    """``rng`` itself, or a generator seeded from ``sampling.seed`` (0 when unset)."""
    if rng is not None:
        return rng
    return torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)


def draft_probs(draft_tokens: torch.Tensor, probs: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """The draft distribution ``q`` ``[k, V]`` of a chain draft.

    Deterministic drafts (cache drafts, greedy model drafts) carry ``probs=None``: their
    distribution is the point mass on each drafted token, ``q_i = onehot(x_i)``.

    Args:
        draft_tokens: ``[k]`` drafted ids.
        probs: ``[k, V]`` the drafter's distributions, or ``None``.
        vocab: ``V``.

    Raises:
        DraftError: ``probs`` has the wrong shape or gives a drafted token zero mass (the
            draft could not have come from it, and the acceptance ratio p/q is undefined).
    """
    k = draft_tokens.shape[0]
    if probs is None:
        return one_hot(draft_tokens, vocab)
    if tuple(probs.shape) != (k, vocab):
        raise DraftError(f"draft probs must have shape ({k}, {vocab}), got {tuple(probs.shape)}")
    q = probs.float()
    if k and bool((q.gather(1, draft_tokens.long()[:, None]) <= 0).any()):
        raise DraftError("draft probs give zero mass to a drafted token")
    return q
