"""Training the EAGLE head (:mod:`agentspec.drafters.model.eagle_head`) on the target's features.

Data: the same teacher sequences as the distilled drafter (the target's own greedy chat
answers and the workload documents, :mod:`agentspec.training.corpus`). One target forward
per sequence gives its final-norm features ``F [T, H]``; nothing else is needed, because
the target's next-token distribution at position ``i`` is ``softmax(F_i W^T)``.

Loss, per sequence, over pairs ``i = 0 .. T-2`` (input ``(F_i, x_{i+1})``, target
``F_{i+1}``)::

    pass 1:  g¹ = head(F_i, x_{i+1})                        (true features in)
    pass 2:  g² = head(g¹_{i-1}, x_{i+1})                   (its own predictions in)
    loss   = Σ_pass  CE(softmax(F_{i+1} W_N^T), g W_N^T) + λ · SmoothL1(g, F_{i+1})

The soft cross-entropy matches the target's distribution over the draft vocabulary ``N``
(what drafting needs); the feature regression keeps ``g`` usable as the next input. Pass 2
is a cheap version of EAGLE-3's "training-time test": at drafting time every token after
the first is predicted from the head's own features, and a head trained on true features
only degrades fast with depth.

Reported on held-out sequences (split by sequence): top-1 agreement of the first draft
token with the target's full-vocabulary argmax (``top1``) and of the second, drafted from
the head's own feature (``top1_depth2``).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from agentspec.drafters.model.eagle_head import EagleHead
from agentspec.errors import ConfigError, TrainingDataError

__all__ = ["FeatureSeq", "TrainEagleConfig", "extract_features", "train_head"]


@dataclass(frozen=True)
class TrainEagleConfig:
    """Settings of :func:`train_head`.

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
        checks = {
            "batch_size": self.batch_size >= 1, "max_len": self.max_len >= 8,
            "lr": self.lr > 0, "feature_weight": self.feature_weight >= 0,
            "depth2_weight": self.depth2_weight >= 0,
            "prompt_weight": 0 <= self.prompt_weight <= 1,
            "steps": self.steps is None or self.steps >= 1,
            "val_share": 0 <= self.val_share < 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"invalid train-eagle setting {name}={getattr(self, name)!r}")


@dataclass(frozen=True)
class FeatureSeq:
    """A sequence and the target's features at every position.

    Attributes:
        tokens: Token ids ``[T]``.
        feats: Final-norm hidden states ``[T, H]`` (fp16 to halve memory).
        start: First answer position: pairs predicting tokens after it are the ones
            drafting meets (earlier ones are the prompt, mostly the chat template).
    """

    tokens: torch.Tensor
    feats: torch.Tensor
    start: int = 0


def extract_features(
    model: Any, sequences: Sequence[torch.Tensor], max_len: int = 384,
    deadline: float | None = None, tick: Callable[[int], None] | None = None,
    starts: Sequence[int] | None = None,
) -> list[FeatureSeq]:
    """One target forward per sequence (its last ``max_len`` tokens); keeps features.

    Args:
        starts: Each sequence's first answer position (default 0: all of it).

    Raises:
        TrainingDataError: no sequence of at least 3 tokens.
    """
    out: list[FeatureSeq] = []
    for n, seq in enumerate(sequences):
        if deadline is not None and time.monotonic() > deadline:
            break
        ids = seq[-max_len:].long()
        start = max(0, (starts[n] if starts is not None else 0) - (seq.numel() - ids.numel()))
        if ids.numel() >= 3:
            with torch.inference_mode():
                hidden = model.model(input_ids=ids[None]).last_hidden_state[0]  # [T, H]
            out.append(FeatureSeq(ids.clone(), hidden.to(torch.float16).clone(), start))
        if tick is not None:
            tick(1)
    if not out:
        raise TrainingDataError("no training sequence of at least 3 tokens to extract from")
    return out


