"""Greedy block verification, GBV (Sun et al., "Block Verification Accelerates Speculative
Decoding", arXiv 2403.10444).

Token-level rejection sampling stops at the first rejected token even when the tokens
after it would have made the block as a whole acceptable. Block verification decides on
the whole block. With ``M_b`` the target and ``M_s`` the draft distribution, for a draft
``X_1..X_γ`` (γ = k):

    p_0 = 1,    p_i = min(p_{i-1} · M_b(X_i | X^{i-1}) / M_s(X_i | X^{i-1}), 1)
    r_i(x) = max(p_i · M_b(x | X^i) - M_s(x | X^i), 0),    Z_i = Σ_x r_i(x)
    h_i = Z_i / (Z_i + 1 - p_i)  for i < γ,    h_γ = p_γ
    η_i ~ U[0, 1),    τ = max({0} ∪ {i ≥ 1 : η_i < h_i})

then commit ``X^τ`` followed by one token from ``r_τ / Z_τ`` (``τ < γ``) or from
``M_b(· | X^γ)`` (``τ = γ``, the bonus token). The output is distributed exactly as
sampling from ``M_b``, and the expected accepted length is never below token-level
rejection sampling's (the paper's Theorem 2; measured in the unit tests).

``block_accept`` takes two generalisations the multi-draft verifier needs: a per-row
start depth ``d`` (positions ``≤ d`` are already committed, ``p_d = 1``) and a
replacement ``first`` for the target distribution at depth ``d`` (the residual a previous
draft left behind). ``d = 0`` with ``first = M_b(· | ∅)`` is plain GBV.
"""

from __future__ import annotations

import torch

from agentspec.sampling import normalise
from agentspec.verifiers.rejection import SingleDraftSampler

__all__ = ["BlockVerifier", "block_accept"]

# Guards 0/0 in h_i: Z_i + 1 - p_i = 0 only when p_i = 1 and Z_i = 0, and then a later
# h_j is 1 (see the module docstring of multi_draft), so any finite value is correct.
_TINY = 1e-30


def block_weights(
    p: torch.Tensor,  # [N, k+1, V] target distributions, first row already replaced
    q: torch.Tensor,  # [N, k, V]
    x: torch.Tensor,  # [N, k]
    start: torch.Tensor,  # [N] depth where the block starts (p_start = 1)
) -> torch.Tensor:
    """The block weights ``p_i`` for ``i = 0..k`` ``[N, k+1]`` (1 up to ``start``)."""
    n_rows, k = x.shape
    p_x = p[:, :k].gather(2, x[:, :, None]).squeeze(2)  # [N, k]  M_b(X_{i+1} | X^i)
    q_x = q.gather(2, x[:, :, None]).squeeze(2)  # [N, k]  M_s(X_{i+1} | X^i) > 0
    ratio = p_x / q_x  # [N, k]
    w = torch.ones(n_rows, k + 1)
    # The min(., 1) makes this a sequential recursion (not a cumprod); k is small.
    for i in range(1, k + 1):
        step = torch.minimum(w[:, i - 1] * ratio[:, i - 1], torch.ones(n_rows))
        w[:, i] = torch.where(start >= i, torch.ones(n_rows), step)
    return w


def block_accept(
    p: torch.Tensor,  # [N, k+1, V] target distributions M_b along each draft
    q: torch.Tensor,  # [N, k, V] draft distributions M_s
    x: torch.Tensor,  # [N, k] drafted ids
    eta: torch.Tensor,  # [N, k] uniforms in [0, 1) for positions 1..k
    start: torch.Tensor | None = None,  # [N] first undecided depth (default 0)
    first: torch.Tensor | None = None,  # [N, V] target distribution at depth `start`
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy block verification, batched over ``N`` trials.

    Returns:
        ``(tau, next_dist)``: accepted lengths ``[N]`` (counted from depth 0, ``≥ start``)
        and the distribution ``[N, V]`` of the verifier's own token: ``r_τ / Z_τ`` when
        ``τ < k``, else the target distribution after the whole draft.
    """
    n_rows, k = x.shape
    rows = torch.arange(n_rows)
    start = torch.zeros(n_rows, dtype=torch.long) if start is None else start
    if first is not None:
        p = p.clone()
        p[rows, start] = first  # M_b at the start depth is the inherited residual
    if k == 0:
        return torch.zeros(n_rows, dtype=torch.long), p[:, 0]
    w = block_weights(p, q, x, start)  # [N, k+1]
    # r_i(x) = max(p_i · M_b(x | X^i) - M_s(x | X^i), 0) for i = 0..k-1.
    residual = (w[:, :k, None] * p[:, :k] - q).clamp_min(0.0)  # [N, k, V]
    z = residual.sum(dim=-1)  # [N, k]
    h = torch.empty(n_rows, k)  # h_1..h_k
    h[:, : k - 1] = z[:, 1:] / (z[:, 1:] + 1.0 - w[:, 1:k]).clamp_min(_TINY)
    h[:, k - 1] = w[:, k]
    depth = torch.arange(1, k + 1)  # [k]
    # Positions at or before `start` are already committed: they never decide τ.
    passed = (eta < h) & (depth[None, :] > start[:, None])  # [N, k]
    tau = torch.maximum((passed.long() * depth).amax(dim=1), start)  # [N]
    full = tau == k
    safe_tau = tau.clamp_max(k - 1)
    res_tau = normalise(residual[rows, safe_tau], p[rows, safe_tau])  # [N, V]
    next_dist = torch.where(full[:, None], p[:, k], res_tau)
    return tau, next_dist


class BlockVerifier(SingleDraftSampler):
    """Greedy block verification (GBV): lossless, accepts at least as much as token-level
    rejection sampling in expectation. The default sampling verifier."""

    name = "block"

    def __init__(self) -> None:
        super().__init__(block_accept)
