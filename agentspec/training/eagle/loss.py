"""The EAGLE loss: the head's passes over a batch and what they are scored against.

Per sequence, over pairs ``i = 0 .. T-2`` (input ``(F_i, x_{i+1})``, target ``F_{i+1}``)::

    pass 1:  g¹ = head(F_i, x_{i+1})                        (true features in)
    pass 2:  g² = head(g¹_{i-1}, x_{i+1})                   (its own predictions in)
    pass k:  gᵏ = head(gᵏ⁻¹_{i-1}, x_{i+1})                 (evaluation only, k >= 3)
    loss   = Σ_pass  CE(softmax(F_{i+1} W_N^T), g W_N^T) + λ · SmoothL1(g, F_{i+1})

The soft cross-entropy matches the target's distribution over the draft vocabulary ``N``
(what drafting needs); the feature regression keeps ``g`` usable as the next input. Pass 2
is a cheap version of EAGLE-3's "training-time test": at drafting time every token after
the first is predicted from the head's own features, and a head trained on true features
only degrades fast with depth. Pass 2 weighs ``depth2_weight`` relative to pass 1.

Each pair has a weight (:func:`pair_weights`): 1 where the predicted token is an answer
(generated) token, ``prompt_weight`` inside the prompt (mostly the chat template, easy and
unlike what drafting meets), 0 on padding. The loss is the weighted mean over pairs.

Everything here works on one batch of right-padded rows (:class:`~.data.Batch`); the fit
loop (:mod:`.fit`) and the evaluation (:mod:`.evaluate`) are its two callers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["pair_loss", "pair_weights", "passes", "soft_loss", "teacher_probs"]


def passes(head: Any, toks: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor,
           depth: int) -> list[torch.Tensor]:
    """The head's outputs over every pair of a batch, passes 1 to ``depth``.

    Pass k reads pass k-1's prediction of the feature (pass 1 the true one): the input at
    pair i is the prediction made at pair i - 1 (pair 0 keeps the true feature).

    Args:
        head: The EAGLE head (:class:`~agentspec.drafters.model.eagle_head.EagleHead`).
        toks: Right-padded token ids ``[B, T]``.
        feats: The target's features ``[B, T, H]`` (float).
        pos: The pair positions ``[T-1]`` (``arange``), on the batch's device.
        depth: Passes run (1 or more).

    Returns:
        One ``[B, T-1, H]`` tensor per pass.
    """
    f_in, x_in = feats[:, :-1], toks[:, 1:]  # [B, T-1, H], [B, T-1]
    outs = [head(f_in, x_in, pos)]
    for _ in range(depth - 1):
        f_k = torch.cat([f_in[:, :1], outs[-1][:, :-1]], dim=1)  # [B, T-1, H]
        outs.append(head(f_k, x_in, pos))
    return outs


def pair_weights(lengths: torch.Tensor, starts: torch.Tensor, width: int,
                 prompt_weight: float) -> torch.Tensor:
    """Loss weights ``[B, W-1]`` of the (feature, next token) pairs of right-padded rows.

    Pair i (predicting token i + 2) weighs 1 when that token is an answer (generated)
    token, ``prompt_weight`` inside the prompt, 0 on padding.

    Args:
        lengths: The rows' lengths ``[B]``.
        starts: The rows' first answer positions (prompt lengths) ``[B]``.
        width: The rows' padded width ``W``.
        prompt_weight: Weight of prompt positions.
    """
    c = torch.arange(width - 1, device=lengths.device)[None, :]  # [1, W-1]
    real = c < (lengths[:, None] - 1)  # [B, W-1]
    gen = (c + 2) >= starts[:, None]  # [B, W-1]
    return real.float() * torch.where(gen, 1.0, prompt_weight)


def teacher_probs(head: Any, f_next: torch.Tensor) -> torch.Tensor:
    """The target's distribution over the draft vocabulary ``[B, T-1, N]`` (no gradient).

    Args:
        head: The EAGLE head (its :meth:`logits` are the target's LM-head rows).
        f_next: The target's features at the predicted positions ``[B, T-1, H]``.
    """
    with torch.no_grad():
        return torch.softmax(head.logits(f_next).float(), dim=-1)  # [B, T-1, N]


def soft_loss(head: Any, g: torch.Tensor, f_next: torch.Tensor, weight: torch.Tensor,
              feature_weight: float, teacher: torch.Tensor) -> torch.Tensor:
    """Weighted mean over pairs of soft cross-entropy + λ · smooth L1 for one pass.

    Args:
        head: The EAGLE head.
        g: The pass's predicted features ``[B, T-1, H]``.
        f_next: The true next features ``[B, T-1, H]``.
        weight: Pair weights ``[B, T-1]`` (:func:`pair_weights`).
        feature_weight: λ, the weight of the feature regression.
        teacher: :func:`teacher_probs` of ``f_next`` ``[B, T-1, N]``.
    """
    ce = -(teacher * torch.log_softmax(head.logits(g).float(), dim=-1)).sum(-1)  # [B, T-1]
    reg = F.smooth_l1_loss(g.float(), f_next, reduction="none").mean(-1)  # [B, T-1]
    per = ce + feature_weight * reg  # [B, T-1]
    return (per * weight).sum() / weight.sum().clamp(min=1e-6)


def pair_loss(head: Any, toks: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor,
              weight: torch.Tensor, feature_weight: float,
              depth2_weight: float) -> torch.Tensor:
    """The training loss of one batch: pass 1 plus ``depth2_weight`` times pass 2.

    Args:
        head: The EAGLE head (in training mode).
        toks: Right-padded token ids ``[B, T]``.
        feats: The target's features ``[B, T, H]`` (float).
        pos: The pair positions ``[T-1]``.
        weight: Pair weights ``[B, T-1]`` (:func:`pair_weights`).
        feature_weight: λ of the feature regression.
        depth2_weight: Weight of the second (own-prediction) pass.
    """
    g1, g2 = passes(head, toks, feats, pos, 2)  # [B, T-1, H] each
    f_next = feats[:, 1:]  # [B, T-1, H]
    teacher = teacher_probs(head, f_next)
    loss = soft_loss(head, g1, f_next, weight, feature_weight, teacher)
    return loss + depth2_weight * soft_loss(head, g2, f_next, weight, feature_weight, teacher)
