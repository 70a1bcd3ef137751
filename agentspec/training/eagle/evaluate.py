"""The one evaluation of an EAGLE head: held-out agreement with the target's greedy token.

:func:`evaluate_head` runs the head's passes (:func:`~.loss.passes`) over held-out rows, in
order, and counts how often the draft token of each depth equals the target's
full-vocabulary argmax at that position. Answer (generated) positions are what counts
(``top1``, ``top1_depth2``, ...): the prompt's chat template would flatter the head;
``top1_all`` is depth 1 over every position. With ``feature_weight`` it also reports the
depth-1 loss on answer positions (:func:`~.loss.soft_loss`, the CPU recipe's ``loss``).

Both recipes call it, before and after training: the CPU recipe at depths 1-2 with the loss
(:func:`~.train.train_head`), self-distillation at depths 1-3 (:func:`~.recipe.run_recipe`).
"""

from __future__ import annotations

from typing import Any

import torch

from agentspec.training.eagle.data import Batch, FeatureRows
from agentspec.training.eagle.loss import passes, soft_loss, teacher_probs

__all__ = ["evaluate_head", "format_metrics"]


class _Tally:
    """Hits and positions, summed on the device; read once at the end."""

    def __init__(self, depth: int, device: torch.device) -> None:
        self.hits = torch.zeros(depth, device=device)  # [depth] answer positions
        self.hits_all = torch.zeros((), device=device)  # depth 1, every position
        self.n_gen = torch.zeros((), device=device)
        self.n_all = torch.zeros((), device=device)
        self.loss = 0.0  # sum over batches of (mean loss * answer positions)

    def result(self, depth: int, with_loss: bool) -> dict[str, float]:
        h = self.hits.tolist()
        ng, na = max(float(self.n_gen), 1.0), max(float(self.n_all), 1.0)
        res = {"top1": h[0] / ng, "top1_all": float(self.hits_all) / na,
               "positions": float(self.n_gen), "positions_all": float(self.n_all)}
        for k in range(1, depth):
            res[f"top1_depth{k + 1}"] = h[k] / ng
        if with_loss:
            res["loss"] = self.loss / ng
        return res


def _count(head: Any, batch: Batch, ids: torch.Tensor, full_head: torch.Tensor,
           depth: int, feature_weight: float | None, tally: _Tally) -> None:
    """Add one batch's hits (and loss) to ``tally``."""
    gen_w = batch.weights(0.0)  # [B, w-1]: 1 on answer pairs
    gen, real = gen_w > 0, batch.weights(1.0) > 0  # [B, w-1] each
    outs = passes(head, batch.tokens, batch.feats, batch.pos, depth)  # [B, w-1, H] each
    f_next = batch.feats[:, 1:]  # [B, w-1, H]
    want = (f_next @ full_head.T).argmax(-1)  # [B, w-1] the target's greedy token
    for k, g in enumerate(outs):
        ok = ids[head.logits(g).argmax(-1)] == want  # [B, w-1]
        tally.hits[k] += (ok & gen).sum()
        if k == 0:
            tally.hits_all += (ok & real).sum()
    n = gen.sum()
    tally.n_gen += n
    tally.n_all += real.sum()
    if feature_weight is not None:
        teacher = teacher_probs(head, f_next)
        loss = soft_loss(head, outs[0], f_next, gen_w, feature_weight, teacher)
        tally.loss += float(loss) * int(n)


@torch.no_grad()
def evaluate_head(head: Any, rows: FeatureRows, full_head: torch.Tensor, *, batch_rows: int = 8,
             depth: int = 3, feature_weight: float | None = None) -> dict[str, float]:
    """Held-out top-1 agreement of ``head`` with the target's full-vocabulary argmax.

    Args:
        head: The EAGLE head, on the rows' device (in evaluation mode).
        rows: The held-out rows.
        full_head: The target's output embedding ``[V, H]`` (float).
        batch_rows: Sequences per forward.
        depth: Drafting depths measured (1 or more).
        feature_weight: λ of the loss reported as ``loss`` (``None``: no loss).

    Returns:
        ``top1`` and ``top1_depth2`` .. ``top1_depth{depth}`` (answer positions),
        ``top1_all`` (depth 1 on every position), the position counts ``positions``
        (answer) and ``positions_all``, and ``loss`` when ``feature_weight`` is given.
    """
    dev = rows.tokens.device
    ids = torch.tensor(head.spec.draft_vocab, device=dev)  # [N] draft row -> vocabulary id
    tally = _Tally(depth, dev)
    for batch in rows.in_order(batch_rows):
        _count(head, batch, ids, full_head, depth, feature_weight, tally)
    return tally.result(depth, feature_weight is not None)


def format_metrics(m: dict[str, float]) -> str:
    """One log line of :func:`evaluate_head`'s agreements and answer positions."""
    parts = [f"{k} {v:.3f}" for k, v in m.items() if k.startswith("top1")]
    return ", ".join(parts) + f" ({int(m.get('positions', 0)):,} generated positions)"
