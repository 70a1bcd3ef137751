"""Phase 3 of the EAGLE self-distillation recipe: train the head on the device, evaluate it.

The loss is the one of :mod:`agentspec.training.eagle` in its soft form: cross-entropy
against the target's draft-vocabulary distribution plus a feature regression, true features
in (depth 1), then the head's own predictions in (depth 2). :func:`fit_head` runs it over
length-bucketed batches of whole sequences with AdamW, a warm-up and a cosine decay tied to
the clock (or to an exact step count), bf16 autocast on CUDA; it reads its loss only every
``log_every`` steps, so the GPU never waits on the host. :func:`evaluate` measures held-out
top-1 agreement with the target's full-vocabulary argmax at depth 1-3.

Everything stays on the device the features are on; :func:`save_head` writes the artifact
(:func:`~agentspec.drafters.model.eagle.save_eagle` copies the tensors to the CPU). The
budget and the report belong to :func:`agentspec.training.eagle_scale.run_recipe`.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agentspec.errors import TrainingDataError

__all__ = ["TrainSet", "draft_vocab", "evaluate", "fit_head", "make_head", "pair_weights",
           "save_head"]


def _passes3(head: Any, toks: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor,
             depth: int) -> list[torch.Tensor]:
    """Outputs ``[B, T-1, H]`` of passes 1..depth: pass k reads pass k-1's prediction of
    the feature (pass 1 the true one); ``pos`` are the pair positions on the device."""
    f_in, x_in = feats[:, :-1], toks[:, 1:]
    outs = [head(f_in, x_in, pos)]
    for _ in range(depth - 1):
        f_k = torch.cat([f_in[:, :1], outs[-1][:, :-1]], dim=1)
        outs.append(head(f_k, x_in, pos))
    return outs


def pair_weights(lengths: torch.Tensor, starts: torch.Tensor, width: int,
                 prompt_weight: float, cols: torch.Tensor) -> torch.Tensor:
    """Loss weights ``[B, W-1]`` of the (feature, next token) pairs of right-padded rows.

    Pair i (predicting token i + 2) weighs 1 when that token was generated,
    ``prompt_weight`` inside the prompt, 0 on padding.

    Args:
        lengths: The rows' lengths ``[B]``.
        starts: The rows' prompt lengths ``[B]``.
        width: The rows' padded width ``W``.
        prompt_weight: Weight of prompt positions.
        cols: ``arange`` of at least ``W - 1`` on the rows' device.
    """
    c = cols[: width - 1][None, :]
    real = c < (lengths[:, None] - 1)
    gen = (c + 2) >= starts[:, None]
    return real.float() * torch.where(gen, 1.0, prompt_weight)


def _soft_loss(head: Any, g: torch.Tensor, f_next: torch.Tensor, weight: torch.Tensor,
               feature_weight: float, teacher: torch.Tensor) -> torch.Tensor:
    ce = -(teacher * torch.log_softmax(head.logits(g).float(), dim=-1)).sum(-1)  # [B, T-1]
    reg = F.smooth_l1_loss(g.float(), f_next, reduction="none").mean(-1)
    per = ce + feature_weight * reg
    return (per * weight).sum() / weight.sum().clamp(min=1e-6)


@torch.no_grad()
def evaluate(head: Any, data: tuple[torch.Tensor, ...], full_head: torch.Tensor,
             rows: int, cols: torch.Tensor, depth: int = 3) -> dict[str, float]:
    """Held-out top-1 agreement of ``head`` with the target's full-vocabulary argmax.

    Args:
        head: The EAGLE head, on the data's device.
        data: ``(tokens, feats, lengths, starts)`` (:meth:`FeatureStore.packed`).
        full_head: The target's output embedding ``[V, H]`` (float).
        rows: Sequences per forward.
        cols: ``arange`` of at least the data's width on its device.
        depth: Drafting depths measured.

    Returns:
        ``top1``, ``top1_depth2``, ``top1_depth3`` (depth 1..3 on generated positions),
        ``top1_all`` (depth 1 on every position) and the position counts.
    """
    toks, feats, lengths, starts = data
    ids = torch.tensor(head.spec.draft_vocab, device=toks.device)
    dev = toks.device
    hits = torch.zeros(depth, device=dev)
    hits_all = torch.zeros((), device=dev)
    n_gen = torch.zeros((), device=dev)
    n_all = torch.zeros((), device=dev)
    for i in range(0, int(toks.shape[0]), rows):
        ln, st = lengths[i : i + rows], starts[i : i + rows]
        w = int(ln.max())
        t, f = toks[i : i + rows, :w], feats[i : i + rows, :w].float()
        weight = pair_weights(ln, st, w, 0.0, cols)
        real = pair_weights(ln, st, w, 1.0, cols) > 0
        gen = weight > 0
        outs = _passes3(head, t, f, cols[: w - 1], depth)
        want = (f[:, 1:] @ full_head.T).argmax(-1)  # [B, T-1] the target's greedy token
        for k, g in enumerate(outs):
            ok = ids[head.logits(g).argmax(-1)] == want
            hits[k] += (ok & gen).sum()
            if k == 0:
                hits_all += (ok & real).sum()
        n_gen += gen.sum()
        n_all += real.sum()
    h = hits.tolist()
    ng, na = max(float(n_gen), 1.0), max(float(n_all), 1.0)
    res = {"top1": h[0] / ng, "top1_all": float(hits_all) / na, "positions": float(n_gen),
           "positions_all": float(n_all)}
    for k in range(1, depth):
        res[f"top1_depth{k + 1}"] = h[k] / ng
    return res


def save_head(head: Any, out: Path) -> int:
    """Write ``head`` to ``out`` (:func:`~agentspec.drafters.model.eagle.save_eagle`).

    Returns:
        The artifact's size in bytes.
    """
    from agentspec.drafters.model.eagle import save_eagle

    save_eagle(out, head)
    return out.stat().st_size


def draft_vocab(tokens: torch.Tensor, lengths: torch.Tensor, size: int, vocab: int,
                always: Sequence[int]) -> tuple[int, ...]:
    """The ``size`` most frequent ids of the training rows (``always`` first), ties and
    never-seen ids by id.

    Args:
        tokens: Right-padded training rows ``[R, W]``.
        lengths: Their lengths ``[R]``.
        size: Rows of the draft vocabulary.
        vocab: The target's vocabulary size.
        always: Ids kept whatever their counts (the stop tokens).
    """
    cols = torch.arange(int(tokens.shape[1]), device=tokens.device)[None, :]
    real = tokens[cols < lengths[:, None]]
    counts = torch.bincount(real, minlength=vocab)[:vocab].tolist()
    size = min(size, vocab)
    order = sorted(range(vocab), key=lambda t: (-counts[t], t))
    head = [t for t in always if 0 <= t < vocab]
    return tuple(list(dict.fromkeys(head + order))[:size])


def make_head(model: Any, tokens: torch.Tensor, lengths: torch.Tensor, *, size: int,
              vocab: int, stop_ids: Sequence[int], target_name: str,
              intermediate: int | None, seed: int, device: torch.device,
              init_from: Path | None = None) -> Any:
    """The head to train, on ``device``: read from ``init_from``, else a fresh one.

    A fresh head drafts over the :func:`draft_vocab` of the training rows and starts as
    the identity (``init_identity(seed)``).

    Args:
        model: The target (transformers causal LM).
        tokens: Right-padded training rows ``[R, W]``.
        lengths: Their lengths ``[R]``.
        size: Rows of a fresh head's draft vocabulary.
        vocab: The target's vocabulary size.
        stop_ids: Ids every draft vocabulary keeps.
        target_name: The target's name, recorded in the head's spec.
        intermediate: MLP width of a fresh head (``None``: the target's).
        seed: Seeds a fresh head's initialisation.
        device: Where the head trains.
        init_from: A head artifact to continue training.
    """
    from agentspec.drafters.model.distilled import embedding_checksum
    from agentspec.drafters.model.eagle import build_head, read_head
    from agentspec.drafters.model.eagle_head import HeadSpec

    if init_from is not None:
        return read_head(model, init_from).to(device)
    dv = draft_vocab(tokens, lengths, size, vocab, stop_ids)
    spec = HeadSpec.for_target(model, dv, target_name, embedding_checksum(model),
                               intermediate=intermediate)
    head = build_head(model, spec)
    head.init_identity(seed)
    return head.to(device)


@dataclass(frozen=True)
class TrainSet:
    """The packed training rows, on the device.

    Attributes:
        tokens: Right-padded rows ``[R, W]``.
        feats: The target's features ``[R, W, H]`` (fp16).
        lengths: The rows' lengths ``[R]``.
        weights: Pair loss weights ``[R, W-1]`` (:func:`pair_weights`).
        positions: Pairs of non-zero weight.
    """

    tokens: torch.Tensor
    feats: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor
    positions: int


def fit_head(
    head: Any, data: TrainSet, cols: torch.Tensor, *, train_rows: int, lr: float,
    warmup: int, steps: int | None, log_every: int, feature_weight: float,
    depth2_weight: float, rng: random.Random, start: float, deadline: float,
    stats: dict[str, Any], say: Callable[[str], None],
    checkpoint: Callable[[int], None] | None = None,
) -> None:
    """Train ``head`` on ``data`` until ``deadline`` (or for exactly ``steps`` steps).

    Args:
        head: The head (:func:`make_head`), on the data's device.
        data: The training rows.
        cols: ``arange`` of at least the rows' width on their device.
        train_rows: Sequences per step (length-bucketed).
        lr: Peak AdamW learning rate (linear warm-up, cosine decay to 5 % at the end).
        warmup: Warm-up steps.
        steps: Exact steps (``None``: until ``deadline``).
        log_every: Steps between reads of the loss (and ``say`` lines).
        feature_weight: λ of the feature regression.
        depth2_weight: Weight of the second (own-prediction) pass.
        rng: Shuffles the batch order.
        start: The recipe's start (``time.monotonic()``), for the log.
        deadline: ``time.monotonic()`` at which a clock-driven run stops.
        stats: Filled in as training goes (``steps``, ``epochs``, ``loss``,
            ``positions_trained``).
        say: Progress lines.
        checkpoint: Called once with the step count half way through a clock-driven run.

    Raises:
        TrainingDataError: no row of at least 3 tokens, or the loss diverged.
    """
    dev = data.tokens.device
    cuda = dev.type == "cuda"
    toks, feats, weights = data.tokens, data.feats, data.weights
    n_rows = int(toks.shape[0])
    # Length buckets: rows sorted by length, batches of similar rows, widths known here.
    lens = data.lengths.tolist()
    by_len = sorted(range(n_rows), key=lambda r: lens[r])
    batches = []
    for i in range(0, n_rows, train_rows):
        rows = by_len[i : i + train_rows]
        batches.append((torch.tensor(rows, device=dev), max(lens[r] for r in rows)))
    batches = [b for b in batches if b[1] >= 3]
    if not batches:
        raise TrainingDataError("no training sequence of at least 3 tokens")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=cuda or None)
    say(f"train: {n_rows} sequences, {data.positions:,} positions, {len(batches)} "
        f"batches of {train_rows}, until {deadline - start:.0f}s")
    head.train()
    tstart = time.monotonic()
    budget = max(1.0, deadline - tstart)
    loss_acc = torch.zeros((), device=dev)
    pos_acc = torch.zeros((), device=dev)
    last_log = done_steps = 0
    done = time.monotonic() >= deadline and steps is None
    pending = steps is None and checkpoint is not None  # one mid-run checkpoint
    while not done:
        stats["epochs"] += 1
        rng.shuffle(batches)
        for idx, w in batches:
            frac = (done_steps / steps if steps
                    else (time.monotonic() - tstart) / budget)
            warm = min(1.0, (done_steps + 1) / max(1, warmup))
            rate = lr * warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
            for group in opt.param_groups:
                group["lr"] = rate
            t = toks[idx, :w]
            f = feats[idx, :w].float()
            wt = weights[idx, : w - 1]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                outs = _passes3(head, t, f, cols[: w - 1], 2)
                f_next = f[:, 1:]
                with torch.no_grad():
                    teacher = torch.softmax(head.logits(f_next).float(), dim=-1)
                loss = _soft_loss(head, outs[0], f_next, wt, feature_weight, teacher)
                loss = loss + depth2_weight * _soft_loss(
                    head, outs[1], f_next, wt, feature_weight, teacher)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            done_steps += 1
            loss_acc += loss.detach()
            pos_acc += (wt > 0).sum()
            if done_steps % log_every == 0:
                mean = float(loss_acc) / (done_steps - last_log)  # one read per log_every
                if not math.isfinite(mean):
                    raise TrainingDataError(
                        f"training diverged (loss {mean}) at step {done_steps}")
                stats["loss"] = round(mean, 4)
                say(f"train: step {done_steps}, epoch {stats['epochs']}, loss "
                    f"{mean:.3f}, lr {rate:.2e}, {int(pos_acc):,} positions")
                loss_acc.zero_()
                last_log = done_steps
            stats["steps"] = done_steps
            if pending and checkpoint is not None and frac >= 0.5:
                pending = False
                checkpoint(done_steps)
            if (steps is not None and done_steps >= steps) or (
                    steps is None and time.monotonic() > deadline):
                done = True
                break
    if cuda:
        torch.cuda.synchronize(dev)
    stats["positions_trained"] = int(pos_acc)
    if done_steps > last_log:
        stats["loss"] = round(float(loss_acc) / (done_steps - last_log), 4)
