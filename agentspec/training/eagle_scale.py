"""EAGLE head training at scale: the target writes its own training text on the device.

``agentspec train-drafter --kind eagle --device cuda --minutes 3.2 --report r.json`` runs
:func:`run_recipe` inside one hard wall-clock budget, in phases:

1. **Prompts** (:func:`build_prompt_pool`): open-chat prompts, the workload documents (edit
   instructions, relays that re-emit a document, code edits), the SWE-agent logs cut at
   every assistant turn, and tool-agent tasks, under a few system prompts. Each prompt
   belongs to a *group* (its document, log or task); a share of the groups is held out and
   never trained on.
2. **Generation + features** (``gen_share`` of the budget): batches of prompts (left-padded)
   are continued by the target with its own batched KV-cache loop, greedy or sampled per row
   (temperature 0 or ``temperature``); each finished batch is re-read by one teacher-forced
   forward (in row chunks) that keeps the final-norm features of every position on the
   device (fp16). A CUDA out-of-memory halves the batch and goes on.
3. **Training** (until ``tail`` seconds before the end): the EAGLE loss of
   :mod:`agentspec.training.eagle` (soft cross-entropy against the target's draft-vocabulary
   distribution + feature regression, true features in, then the head's own predictions in)
   over length-bucketed batches of whole sequences, AdamW, warm-up then cosine decay tied to
   the clock, bf16 autocast on CUDA.
4. **Evaluation and save**: held-out top-1 agreement with the target's full-vocabulary
   argmax at depth 1-3 on generated positions, the head artifact and a JSON report.

Hot loops never read a device value per token: generation checks "all rows finished" every
``check_every`` steps, training reads its loss every ``log_every`` steps. Any phase that
fails is recorded in the report; what exists by then (the head, the numbers) is still saved.
The same code runs on a CPU with small batches (the unit tests use a random-weight model).

The phases live in their own modules: :mod:`~agentspec.training.eagle_prompts` (1),
:mod:`~agentspec.training.eagle_selfgen` (2), :mod:`~agentspec.training.eagle_fit` (3 and the
evaluation); this module holds the settings, the clock and the report that tie them together.
The command line's side (load the target, build the prompts, keep a report whatever fails)
is :mod:`~agentspec.training.eagle_scale_run`.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from agentspec.errors import ConfigError, TrainingDataError
from agentspec.training.eagle_fit import (
    TrainSet,
    evaluate,
    fit_head,
    make_head,
    pair_weights,
    save_head,
)
from agentspec.training.eagle_prompts import PromptItem, PromptPool, build_prompt_pool, interleave
from agentspec.training.eagle_selfgen import FeatureStore, extract_batch_features, generate_batch

__all__ = [
    "PromptItem",
    "PromptPool",
    "ScaleConfig",
    "build_prompt_pool",
    "evaluate",
    "extract_batch_features",
    "generate_batch",
    "run_recipe",
]


@dataclass(frozen=True)
class ScaleConfig:
    """Settings of :func:`run_recipe` (defaults fit SmolLM2-135M on one H200).

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
        checks = {
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
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"invalid train-eagle setting {name}={getattr(self, name)!r}")



