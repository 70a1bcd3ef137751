"""Logits -> the distribution a request samples from: temperature, top-k, top-p.

Every sampler in agentspec (the rejection, block and multi-draft verifiers, the model
drafter) and plain one-token-at-a-time sampling go through :func:`process_logits`, so
"plain sampling" *is* the reference distribution the lossless verifiers must reproduce:
a verifier is correct iff its committed tokens are distributed as repeated draws from
``process_logits(target_logits, sampling)``.

Order of the warpers (the same as transformers' ``generate``): temperature, then top-k,
then top-p, then renormalise. ``temperature == 0`` gives the point mass on the argmax, so
a sampling verifier run at temperature 0 reduces to greedy verification.

Position-keyed sampling (seeded requests, :mod:`agentspec.verifiers.keyed`) draws the token
at output position ``t`` as ``argmin_v E_v / p_v`` with ``E_v ~ Exp(1)`` from a
counter-based generator keyed by ``(seed, t)``: the exponential-race form of Gumbel-max
(``argmax log p_v + G_v`` with ``G_v = -log E_v``), an exact draw from ``p``. The noise of a
position is a pure function of the seed and the position, so the token does not depend on
how many random numbers anything else consumed.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from agentspec.errors import ConfigError, DraftError
from agentspec.types import SamplingParams

__all__ = [
    "default_generator",
    "draft_probs",
    "keyed_choice",
    "keyed_exponentials",
    "keyed_sample",
    "normalise",
    "one_hot",
    "process_logits",
    "request_key",
    "row_keys",
    "sample",
    "sample_token",
    "seed_key",
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
    """One draw per row: ``[..., V]`` probabilities -> ``[...]`` token ids.

    The draw runs where ``rng`` lives (request generators are CPU ones): ``probs`` is moved
    there first, a no-op when it already is."""
    flat = probs.reshape(-1, probs.shape[-1]).to(rng.device)  # [N, V]
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
    """``rng`` itself, or a generator seeded from ``sampling.seed`` (0 when unset).

    Seeds outside torch's range ``[0, 2**64)`` (negative or huge) are hashed to one inside
    it (:func:`seed_key`) rather than refused.
    """
    if rng is not None:
        return rng
    seed = sampling.seed if sampling.seed is not None else 0
    if not 0 <= seed < 2**64:
        seed = int.from_bytes(seed_key(seed)[:8], "little")
    return torch.Generator().manual_seed(seed)


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
    q = probs.float().to(draft_tokens.device)  # where the verifier works (the CPU)
    if k and bool((q.gather(1, draft_tokens.long()[:, None]) <= 0).any()):
        raise DraftError("draft probs give zero mass to a drafted token")
    return q


# -- position-keyed noise ------------------------------------------------------------------

# SplitMix64 (Steele, Lea & Flood 2014): a counter-based generator. Value ``j`` of a stream
# with key ``s`` is ``mix(s + (j + 1) * GAMMA)``, so any (position, token) draw is computed
# directly, without generating the ones before it.
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_COUNTERS: dict[int, np.ndarray] = {}  # vocab -> (1..V) * GAMMA, uint64 [V]


def seed_key(seed: int) -> bytes:
    """A 16-byte key for a request seed: any Python int (negative, or >= 2**64) is hashed
    (BLAKE2b of its signed little-endian bytes), so distinct seeds give unrelated noise.

    Raises:
        ConfigError: ``seed`` is not an integer.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    data = seed.to_bytes(seed.bit_length() // 8 + 1, "little", signed=True)
    return hashlib.blake2b(data, digest_size=16, person=b"agentspec.seed").digest()


def row_keys(key: bytes, positions: range | list[int]) -> np.ndarray:
    """The 64-bit stream key of each output position under ``key`` ``[len(positions)]``."""
    out = np.empty(len(positions), dtype=np.uint64)
    for i, t in enumerate(positions):
        if t < 0:
            raise ConfigError(f"output position must be >= 0, got {t}")
        digest = hashlib.blake2b(t.to_bytes(8, "little"), digest_size=8, key=key).digest()
        out[i] = int.from_bytes(digest, "little")
    return out


def keyed_exponentials(rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Exp(1) noise ``[N, len(ids)]`` of token ids ``ids`` in the streams ``rows`` ``[N]``.

    Uniforms carry 53 random bits and lie in (0, 1), so ``-log u`` is finite and > 0.
    """
    ids = ids.astype(np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2**64 by design
        z = rows[:, None] + (ids[None, :] + np.uint64(1)) * _GAMMA  # [N, n]
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z = z ^ (z >> np.uint64(31))
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)
    return -np.log(u)


def request_key(sampling: SamplingParams | None) -> bytes | None:
    """The noise key of a seeded sampled request; ``None`` for greedy, unseeded or unknown
    requests (which keep the usual generators)."""
    if sampling is None or sampling.greedy or sampling.seed is None:
        return None
    return seed_key(sampling.seed)


def keyed_choice(
    probs: torch.Tensor, rows: np.ndarray, ids: np.ndarray | None = None
) -> torch.Tensor:
    """One exact draw per row of ``probs`` ``[N, n]`` with the noise of streams ``rows`` [N].

    Column ``c`` of ``probs`` is token id ``ids[c]`` (default: ``c``, the whole vocabulary);
    a drafter over a sub-vocabulary passes its ids so that it meets the same noise as the
    target's full distribution. Returns column indices ``[N]``.

    ``argmin_v E_v / p_v`` (Exp(1) race, i.e. Gumbel-max): ``P(v) = p_v`` exactly, tokens of
    zero mass are never chosen, and the same ``(probs, rows)`` always give the same ids.
    Two distributions sampled with the same ``rows`` agree as often as a Gumbel coupling
    allows (at least ``(1 - TV) / (1 + TV)``), which is what model drafters use.
    """
    if ids is None:
        vocab = probs.shape[-1]
        if vocab not in _COUNTERS:
            _COUNTERS[vocab] = np.arange(vocab, dtype=np.uint64)
        ids = _COUNTERS[vocab]
    e = keyed_exponentials(rows, ids)  # [N, n]
    p = probs.detach().to(torch.float64).cpu().numpy()  # [N, V]
    with np.errstate(divide="ignore"):
        race = e / p  # inf where p = 0
    return torch.from_numpy(np.argmin(race, axis=1))  # [N]


def keyed_sample(probs: torch.Tensor, key: bytes, position: int) -> int:
    """The keyed draw from one distribution ``probs`` ``[V]`` at output ``position``."""
    return int(keyed_choice(probs[None], row_keys(key, [position]))[0])
