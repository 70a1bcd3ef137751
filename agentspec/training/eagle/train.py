"""The CPU recipe: train the EAGLE head on teacher sequences (``train-drafter --kind eagle``).

Data: the same teacher sequences as the distilled drafter (the target's own greedy chat
answers and the workload documents, :mod:`agentspec.training.corpus`). One target forward
per sequence gives its final-norm features ``F [T, H]``
(:func:`~.selfgen.extract_features`); nothing else is needed, because the target's
next-token distribution at position ``i`` is ``softmax(F_i W^T)``.

:func:`train_head` holds out a share of the sequences (split by sequence, seeded), measures
the head on them (:func:`~.evaluate.evaluate_head`: top-1 agreement of the first draft token
with the target's full-vocabulary argmax, ``top1``, and of the second, drafted from the
head's own feature, ``top1_depth2``, on answer positions, and the loss), trains it with the
one fit loop (:func:`~.fit.fit_head`: the loss of :mod:`.loss`, linear warm-up and decay,
the loss read every step for the progress bar) and measures it again.

The self-distillation recipe on a device (:mod:`.recipe`) shares the loss, the batching, the
fit loop and the evaluation; only the data and the budget differ.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from agentspec.errors import TrainingDataError
from agentspec.training.eagle.config import TrainEagleConfig
from agentspec.training.eagle.data import FeatureRows, FeatureSeq
from agentspec.training.eagle.evaluate import evaluate_head
from agentspec.training.eagle.fit import fit_head

__all__ = ["train_head"]


class _Bar:
    """The fit loop's progress as a tqdm bar (:class:`~.fit.FitProgress`), one tick a step."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(desc="train EAGLE head", unit="step", disable=not enabled, total=total)

    def started(self, rows: int, batches: int) -> None:
        """Nothing to show before the first step."""

    def logged(self, step: int, epoch: int, loss: float, rate: float, positions: int) -> None:
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{loss:.3f}")

    def close(self) -> None:
        self.bar.close()


def _split(data: Sequence[FeatureSeq], share: float, rng: random.Random
           ) -> tuple[list[FeatureSeq], list[FeatureSeq]]:
    """``(train, held_out)``: a seeded shuffle, the first ``share`` held out (at least one
    when ``share > 0``)."""
    order = list(range(len(data)))
    rng.shuffle(order)
    n_val = max(1, int(len(order) * share)) if share > 0 else 0
    return [data[i] for i in order[n_val:]], [data[i] for i in order[:n_val]]


def _measure(head: Any, val: FeatureRows | None, full_head: torch.Tensor) -> dict[str, float]:
    """Held-out metrics at depths 1-2 with the loss (at the default λ), or nothing."""
    if val is None:
        return {}
    return evaluate_head(head, val, full_head, batch_rows=8, depth=2,
                         feature_weight=TrainEagleConfig().feature_weight)


def train_head(
    head: Any, data: Sequence[FeatureSeq], full_head: torch.Tensor,
    cfg: TrainEagleConfig, deadline: float, progress: bool = True,
) -> dict[str, Any]:
    """Train ``head`` in place until ``deadline`` (``time.monotonic()``) or ``cfg.steps``.

    Args:
        head: The EAGLE head (fresh or read back), on the data's device.
        data: The sequences and their features (:func:`~.selfgen.extract_features`).
        full_head: The target's LM head ``[V, H]`` (for its full-vocabulary argmax).
        cfg: The recipe's settings.
        deadline: ``time.monotonic()`` at which a clock-driven run stops.
        progress: Show a progress bar.

    Returns:
        A report: steps, epochs, train seconds, and held-out metrics before and after.

    Raises:
        TrainingDataError: fewer than 2 sequences (nothing to split).
    """
    if len(data) < 2:
        raise TrainingDataError(f"{len(data)} training sequence(s): need at least 2")
    rng = random.Random(cfg.seed)
    train, val = _split(data, cfg.val_share, rng)
    val_rows = FeatureRows.from_seqs(val) if val else None
    before = _measure(head, val_rows, full_head)
    stats: dict[str, Any] = {"steps": 0, "epochs": 0}
    bar = _Bar(cfg.steps, progress)
    start = time.monotonic()
    try:
        fit_head(head, FeatureRows.from_seqs(train), cfg.fit_config(), rng=rng,
                 deadline=deadline, stats=stats, progress=bar)
    finally:
        bar.close()
    head.eval()
    after = _measure(head, val_rows, full_head)
    return {"steps": stats["steps"], "epochs": stats["epochs"],
            "train_s": round(time.monotonic() - start, 1), "train_sequences": len(train),
            "val_sequences": len(val), "val_before": before, "val_after": after}
