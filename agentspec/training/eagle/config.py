"""The settings of EAGLE head training: the fit loop's, and each recipe's.

:class:`FitConfig` is what the one fit loop (:func:`~.fit.fit_head`) reads. The two recipes keep
their own settings, with their own defaults, and hand the loop its part:
:class:`TrainEagleConfig` (the CPU recipe on teacher sequences, :func:`~.train.train_head`:
linear decay, the loss read every step) and :class:`ScaleConfig` (self-distillation on a
device, :func:`~.recipe.run_recipe`: cosine decay, the loss read every ``log_every`` steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from agentspec.errors import ConfigError

__all__ = ["FitConfig", "ScaleConfig", "TrainEagleConfig"]


def _check(cfg: object, checks: dict[str, bool]) -> None:
    for name, ok in checks.items():
        if not ok:
            raise ConfigError(f"invalid train-eagle setting {name}={getattr(cfg, name)!r}")


@dataclass(frozen=True)
class FitConfig:
    """Settings of the fit loop (:func:`~.fit.fit_head`).

    Attributes:
        batch_rows: Sequences per step (length-bucketed).
        lr: Peak AdamW learning rate.
        warmup: Linear warm-up steps.
        decay: After the warm-up, ``linear`` (to 5 % at the end, floored there) or
            ``cosine`` (to 5 % at the end).
        steps: Exact number of steps (``None``: until the deadline).
        log_every: Steps between reads of the loss (each read waits on the device).
        feature_weight: λ, the weight of the feature regression.
        depth2_weight: Weight of the second (own-prediction) pass.
        prompt_weight: Loss weight of prompt pairs relative to answer pairs.
    """

    batch_rows: int = 8
    lr: float = 2e-3
    warmup: int = 20
    decay: Literal["linear", "cosine"] = "linear"
    steps: int | None = None
    log_every: int = 1
    feature_weight: float = 0.2
    depth2_weight: float = 0.7
    prompt_weight: float = 1.0

    def rate(self, step: int, frac: float) -> float:
        """The learning rate of step ``step`` (0-based) at ``frac`` of the run."""
        warm = min(1.0, (step + 1) / max(1, self.warmup))
        if self.decay == "cosine":
            return self.lr * warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        return self.lr * warm * max(0.05, 1.0 - frac)


@dataclass(frozen=True)
class TrainEagleConfig:
    """Settings of :func:`~.train.train_head` (the CPU recipe).

    Attributes:
        batch_size: Sequences per step (right-padded; padding is masked out).
        max_len: Longest sequence trained (tokens; longer ones keep their tail).
        lr: Peak AdamW learning rate (linear warm-up, then linear decay to the deadline).
        feature_weight: λ, the weight of the feature regression.
        depth2_weight: Weight of pass 2 relative to pass 1.
        prompt_weight: Loss weight of pairs inside the prompt (mostly the chat template,
            easy and unlike the answers drafting meets) relative to answer pairs.
        steps: Exact number of steps (``None``: train until the deadline).
        val_share: Share of sequences held out.
        seed: Seeds the split and batch order.
    """

    batch_size: int = 8
    max_len: int = 384
    lr: float = 2e-3
    feature_weight: float = 0.2
    depth2_weight: float = 0.7
    prompt_weight: float = 0.2
    steps: int | None = None
    val_share: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self, {
            "batch_size": self.batch_size >= 1, "max_len": self.max_len >= 8,
            "lr": self.lr > 0, "feature_weight": self.feature_weight >= 0,
            "depth2_weight": self.depth2_weight >= 0,
            "prompt_weight": 0 <= self.prompt_weight <= 1,
            "steps": self.steps is None or self.steps >= 1,
            "val_share": 0 <= self.val_share < 1,
        })

    def fit_config(self) -> FitConfig:
        """The fit loop's part: 20 warm-up steps, linear decay, the loss read every step."""
        return FitConfig(batch_rows=self.batch_size, lr=self.lr, warmup=20, decay="linear",
                         steps=self.steps, log_every=1, feature_weight=self.feature_weight,
                         depth2_weight=self.depth2_weight, prompt_weight=self.prompt_weight)


