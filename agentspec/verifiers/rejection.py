"""Standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

Token by token: draft token ``x_i`` drawn from ``q_i`` is accepted with probability
``min(1, p_i(x_i) / q_i(x_i))``. At the first rejection the verifier draws its own token
from the residual ``max(p_i - q_i, 0) / Z_i``; after a full accept it draws the bonus
token from ``p_k``. The committed tokens are then distributed exactly as plain sampling
from ``p`` (``p`` = :func:`agentspec.sampling.process_logits` of the target logits).

Deterministic drafts (``probs=None``) are point masses, ``q_i = onehot(x_i)``: the token
is accepted with probability ``p_i(x_i)`` and the residual is ``p_i`` with ``x_i`` zeroed.

The acceptance rule is written once, batched over independent trials (a leading ``N``
dimension), so the statistical tests run hundreds of thousands of verifications in one
call of exactly the code that serves requests (``N = 1``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from agentspec.errors import ConfigError
from agentspec.sampling import default_generator, draft_probs, normalise, process_logits, sample
from agentspec.types import Draft, SamplingParams, VerifyResult
from agentspec.verifiers.greedy import GreedyVerifier

__all__ = ["RejectionVerifier", "check_rows", "rejection_accept", "verifier_inputs"]


def rejection_accept(
    p: torch.Tensor,  # [N, k+1, V] target distributions (row i: after the draft prefix i)
    q: torch.Tensor,  # [N, k, V] draft distributions
    x: torch.Tensor,  # [N, k] drafted ids
    u: torch.Tensor,  # [N, k] uniforms in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level rejection sampling, batched over ``N`` trials.

    Returns:
        ``(n, next_dist)``: accepted lengths ``[N]`` and the distribution ``[N, V]`` the
        verifier's own token is drawn from (the residual at the first rejection, or
        ``p_k`` after a full accept).
    """
    n_rows, k = x.shape
    rows = torch.arange(n_rows)
    if k == 0:
        return torch.zeros(n_rows, dtype=torch.long), p[:, 0]
    p_x = p[:, :k].gather(2, x[:, :, None]).squeeze(2)  # [N, k]  p_i(x_i)
    q_x = q.gather(2, x[:, :, None]).squeeze(2)  # [N, k]  q_i(x_i) > 0
    # P(u < p/q) = min(1, p/q) for u ~ U[0, 1): the acceptance probability.
    accept = u < p_x / q_x  # [N, k]
    n = accept.long().cumprod(dim=1).sum(dim=1)  # [N] first rejection (k: none)
    # A zero row after q makes max(p_k - 0, 0) = p_k: the bonus case needs no branch.
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # [N, k+1, V]
    p_n = p[rows, n]  # [N, V]
    residual = (p_n - q_pad[rows, n]).clamp_min(0.0)  # [N, V]  max(p - q, 0)
    return n, normalise(residual, p_n)


def check_rows(draft: Draft, logits: torch.Tensor) -> None:
    """Raise :class:`ConfigError` unless ``logits`` has one row per draft token plus one."""
    if draft.parents is not None and draft.is_tree:
        raise ConfigError("sampling verifiers verify chain drafts, got a tree draft")
    k = len(draft.tokens)
    if logits.dim() != 2 or logits.shape[0] != k + 1:
        raise ConfigError(
            f"expected logits of shape [{k + 1}, V] for a {k}-token draft, "
            f"got {tuple(logits.shape)}"
        )


def verifier_inputs(
    draft: Draft, logits: torch.Tensor, sampling: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batched ``(p [1, k+1, V], q [1, k, V], x [1, k])`` of one draft."""
    check_rows(draft, logits)
    vocab = logits.shape[-1]
    x = torch.tensor(draft.tokens, dtype=torch.long)  # [k]
    p = process_logits(logits, sampling)  # [k+1, V]
    q = draft_probs(x, draft.probs, vocab)  # [k, V]
    return p[None], q[None], x[None]


def result_from(draft: Draft, n: int, token: int) -> VerifyResult:
    """The committed block: ``n`` accepted draft tokens plus the verifier's token."""
    return VerifyResult(
        tokens=[*draft.tokens[:n], token], num_accepted=n, accepted_path=list(range(n))
    )


AcceptRule = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


class SingleDraftSampler:
    """Verification of one draft with a lossless acceptance rule on uniform draws.

    ``rule(p, q, x, u)`` returns the accepted length per row and the distribution of the
    token drawn after it (correction or bonus); the rejection and block rules differ only
    there. Greedy requests (temperature 0) are served by the strict greedy rule, which is
    what both rules reduce to when the target distribution is a point mass.

    Args:
        rule: The acceptance rule.
    """

    lossless = True
    name = "single_draft"

    def __init__(self, rule: AcceptRule) -> None:
        self._greedy = GreedyVerifier()
        self._rule = rule

    def verify(
        self,
        draft: Draft,
        logits: torch.Tensor,  # [k+1, V]
        sampling: SamplingParams,
        rng: torch.Generator | None = None,
        *,
        request_id: str | None = None,
    ) -> VerifyResult:
        """Accept the prefix the rule selects, then draw one token."""
        if sampling.greedy:
            return self._greedy.verify(draft, logits, sampling)
        # Verification runs on the CPU, with the request's CPU generator (a no-op for the
        # target's logits, which come back there).
        p, q, x = verifier_inputs(draft, logits.cpu(), sampling)
        gen = default_generator(rng, sampling)
        u = torch.rand(x.shape, generator=gen)  # [1, k]
        n, dist = self._rule(p, q, x, u)
        token = int(sample(dist, gen)[0])
        return result_from(draft, int(n[0]), token)


class RejectionVerifier(SingleDraftSampler):
    """Standard token-by-token speculative sampling (lossless for any temperature)."""

    name = "rejection"

    def __init__(self) -> None:
        super().__init__(rejection_accept)
