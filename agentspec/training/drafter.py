"""``agentspec train-drafter``: distil a small drafter from the target on the CPU.

The student (see :mod:`agentspec.drafters.model.distilled`) is the target's first ``L`` layers,
its final norm and an ``N``-row reduced head. Training adjusts LoRA pairs on every linear
map (``W + B A``, ``B`` starts at zero, so step 0 is the plain truncated target), the RMSNorm
gains, and a LoRA pair on the head. The objective is distillation: at every position with a
teacher signal, the cross-entropy of the student's draft-vocabulary distribution ``q`` under
the target's top-K distribution ``p`` (teacher ids outside the draft vocabulary drop out):

    loss = -(1/M) sum_m sum_k p_mk log q_m(id_mk)        (= KL(p || q) + const)

Greedy acceptance of a drafted token is exactly "student argmax == target argmax", so the
validation metric is the top-1 agreement on held-out sequences (split by sequence).

The time budget (``--minutes``) covers both phases: teacher collection (a share of it) and
training (the rest, with a linear learning-rate decay over the remaining time).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from agentspec.drafters.model.distilled import (
    NORMS,
    PROJECTIONS,
    DraftSpec,
    build_draft_model,
    embedding_checksum,
)
from agentspec.errors import ConfigError, TrainingDataError
from agentspec.training.corpus import TeacherSeq

__all__ = ["LoRALinear", "TrainDrafterConfig", "choose_draft_vocab", "train_student"]


@dataclass(frozen=True)
class TrainDrafterConfig:
    """Settings of one distillation run.

    Attributes:
        minutes: Wall-clock budget of the whole run (collection + training).
        collect_share: Share of the budget spent collecting teacher data.
        num_layers: Target layers the drafter copies.
        rank: LoRA rank on the layers' linear maps.
        head_rank: LoRA rank on the reduced head.
        draft_vocab: Rows ``N`` of the reduced head (capped at the target vocabulary).
        top_k: Teacher log-probs kept per position.
        prompts: Open-chat prompts answered by the target (as time allows).
        max_new_tokens: Longest teacher answer.
        batch_size: Sequences per training step.
        max_len: Longest training sequence (tokens).
        lr: Peak learning rate (AdamW).
        steps: Exact number of training steps (``None``: train until the budget ends).
        val_share: Share of sequences held out for validation.
        seed: Seeds prompt order, the split, LoRA init and batch order.
    """

    minutes: float = 15.0
    collect_share: float = 0.45
    num_layers: int = 2
    rank: int = 32
    head_rank: int = 16
    draft_vocab: int = 8192
    top_k: int = 16
    prompts: int = 480
    max_new_tokens: int = 128
    batch_size: int = 8
    max_len: int = 384
    lr: float = 2e-3
    steps: int | None = None
    val_share: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {
            "minutes": self.minutes > 0, "collect_share": 0 < self.collect_share < 1,
            "num_layers": self.num_layers >= 1, "rank": self.rank >= 1,
            "head_rank": self.head_rank >= 1, "draft_vocab": self.draft_vocab >= 2,
            "top_k": self.top_k >= 1, "prompts": self.prompts >= 0,
            "max_new_tokens": self.max_new_tokens >= 1, "batch_size": self.batch_size >= 1,
            "max_len": self.max_len >= 8, "lr": self.lr > 0,
            "steps": self.steps is None or self.steps >= 1,
            "val_share": 0 <= self.val_share < 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"invalid train-drafter setting {name}={getattr(self, name)!r}")


class LoRALinear(torch.nn.Module):
    """A frozen linear map plus a trainable low-rank delta: ``y = x W^T + (x A^T) B^T``.

    Args:
        base: The frozen map ``W: [out, in]``.
        rank: ``r``; ``A: [r, in]`` starts random (scale 1/sqrt(in)), ``B: [out, r]`` at
            zero, so the wrapped map starts equal to ``base``.
        gen: Seeded generator for ``A``.
    """

    def __init__(self, base: torch.nn.Linear, rank: int, gen: torch.Generator) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        out_f, in_f = base.weight.shape
        self.A = torch.nn.Parameter(torch.randn(rank, in_f, generator=gen) / math.sqrt(in_f))
        self.B = torch.nn.Parameter(torch.zeros(out_f, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[.., in] -> [.., out]``."""
        return self.base(x) + (x @ self.A.T) @ self.B.T


def choose_draft_vocab(seqs: Sequence[TeacherSeq], size: int, vocab: int,
                       always: Sequence[int] = ()) -> tuple[int, ...]:
    """The ``size`` ids the target predicts most often (teacher top-1), most frequent first.

    Ties (and ids never seen) are broken by id, so the choice is deterministic; ``always``
    (e.g. EOS) is included whatever its count.
    """
    counts: Counter[int] = Counter()
    for s in seqs:
        counts.update(s.top_ids[:, 0].tolist())
    size = min(size, vocab)
    head = [t for t in always if 0 <= t < vocab]
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    chosen = list(dict.fromkeys(head + ranked))[:size]
    if len(chosen) < size:  # fill with unseen ids in id order
        seen = set(chosen)
        chosen += [t for t in range(vocab) if t not in seen][: size - len(chosen)]
    return tuple(chosen)