def _batch(seqs: Sequence[FeatureSeq], prompt_weight: float = 1.0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``tokens [B, T]``, ``feats [B, T, H]`` and per-pair weights
    ``[B, T-1]``: 1 on answer pairs, ``prompt_weight`` on prompt pairs, 0 on padding.
    Pair i predicts the token at i + 2, an answer token when ``i + 2 >= start``."""
    width = max(int(s.tokens.shape[0]) for s in seqs)
    hidden = int(seqs[0].feats.shape[1])
    toks = torch.zeros(len(seqs), width, dtype=torch.long)
    feats = torch.zeros(len(seqs), width, hidden)
    weight = torch.zeros(len(seqs), width - 1)
    for b, s in enumerate(seqs):
        n = int(s.tokens.shape[0])
        toks[b, :n], feats[b, :n] = s.tokens, s.feats.float()
        weight[b, : n - 1] = prompt_weight
        weight[b, max(0, s.start - 2) : n - 1] = 1.0
    return toks, feats, weight


def _passes(head: EagleHead, toks: torch.Tensor, feats: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 1 and pass 2 outputs ``[B, T-1, H]`` and the targets ``F_{i+1}``."""
    f_in, x_in, f_next = feats[:, :-1], toks[:, 1:], feats[:, 1:]
    pos = torch.arange(f_in.shape[1])
    g1 = head(f_in, x_in, pos)
    # Pass 2: the input at i is the head's own prediction of F_i (made at i - 1).
    f2 = torch.cat([f_in[:, :1], g1[:, :-1]], dim=1)
    g2 = head(f2, x_in, pos)
    return g1, g2, f_next


def _loss(head: EagleHead, g: torch.Tensor, f_next: torch.Tensor, weight: torch.Tensor,
          cfg: TrainEagleConfig) -> torch.Tensor:
    """Weighted mean over pairs (``weight [B, T-1]``) of soft CE + λ · smooth L1."""
    mask = weight
    with torch.no_grad():
        teacher = torch.softmax(head.logits(f_next), dim=-1)  # [B, T-1, N]
    ce = -(teacher * torch.log_softmax(head.logits(g), dim=-1)).sum(-1)  # [B, T-1]
    reg = F.smooth_l1_loss(g, f_next, reduction="none").mean(-1)  # [B, T-1]
    per = ce + cfg.feature_weight * reg
    return (per * mask).sum() / mask.sum().clamp(min=1e-6)


@torch.no_grad()
def evaluate_head(head: EagleHead, seqs: Sequence[FeatureSeq], full_head: torch.Tensor,
             batch_size: int = 8) -> dict[str, float]:
    """Held-out top-1 agreement with the target's argmax at depth 1 and 2 on answer
    positions (the prompt's chat template would flatter it), and the loss.

    Args:
        full_head: The target's LM head ``[V, H]`` (for its full-vocabulary argmax).
    """
    ids = torch.tensor(head.spec.draft_vocab)
    hits1 = hits2 = total = 0
    loss_sum = 0.0
    for i in range(0, len(seqs), batch_size):
        toks, feats, weight = _batch(seqs[i : i + batch_size], prompt_weight=0.0)
        mask = weight > 0
        g1, g2, f_next = _passes(head, toks, feats)
        want = (f_next @ full_head.T).argmax(-1)  # [B, T-1] the target's greedy token
        hits1 += int(((ids[head.logits(g1).argmax(-1)] == want) & mask).sum())
        hits2 += int(((ids[head.logits(g2).argmax(-1)] == want) & mask).sum())
        n = int(mask.sum())
        total += n
        loss_sum += float(_loss(head, g1, f_next, weight, TrainEagleConfig())) * n
    total = max(total, 1)
    return {"top1": hits1 / total, "top1_depth2": hits2 / total, "loss": loss_sum / total,
            "positions": float(total)}


def train_head(
    head: EagleHead, data: Sequence[FeatureSeq], full_head: torch.Tensor,
    cfg: TrainEagleConfig, deadline: float, progress: bool = True,
) -> dict[str, Any]:
    """Train ``head`` in place until ``deadline`` (``time.monotonic()``) or ``cfg.steps``.

    Returns:
        A report: steps, epochs, train seconds, and held-out metrics before and after.

    Raises:
        TrainingDataError: fewer than 2 sequences (nothing to split).
    """
    from tqdm.auto import tqdm

    if len(data) < 2:
        raise TrainingDataError(f"{len(data)} training sequence(s): need at least 2")
    rng = random.Random(cfg.seed)
    order = list(range(len(data)))
    rng.shuffle(order)
    n_val = max(1, int(len(order) * cfg.val_share)) if cfg.val_share > 0 else 0
    val = [data[i] for i in order[:n_val]]
    train = [data[i] for i in order[n_val:]]
    before = evaluate_head(head, val, full_head) if val else {}
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    start = time.monotonic()
    budget = max(1.0, deadline - start)
    steps = epochs = 0
    bar = tqdm(desc="train EAGLE head", unit="step", disable=not progress,
               total=cfg.steps)
    head.train()
    done = False
    while not done:
        epochs += 1
        # Similar lengths per batch (less padding), batches in random order.
        by_len = sorted(train, key=lambda s: int(s.tokens.shape[0]))
        batches = [by_len[i : i + cfg.batch_size] for i in range(0, len(by_len), cfg.batch_size)]
        rng.shuffle(batches)
        for batch in batches:
            frac = (steps / cfg.steps if cfg.steps else (time.monotonic() - start) / budget)
            warm = min(1.0, (steps + 1) / 20)
            for group in opt.param_groups:
                group["lr"] = cfg.lr * warm * max(0.05, 1.0 - frac)
            toks, feats, weight = _batch(batch, cfg.prompt_weight)
            g1, g2, f_next = _passes(head, toks, feats)
            loss = (_loss(head, g1, f_next, weight, cfg)
                    + cfg.depth2_weight * _loss(head, g2, f_next, weight, cfg))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            steps += 1
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
            if not math.isfinite(float(loss.detach())):
                raise TrainingDataError(f"training diverged (loss {float(loss)}) at step {steps}")
            if (cfg.steps is not None and steps >= cfg.steps) or (
                    cfg.steps is None and time.monotonic() > deadline):
                done = True
                break
    bar.close()
    head.eval()
    after = evaluate_head(head, val, full_head) if val else {}
    return {"steps": steps, "epochs": epochs, "train_s": round(time.monotonic() - start, 1),
            "train_sequences": len(train), "val_sequences": len(val),
            "val_before": before, "val_after": after}
