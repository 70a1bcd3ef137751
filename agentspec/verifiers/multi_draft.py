"""Multi-draft block verification over K i.i.d. drafts (SpecTr-GBV style).

SpecTr-GBV (Lin et al., arXiv 2604.25925) verifies K drafts drawn i.i.d. from the drafter
with greedy block verification (GBV, :mod:`agentspec.verifiers.block`), so the accepted
length grows with K while the output stays distributed exactly as the target's. This
module implements a lossless scheme of that kind, *sequential residual chaining*:

1. Run GBV on draft 1 against the target. It yields an accepted depth ``τ_1`` and, when
   ``τ_1 < γ``, the law ``R_1 = r_{τ_1} / Z_{τ_1}`` of the next token: the output is
   ``X^{τ_1}``, then a token from ``R_1``, then the target ``M_b`` onwards.
2. Draft ``j + 1`` is *eligible* if its first ``τ_j`` tokens equal the accepted prefix.
   Then its continuation is a fresh draw from ``M_s(· | X^{τ_j})``, independent of
   everything seen so far (the drafts are i.i.d.). Run GBV on that continuation against
   the *pending* block law "first token from ``R_j``, then ``M_b``" (``block_accept``
   with ``start = τ_j``, ``first = R_j``). GBV is exact for any pair of block laws, so
   the pending law is still sampled exactly, now as a longer accepted prefix plus a new
   pending residual ``R_{j+1}``. An ineligible draft is skipped: that decision looks
   only at the draft itself, never at the pending sample.
3. After a full accept (``τ = γ``) or the last draft, draw the verifier's own token from
   the pending law.

By induction over the drafts the committed tokens are distributed as plain sampling from
``M_b``; with K = 1 this is exactly GBV, and every extra eligible draft can only extend
the accepted prefix, so the expected accepted length grows with K (measured in the tests).
The drafts are scored by the target in one batched forward (``MultiDraftDecoder``).

Why ``h_i``'s 0/0 case does not matter: ``Z_i + 1 - p_i = 0`` means ``p_i = 1`` and
``M_b(· | X^i) = M_s(· | X^i)``, so ``p_{i+1} = 1`` as well, and the first later
position with ``Z_j > 0`` (or the last one, ``h_γ = p_γ = 1``) has ``h_j = 1``:
``τ > i`` whatever value ``h_i`` takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentspec.errors import ConfigError
from agentspec.sampling import default_generator, draft_probs, process_logits, sample
from agentspec.types import Draft, SamplingParams, VerifyResult
from agentspec.verifiers.block import BlockVerifier, block_accept
from agentspec.verifiers.rejection import result_from

__all__ = ["MultiDraftVerifier", "MultiVerifyResult", "multi_draft_accept"]


@dataclass(frozen=True)
class MultiVerifyResult:
    """What multi-draft verification commits.

    Attributes:
        result: Accepted prefix of draft ``draft_index`` plus the verifier's token.
        draft_index: The draft whose prefix was accepted (its KV rows are kept).
    """

    result: VerifyResult
    draft_index: int


def multi_draft_accept(
    p: torch.Tensor,  # [N, K, k+1, V] target distributions along each draft
    q: torch.Tensor,  # [N, K, k, V] draft distributions
    x: torch.Tensor,  # [N, K, k] drafted ids, K i.i.d. drafts per trial
    eta: torch.Tensor,  # [N, K, k] uniforms in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequential residual chaining of GBV over K drafts, batched over ``N`` trials.

    Returns:
        ``(tau, chosen, next_dist)``: accepted lengths ``[N]``, index of the draft whose
        prefix is accepted ``[N]`` and the law ``[N, V]`` of the verifier's own token.
    """
    n_rows, n_drafts, k = x.shape
    rows = torch.arange(n_rows)
    tau = torch.zeros(n_rows, dtype=torch.long)
    chosen = torch.zeros(n_rows, dtype=torch.long)
    pending = p[:, 0, 0].clone()  # [N, V] law of the next token after the accepted prefix
    done = torch.zeros(n_rows, dtype=torch.bool)
    for j in range(n_drafts):
        # Eligible: not finished, and the draft's first tau tokens are the accepted prefix.
        same = (x[:, j] == x[rows, chosen]).long()  # [N, k]
        common = same.cumprod(dim=1).sum(dim=1)  # [N]
        eligible = ~done & (common >= tau)
        if not bool(eligible.any()):
            continue
        t_j, dist_j = block_accept(p[:, j], q[:, j], x[:, j], eta[:, j], tau, pending)
        tau = torch.where(eligible, t_j, tau)
        pending = torch.where(eligible[:, None], dist_j, pending)
        chosen = torch.where(eligible, torch.full_like(chosen, j), chosen)
        done = done | (eligible & (t_j == k))
    return tau, chosen, pending


class MultiDraftVerifier:
    """Lossless verification of K i.i.d. drafts (one draft: plain GBV).

    Implements the single-draft :class:`~agentspec.interfaces.Verifier` protocol (so it
    also serves the ordinary engine) plus :meth:`verify_many` for ``MultiDraftDecoder``.
    """

    lossless = True
    name = "multi_draft"

    def __init__(self) -> None:
        self._single = BlockVerifier()

    def verify(
        self,
        draft: Draft,
        logits: torch.Tensor,  # [k+1, V]
        sampling: SamplingParams,
        rng: torch.Generator | None = None,
        *,
        request_id: str | None = None,
    ) -> VerifyResult:
        """Verify one draft (GBV)."""
        return self._single.verify(draft, logits, sampling, rng, request_id=request_id)

    def verify_many(
        self,
        drafts: Sequence[Draft],
        logits: torch.Tensor,  # [K, k+1, V]: row j scores [pending, *drafts[j]]
        sampling: SamplingParams,
        rng: torch.Generator | None = None,
    ) -> MultiVerifyResult:
        """Verify K equal-length chain drafts scored in one batched forward.

        Raises:
            ConfigError: no drafts, unequal lengths, or logits of the wrong shape.
        """
        if not drafts:
            raise ConfigError("verify_many needs at least one draft")
        k = len(drafts[0].tokens)
        if any(len(d.tokens) != k or d.is_tree for d in drafts):
            raise ConfigError("verify_many needs chain drafts of equal length")
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (len(drafts), k + 1):
            raise ConfigError(
                f"expected logits of shape [{len(drafts)}, {k + 1}, V], "
                f"got {tuple(logits.shape)}"
            )
        logits = logits.cpu()  # verification runs on the CPU (a no-op for target logits)
        vocab = logits.shape[-1]
        x = torch.tensor([d.tokens for d in drafts], dtype=torch.long).reshape(len(drafts), k)
        q = torch.stack([draft_probs(x[j], d.probs, vocab) for j, d in enumerate(drafts)])
        p = process_logits(logits, sampling)  # [K, k+1, V]
        gen = default_generator(rng, sampling)
        eta = torch.rand(x.shape, generator=gen)  # [K, k]
        tau, chosen, dist = multi_draft_accept(p[None], q[None], x[None], eta[None])
        token = int(sample(dist, gen)[0])
        j = int(chosen[0])
        return MultiVerifyResult(result_from(drafts[j], int(tau[0]), token), j)