def run_recipe(
    model: Any, pool: PromptPool, cfg: ScaleConfig, *, device: str | torch.device,
    out: Path, target_name: str, stop_ids: Sequence[int], pad_id: int, start: float,
    report: dict[str, Any], report_path: Path | None = None,
    log: Callable[[str], None] = print, init_from: Path | None = None,
) -> dict[str, Any]:
    """Generate, extract, train, evaluate and save within ``start + 60 * cfg.minutes``.

    ``report`` is filled in (and written to ``report_path`` after every phase); a phase
    that raises is recorded under ``errors`` and the later phases run on what exists.

    Args:
        model: The target (transformers causal LM), on ``device``.
        pool: The prompts (:func:`build_prompt_pool`).
        cfg: The recipe's settings.
        device: Where generation, features and training run.
        out: The head artifact's path.
        target_name: The target's name, recorded in the head's spec.
        stop_ids: Tokens that end a generated row (kept in the draft vocabulary).
        pad_id: The padding token id.
        start: ``time.monotonic()`` when the run began (loading included).
        report: The report to fill in.
        report_path: Where the report is written after every phase, if anywhere.
        log: Progress lines.
        init_from: A head artifact to continue training instead of a fresh head.

    Returns:
        ``report`` (``status``: ``ok``, ``partial`` or ``failed``).
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    end = start + 60.0 * cfg.minutes
    tail = max(cfg.tail_s, 0.04 * 60.0 * cfg.minutes)
    now = time.monotonic()  # loading took what it took: shares of what is left
    gen_end = now + max(0.0, end - now) * cfg.gen_share
    train_end = end - tail
    phases: dict[str, float] = report.setdefault("phases_s", {})
    errors: list[dict[str, str]] = report.setdefault("errors", [])
    report["config"] = asdict(cfg)
    report["device"] = str(dev)
    report["prompts"] = pool.counts()
    report["head"] = {"path": str(out), "written": False}

    def clock() -> str:
        return f"[{time.monotonic() - start:6.1f}s]"

    def save_report() -> None:
        report["elapsed_s"] = round(time.monotonic() - start, 1)
        if report_path is not None:
            try:
                report_path.parent.mkdir(parents=True, exist_ok=True)
                tmp = report_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(report, indent=2, default=str))
                tmp.replace(report_path)
            except OSError as exc:  # the report must never end the run
                log(f"{clock()} report: cannot write {report_path}: {exc}")

    def failed(phase: str, exc: BaseException) -> None:
        tb = traceback.format_exc(limit=6)
        errors.append({"phase": phase, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": tb[-3000:]})
        log(f"{clock()} {phase}: FAILED: {type(exc).__name__}: {exc}")
        save_report()

    @contextlib.contextmanager
    def timed_phase(name: str) -> Iterator[None]:
        """Time the block as ``phases[name + "_s"]``; an error is recorded and the run goes
        on with what exists."""
        t0 = time.monotonic()
        try:
            yield
        except Exception as exc:
            failed(name, exc)
        finally:
            phases[f"{name}_s"] = round(time.monotonic() - t0, 1)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    model.eval()
    store = FeatureStore()
    full_head = model.get_output_embeddings().weight.detach().float()  # [V, H]
    vocab = int(full_head.shape[0])
    gen_rng = torch.Generator(device=dev).manual_seed(cfg.seed)
    row_rng = random.Random(cfg.seed)

    # -- phase 2: generation + features -----------------------------------------------
    t0 = time.monotonic()
    gen_stats: dict[str, Any] = {"batches": 0, "sequences": 0, "tokens_generated": 0,
                                 "prompt_tokens": 0, "oom_retries": 0,
                                 "batch_size": cfg.gen_batch, "features_s": 0.0}
    report["generation"] = gen_stats
    log(f"{clock()} generate: {len(pool.train)} training and {len(pool.held_out)} held-out "
        f"prompts; batches of {cfg.gen_batch}, up to {cfg.max_new_tokens} new tokens, "
        f"until {gen_end - start:.0f}s")
    try:
        order = interleave(pool, cfg.val_share)
        batch = cfg.gen_batch
        cursor = 0
        epoch = 0
        while time.monotonic() < gen_end and order:
            if cursor >= len(order):  # every prompt used: go round again, temperatures flip
                cursor, epoch = 0, epoch + 1
            chunk = order[cursor : cursor + batch]
            items = [p for p, _ in chunk]
            held = [h for _, h in chunk]
            # Later passes over the prompts sample every row (greedy would repeat the first).
            temps = [cfg.temperature if epoch > 0 or row_rng.random() < cfg.sample_share
                     else 0.0 for _ in items]
            try:
                tokens, lengths, plen = generate_batch(
                    model, [p.ids for p in items], temps, cfg.max_new_tokens, stop_ids, pad_id,
                    dev, gen_rng, deadline=gen_end, check_every=cfg.check_every)
                tf = time.monotonic()
                feats = extract_batch_features(model, tokens, cfg.feature_rows)
                sync()
                gen_stats["features_s"] += time.monotonic() - tf
            except torch.cuda.OutOfMemoryError:
                if batch == 1:
                    raise
                batch = max(1, batch // 2)
                gen_stats["oom_retries"] += 1
                gen_stats["batch_size"] = batch
                if cuda:
                    torch.cuda.empty_cache()
                log(f"{clock()} generate: out of memory, batch now {batch}")
                continue
            cursor += len(chunk)
            store.tokens.append(tokens)
            store.feats.append(feats)
            store.lengths.append(lengths)
            store.starts.append(plen)
            store.held.append(torch.tensor(held, device=dev))
            store.sources.update(p.source for p in items)
            n_prompt = sum(len(p.ids) for p in items)
            n_all = int(lengths.sum())
            gen_stats["batches"] += 1
            gen_stats["sequences"] += len(items)
            gen_stats["prompt_tokens"] += n_prompt
            gen_stats["tokens_generated"] += n_all - n_prompt
            log(f"{clock()} generate: batch {gen_stats['batches']} ({len(items)} rows, "
                f"{n_all - n_prompt:,} new tokens); total {gen_stats['tokens_generated']:,} "
                f"generated, {gen_stats['sequences']} sequences")
    except Exception as exc:
        failed("generate", exc)
    gen_stats["features_s"] = round(gen_stats["features_s"], 1)
    gen_stats["sequences_by_source"] = dict(store.sources)
    phases["generate_s"] = round(time.monotonic() - t0, 1)
    save_report()

    # -- phase 3: training ------------------------------------------------------------
    head: Any = None
    val: tuple[torch.Tensor, ...] | None = None
    train_stats: dict[str, Any] = {"steps": 0, "epochs": 0, "positions_trained": 0}
    report["train"] = train_stats
    t0 = time.monotonic()
    cols = torch.arange(cfg.max_prompt + cfg.max_new_tokens + 2, device=dev)
    try:
        tr = store.packed(False, pad_id)
        val = store.packed(True, pad_id)
        if val is not None and int(val[0].shape[0]) > cfg.eval_rows:
            val = tuple(x[: cfg.eval_rows] for x in val)
        if tr is None:
            raise TrainingDataError("no training sequence was generated")
        toks, feats, lengths, starts = tr
        store = FeatureStore()  # the packed copies hold the data now
        n_rows = int(toks.shape[0])
        width = int(toks.shape[1])
        cols = torch.arange(max(width, int(val[0].shape[1]) if val else 0) + 2, device=dev)
        weights = pair_weights(lengths, starts, width, cfg.prompt_weight, cols)  # [R, W-1]
        pos_total = int((weights > 0).sum())
        report["data"] = {"train_sequences": n_rows, "train_positions": pos_total,
                          "held_out_sequences": int(val[0].shape[0]) if val else 0,
                          "feature_dtype": str(feats.dtype), "width": width}
        head = make_head(model, toks, lengths, size=cfg.draft_vocab, vocab=vocab,
                         stop_ids=stop_ids, target_name=target_name,
                         intermediate=cfg.intermediate, seed=cfg.seed, device=dev,
                         init_from=init_from)
        report["head"].update(draft_vocab=len(head.spec.draft_vocab),
                              intermediate=head.spec.intermediate)
        if val is not None and time.monotonic() < train_end:
            head.eval()
            report["eval_before"] = evaluate(head, val, full_head, 8, cols)
            log(f"{clock()} eval before training: {_fmt(report['eval_before'])}")

        def checkpoint(steps: int) -> None:
            report["head"].update(written=True, bytes=save_head(head, out),
                                  checkpoint_step=steps)
            save_report()

        fit_head(head, TrainSet(toks, feats, lengths, weights, pos_total), cols,
                 train_rows=cfg.train_rows, lr=cfg.lr, warmup=cfg.warmup, steps=cfg.steps,
                 log_every=cfg.log_every, feature_weight=cfg.feature_weight,
                 depth2_weight=cfg.depth2_weight, rng=row_rng, start=start,
                 deadline=train_end, stats=train_stats,
                 say=lambda line: log(f"{clock()} {line}"), checkpoint=checkpoint)
    except Exception as exc:
        failed("train", exc)
    phases["train_s"] = round(time.monotonic() - t0, 1)
    save_report()

    # -- phase 4: evaluation and save -------------------------------------------------
    if head is not None:
        head.eval()
        with timed_phase("eval"):
            if val is not None:
                report["eval_after"] = evaluate(head, val, full_head, 8, cols)
                log(f"{clock()} eval after training: {_fmt(report['eval_after'])}")
            else:
                log(f"{clock()} eval: no held-out sequence was generated")
        with timed_phase("save"):
            if train_stats["steps"] > 0 or init_from is not None:
                size = save_head(head, out)
                report["head"].update(written=True, bytes=size, checkpoint_step=None)
                log(f"{clock()} head written to {out} ({size / 2**20:.1f} MB)")
            else:
                log(f"{clock()} head not written: it was never trained")
    report["status"] = ("ok" if not errors and report["head"]["written"]
                        else "partial" if report["head"]["written"] else "failed")
    phases["total_s"] = round(time.monotonic() - start, 1)
    save_report()
    return report




def _fmt(m: dict[str, float]) -> str:
    parts = [f"{k} {v:.3f}" for k, v in m.items() if k.startswith("top1")]
    return ", ".join(parts) + f" ({int(m.get('positions', 0)):,} generated positions)"