def _student(target_model: Any, spec: DraftSpec, cfg: TrainDrafterConfig) -> Any:
    """The drafter with LoRA wrappers in place and only the trained parts requiring grad."""
    draft = build_draft_model(target_model, spec)
    embed = draft.model.embed_tokens.weight
    # A frozen view of the target's embedding (same storage, never a gradient).
    draft.model.embed_tokens = torch.nn.Embedding.from_pretrained(embed.detach(), freeze=True)
    draft.requires_grad_(False)
    gen = torch.Generator().manual_seed(cfg.seed)
    for layer in draft.model.layers:
        for proj in PROJECTIONS:
            parent, _, attr = proj.rpartition(".")
            owner = layer.get_submodule(parent)
            setattr(owner, attr, LoRALinear(getattr(owner, attr), cfg.rank, gen))
        for name in NORMS:
            getattr(layer, name).weight.requires_grad_(True)
    draft.model.norm.weight.requires_grad_(True)
    draft.lm_head = LoRALinear(draft.lm_head, cfg.head_rank, gen)
    return draft.float().train()


def trained_tensors(student: Any) -> dict[str, torch.Tensor]:
    """The artifact's tensors (fp16): LoRA pairs, norm gains, head pair."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(student.model.layers):
        for proj in PROJECTIONS:
            mod = layer.get_submodule(proj)
            out[f"layers.{i}.{proj}.A"], out[f"layers.{i}.{proj}.B"] = mod.A, mod.B
        for name in NORMS:
            out[f"layers.{i}.{name}"] = getattr(layer, name).weight
    out["norm"] = student.model.norm.weight
    out["head.A"], out["head.B"] = student.lm_head.A, student.lm_head.B
    return {k: v.detach().to(torch.float16).contiguous() for k, v in out.items()}


def _batches(seqs: Sequence[TeacherSeq], size: int, rng: random.Random) -> list[list[int]]:
    """Index batches of similar-length sequences, in a seeded random order."""
    order = sorted(range(len(seqs)), key=lambda i: int(seqs[i].tokens.shape[0]))
    batches = [order[i : i + size] for i in range(0, len(order), size)]
    rng.shuffle(batches)
    return batches


def _batch_loss(student: Any, seqs: Sequence[TeacherSeq], remap: torch.Tensor,
                ids: torch.Tensor, max_len: int) -> tuple[torch.Tensor, int, int]:
    """Distillation loss of one batch, plus (top-1 agreements, positions).

    Right padding needs no attention mask: a causal model's real positions never attend to
    the pads after them, and pad positions carry no loss.
    """
    width = min(max_len, max(int(s.tokens.shape[0]) for s in seqs))
    inp = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, T]
    rows: list[int] = []
    cols: list[int] = []
    t_ids: list[torch.Tensor] = []
    t_logp: list[torch.Tensor] = []
    for b, s in enumerate(seqs):
        n = min(width, int(s.tokens.shape[0]))
        inp[b, :n] = s.tokens[:n]
        span = max(0, min(int(s.top_ids.shape[0]), n - s.start))
        rows += [b] * span
        cols += range(s.start, s.start + span)
        t_ids.append(s.top_ids[:span].long())
        t_logp.append(s.top_logp[:span].float())
    hidden = student.model(input_ids=inp).last_hidden_state  # [B, T, H]
    h = hidden[torch.tensor(rows), torch.tensor(cols)]  # [M, H]
    logq = torch.log_softmax(student.lm_head(h), dim=-1)  # [M, N]
    tid = torch.cat(t_ids)  # [M, K] full-vocabulary teacher ids
    p = torch.cat(t_logp).exp()  # [M, K] teacher probabilities (top-K, unnormalised)
    idx = remap[tid]  # [M, K] draft-vocabulary index, -1 if absent
    p = torch.where(idx >= 0, p, torch.zeros_like(p))  # absent ids carry no target
    lq = logq.gather(1, idx.clamp(min=0))  # [M, K]
    loss = -(p * lq).sum(dim=1).mean()
    agree = int((ids[logq.argmax(dim=1)] == tid[:, 0]).sum())
    return loss, agree, len(rows)


def evaluate_student(student: Any, seqs: Sequence[TeacherSeq], remap: torch.Tensor,
             ids: torch.Tensor, cfg: TrainDrafterConfig) -> dict[str, float]:
    """Validation loss and top-1 agreement with the target (the greedy acceptance rate)."""
    if not seqs:
        return {"loss": float("nan"), "top1": float("nan"), "positions": 0}
    student.eval()
    total, agree, count = 0.0, 0, 0
    with torch.no_grad():
        for batch in _batches(seqs, cfg.batch_size, random.Random(0)):
            loss, a, n = _batch_loss(student, [seqs[i] for i in batch], remap, ids, cfg.max_len)
            total, agree, count = total + float(loss) * n, agree + a, count + n
    student.train()
    return {"loss": total / count, "top1": agree / count, "positions": count}


def train_student(
    target_model: Any, seqs: Sequence[TeacherSeq], cfg: TrainDrafterConfig, *,
    target_name: str, deadline: float | None = None, always: Sequence[int] = (),
    progress: bool = True,
) -> tuple[DraftSpec, dict[str, torch.Tensor], dict[str, Any]]:
    """Distil a drafter from teacher sequences.

    Args:
        target_model: The target (its layers, norm and embedding seed the student).
        seqs: Teacher data (see :mod:`agentspec.training.corpus`).
        cfg: Shape and optimisation settings.
        target_name: Recorded in the artifact.
        deadline: ``time.monotonic()`` at which training stops (unless ``cfg.steps``).
        always: Ids always in the draft vocabulary (EOS).
        progress: Show a progress bar.

    Returns:
        ``(spec, tensors, report)`` ready for :func:`save_artifact`.

    Raises:
        TrainingDataError: no sequence, or a teacher id outside the target vocabulary.
    """
    from tqdm.auto import tqdm

    if not seqs:
        raise TrainingDataError("no teacher sequences to train on (empty traces and data)")
    vocab = int(target_model.get_input_embeddings().weight.shape[0])
    for s in seqs:
        worst = max(int(s.tokens.max()), int(s.top_ids.max()))
        if worst >= vocab or int(s.tokens.min()) < 0:
            raise TrainingDataError(
                f"token id {worst} is outside the target's {vocab}-token vocabulary: the "
                "traces were made with another tokenizer"
            )
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    n_val = int(len(seqs) * cfg.val_share) if len(seqs) >= 10 else 0
    val = [seqs[i] for i in order[:n_val]]
    train = [seqs[i] for i in order[n_val:]]
    spec = DraftSpec(cfg.num_layers, choose_draft_vocab(train, cfg.draft_vocab, vocab, always),
                     cfg.rank, target_name, vocab, embedding_checksum(target_model))
    ids = torch.tensor(spec.draft_vocab)  # [N] full id of each draft index
    remap = torch.full((vocab,), -1, dtype=torch.long)  # [V] draft index of each full id
    remap[ids] = torch.arange(len(ids))
    student = _student(target_model, spec, cfg)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    probe = train[:64]  # a fixed slice of the training set: is the loop learning at all?
    before, fit_before = (evaluate_student(student, part, remap, ids, cfg) for part in (val, probe))
    t0 = time.monotonic()
    budget = (deadline - t0) if deadline is not None else None
    bar = tqdm(total=cfg.steps, desc="train drafter", unit="step", disable=not progress)
    step, epoch, seen = 0, 0, 0
    while True:
        for batch in _batches(train, cfg.batch_size, rng):
            if cfg.steps is not None:
                if step >= cfg.steps:
                    break
                frac = step / cfg.steps
            else:
                if budget is None or time.monotonic() >= t0 + budget:
                    break
                frac = (time.monotonic() - t0) / budget
            # 10 warm-up steps, then linear decay to 10 % of the peak at the end.
            scale = min(1.0, (step + 1) / 10) * max(0.1, 1.0 - frac)
            for group in opt.param_groups:
                group["lr"] = cfg.lr * scale
            loss, agree, n = _batch_loss(student, [train[i] for i in batch], remap, ids,
                                         cfg.max_len)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step, seen = step + 1, seen + n
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{agree / max(n, 1):.2f}",
                            epoch=epoch)
        else:
            epoch += 1
            continue
        break
    bar.close()
    after, fit_after = (evaluate_student(student, part, remap, ids, cfg) for part in (val, probe))
    positions = sum(int(s.top_ids.shape[0]) for s in train)
    report = {
        "config": asdict(cfg), "sequences": {"train": len(train), "val": len(val)},
        "train_positions": positions, "steps": step,
        "epochs": round(seen / max(1, positions), 2),
        "train_s": round(time.monotonic() - t0, 1),
        "val_before": before, "val_after": after,
        "train_before": fit_before, "train_after": fit_after,
    }
    return spec, trained_tensors(student), report


def save_artifact(path: Path, spec: DraftSpec, tensors: dict[str, torch.Tensor],
                  report: dict[str, Any] | None = None) -> Path:
    """Write the artifact atomically (``path``) and its training report (``path.json``)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    blob = dict(tensors)
    blob["draft_vocab"] = torch.tensor(spec.draft_vocab, dtype=torch.int32)
    tmp = path.with_name(path.name + ".tmp")
    save_file(blob, str(tmp), metadata=spec.metadata())
    tmp.replace(path)
    if report is not None:
        path.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    return path