@dataclass(frozen=True)
class ScaleConfig:
    """Settings of :func:`~.recipe.run_recipe` (defaults fit SmolLM2-135M on one H200).

    Attributes:
        minutes: The whole budget, loading and saving included.
        gen_share: Share of the budget left after loading that generation + features take.
        tail_s: Seconds reserved at the end for evaluation, saving and the report (at
            least; 4 % of the budget when larger).
        gen_batch: Prompts generated per batch.
        max_prompt: Longest prompt kept (its tail, tokens).
        max_new_tokens: Longest continuation.
        temperature: Temperature of the sampled rows.
        sample_share: Share of rows sampled (the rest greedy).
        feature_rows: Rows per teacher-forced feature forward.
        train_rows: Sequences per training step.
        lr: Peak AdamW learning rate (linear warm-up, cosine decay to 5 % at the deadline).
        warmup: Warm-up steps.
        feature_weight: λ of the feature regression.
        depth2_weight: Weight of the second (own-prediction) pass.
        prompt_weight: Loss weight of prompt positions relative to generated ones.
        draft_vocab: Rows of the head's draft vocabulary.
        intermediate: MLP width of the head (``None``: the target's).
        val_share: Share of prompt groups held out.
        eval_rows: At most this many held-out sequences are evaluated.
        check_every: Generation steps between reads of "all rows finished".
        log_every: Training steps between reads of the loss (and progress lines).
        steps: Exact training steps (``None``: until the deadline).
        seed: Seeds the split, prompt order, sampling, init and batch order.
    """

    minutes: float = 3.2
    gen_share: float = 0.4
    tail_s: float = 8.0
    gen_batch: int = 384
    max_prompt: int = 768
    max_new_tokens: int = 256
    temperature: float = 0.7
    sample_share: float = 0.5
    feature_rows: int = 64
    train_rows: int = 48
    lr: float = 2e-3
    warmup: int = 30
    feature_weight: float = 0.2
    depth2_weight: float = 0.7
    prompt_weight: float = 0.3
    draft_vocab: int = 8192
    intermediate: int | None = None
    val_share: float = 0.08
    eval_rows: int = 384
    check_every: int = 16
    log_every: int = 50
    steps: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self, {
            "minutes": self.minutes > 0, "gen_share": 0 < self.gen_share < 1,
            "tail_s": self.tail_s >= 0, "gen_batch": self.gen_batch >= 1,
            "max_prompt": self.max_prompt >= 4, "max_new_tokens": self.max_new_tokens >= 1,
            "temperature": self.temperature > 0, "sample_share": 0 <= self.sample_share <= 1,
            "feature_rows": self.feature_rows >= 1, "train_rows": self.train_rows >= 1,
            "lr": self.lr > 0, "warmup": self.warmup >= 0,
            "feature_weight": self.feature_weight >= 0, "depth2_weight": self.depth2_weight >= 0,
            "prompt_weight": 0 <= self.prompt_weight <= 1, "draft_vocab": self.draft_vocab >= 2,
            "intermediate": self.intermediate is None or self.intermediate >= 1,
            "val_share": 0 < self.val_share < 1, "eval_rows": self.eval_rows >= 1,
            "check_every": self.check_every >= 1, "log_every": self.log_every >= 1,
            "steps": self.steps is None or self.steps >= 1,
        })

    def fit_config(self) -> FitConfig:
        """The fit loop's part: ``warmup`` steps, cosine decay, the loss read every
        ``log_every`` steps."""
        return FitConfig(batch_rows=self.train_rows, lr=self.lr, warmup=self.warmup,
                         decay="cosine", steps=self.steps, log_every=self.log_every,
                         feature_weight=self.feature_weight, depth2_weight=self.depth2_weight,
                         prompt_weight=self.prompt_weight)
