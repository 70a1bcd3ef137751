"""The one fit loop of the EAGLE head, for both recipes.

:func:`fit_head` trains the head on :class:`~.data.FeatureRows` with the loss of :mod:`.loss`:
length-bucketed batches of whole sequences (:func:`~.data.length_batches`) in a fresh random
order every epoch, AdamW (fused on CUDA) with a warm-up and a decay tied to the step count
or to the clock (:meth:`~.config.FitConfig.rate`), gradient clipping at 1, bf16 autocast on
CUDA. It reads the loss only every ``log_every`` steps, so the GPU never waits on the host
between reads; each read checks that training has not diverged and tells the caller's
:class:`FitProgress` (a progress bar, or log lines).

The recipes differ only in settings (:class:`~.config.FitConfig`): the CPU recipe decays
linearly and reads every step; self-distillation decays by a cosine, reads every 50 steps
and asks for one checkpoint half-way through a clock-driven run.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from agentspec.errors import TrainingDataError
from agentspec.training.eagle.config import FitConfig
from agentspec.training.eagle.data import Batch, FeatureRows, length_batches
from agentspec.training.eagle.loss import pair_loss

__all__ = ["FitProgress", "fit_head"]


class FitProgress(Protocol):
    """Where :func:`fit_head` reports how training goes."""

    def started(self, rows: int, batches: int) -> None:
        """Training begins on ``rows`` sequences in ``batches`` batches."""

    def logged(self, step: int, epoch: int, loss: float, rate: float, positions: int) -> None:
        """A loss read: the mean ``loss`` since the last read, after ``step`` steps."""


class _Meter:
    """The loss and the trained positions, summed on the device between reads."""

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), device=device)
        self.positions = torch.zeros((), device=device)
        self.last = 0  # the step of the last read

    def add(self, loss: torch.Tensor, weight: torch.Tensor) -> None:
        self.loss += loss
        self.positions += (weight > 0).sum()

    def read(self, step: int) -> float:
        """The mean loss since the last read (one wait on the device), then reset."""
        mean = float(self.loss) / (step - self.last)
        self.loss.zero_()
        self.last = step
        return mean


def _train_step(head: Any, opt: torch.optim.Optimizer, params: list[torch.Tensor],
                batch: Batch, weight: torch.Tensor, cfg: FitConfig) -> torch.Tensor:
    """One optimiser step on ``batch``; returns its loss (not read)."""
    dev = batch.tokens.device
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        loss = pair_loss(head, batch.tokens, batch.feats, batch.pos, weight,
                         cfg.feature_weight, cfg.depth2_weight)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss.detach()


def _read(meter: _Meter, step: int, stats: dict[str, Any], rate: float,
          progress: FitProgress | None) -> None:
    """Read the loss: raise when it diverged, record it, tell ``progress``."""
    mean = meter.read(step)
    if not math.isfinite(mean):
        raise TrainingDataError(f"training diverged (loss {mean}) at step {step}")
    stats["loss"] = round(mean, 4)
    if progress is not None:
        progress.logged(step, stats["epochs"], mean, rate, int(meter.positions))


def fit_head(
    head: Any, rows: FeatureRows, cfg: FitConfig, *, rng: random.Random, deadline: float,
    stats: dict[str, Any], progress: FitProgress | None = None,
    checkpoint: Callable[[int], None] | None = None,
) -> None:
    """Train ``head`` in place until ``deadline`` (or for exactly ``cfg.steps`` steps).

    Args:
        head: The EAGLE head, on the rows' device (left in training mode).
        rows: The training rows.
        cfg: The loop's settings.
        rng: Shuffles the batch order.
        deadline: ``time.monotonic()`` at which a clock-driven run stops (checked after
            every step, and before the first).
        stats: Filled in as training goes: ``steps``, ``epochs``, ``loss`` (the mean of
            the last read), ``positions_trained``.
        progress: Told when training starts and at every loss read.
        checkpoint: Called once with the step count half way through a clock-driven run.

    Raises:
        TrainingDataError: no row of at least 3 tokens, or the loss diverged.
    """
    dev = rows.tokens.device
    batches = length_batches(rows.lengths, cfg.batch_rows)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0,
                            fused=dev.type == "cuda" or None)
    if progress is not None:
        progress.started(len(rows), len(batches))
    head.train()
    stats.setdefault("steps", 0)
    stats.setdefault("epochs", 0)
    tstart = time.monotonic()
    budget = max(1.0, deadline - tstart)
    meter = _Meter(dev)
    step = 0
    pending = cfg.steps is None and checkpoint is not None  # one mid-run checkpoint
    done = time.monotonic() >= deadline and cfg.steps is None
    while not done:
        stats["epochs"] += 1
        order = list(batches)
        rng.shuffle(order)
        for idx, width in order:
            frac = step / cfg.steps if cfg.steps else (time.monotonic() - tstart) / budget
            rate = cfg.rate(step, frac)
            for group in opt.param_groups:
                group["lr"] = rate
            batch = rows.batch(idx, width)
            weight = batch.weights(cfg.prompt_weight)  # [B, w-1]
            meter.add(_train_step(head, opt, params, batch, weight, cfg), weight)
            step += 1
            if step % cfg.log_every == 0:
                _read(meter, step, stats, rate, progress)
            stats["steps"] = step
            if pending and checkpoint is not None and frac >= 0.5:
                pending = False
                checkpoint(step)
            if (cfg.steps is not None and step >= cfg.steps) or (
                    cfg.steps is None and time.monotonic() > deadline):
                done = True
                break
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    stats["positions_trained"] = int(meter.positions)
    if step > meter.last:
        stats["loss"] = round(float(meter.loss) / (step - meter.last), 4)
