"""EAGLE head training at scale: the target writes its own training text on the device.

``agentspec train-drafter --kind eagle --device cuda --minutes 3.2 --report r.json`` runs
:func:`run_recipe` inside one hard wall-clock budget, in phases:

1. **Prompts** (:func:`~.prompts.build_prompt_pool`, before the recipe): open-chat prompts,
   the workload documents (edit instructions, relays that re-emit a document, code edits),
   the SWE-agent logs cut at every assistant turn, and tool-agent tasks, under a few system
   prompts. Each prompt belongs to a *group* (its document, log or task); a share of the
   groups is held out and never trained on.
2. **Generation + features** (``gen_share`` of the budget): batches of prompts (left-padded)
   are continued by the target with its own batched KV-cache loop, greedy or sampled per row
   (temperature 0 or ``temperature``); each finished batch is re-read by one teacher-forced
   forward (in row chunks) that keeps the final-norm features of every position on the
   device (fp16) (:mod:`.selfgen`). A CUDA out-of-memory halves the batch and goes on.
3. **Training** (until ``tail`` seconds before the end): the one fit loop
   (:func:`~.fit.fit_head`) with the loss of :mod:`.loss` (soft cross-entropy against the
   target's draft-vocabulary distribution + feature regression, true features in, then the
   head's own predictions in), AdamW, warm-up then cosine decay tied to the clock, bf16
   autocast on CUDA, a checkpoint half-way.
4. **Evaluation and save**: held-out top-1 agreement with the target's full-vocabulary
   argmax at depth 1-3 on generated positions (:func:`~.evaluate.evaluate_head`), the head
   artifact (:mod:`.head`) and a JSON report (:mod:`.report`).

Hot loops never read a device value per token: generation checks "all rows finished" every
``check_every`` steps, training reads its loss every ``log_every`` steps. Any phase that
fails is recorded in the report; what exists by then (the head, the numbers) is still saved.
The same code runs on a CPU with small batches (the unit tests use a random-weight model).
The command line's side (load the target, build the prompts, keep a report whatever fails)
is :mod:`.command`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from agentspec.errors import TrainingDataError
from agentspec.training.eagle.config import ScaleConfig
from agentspec.training.eagle.data import FeatureRows, FeatureStore
from agentspec.training.eagle.evaluate import evaluate_head, format_metrics
from agentspec.training.eagle.fit import fit_head
from agentspec.training.eagle.head import make_head, save_head
from agentspec.training.eagle.prompts import PromptItem, PromptPool, interleave
from agentspec.training.eagle.report import RecipeReport
from agentspec.training.eagle.selfgen import extract_batch_features, generate_batch

__all__ = ["run_recipe"]


@dataclass
class _Run:
    """What every phase of one run reads: the target, the settings, the clock, the report."""

    model: Any
    cfg: ScaleConfig
    dev: torch.device
    rep: RecipeReport
    stop_ids: Sequence[int]
    pad_id: int
    gen_end: float  # time.monotonic() at which generation stops
    train_end: float  # ... and training
    full_head: torch.Tensor  # [V, H] the target's output embedding (float)
    gen_rng: torch.Generator  # the sampled rows' draws
    row_rng: random.Random  # greedy or sampled per row, then the batch order

    def sync(self) -> None:
        """Wait for the device (CUDA only)."""
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)


@dataclass
class _Trained:
    """What training leaves, even when it fails half-way."""

    head: Any = None
    val: FeatureRows | None = None


class _TrainLines:
    """The fit loop's progress as log lines (:class:`~.fit.FitProgress`)."""

    def __init__(self, run: _Run, positions: int) -> None:
        self.run, self.positions = run, positions

    def started(self, rows: int, batches: int) -> None:
        r = self.run
        r.rep.say(f"train: {rows} sequences, {self.positions:,} positions, {batches} "
                  f"batches of {r.cfg.train_rows}, until {r.train_end - r.rep.start:.0f}s")

    def logged(self, step: int, epoch: int, loss: float, rate: float, positions: int) -> None:
        self.run.rep.say(f"train: step {step}, epoch {epoch}, loss {loss:.3f}, "
                         f"lr {rate:.2e}, {positions:,} positions")


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
        pool: The prompts (:func:`~.prompts.build_prompt_pool`).
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
    run = _begin(model, cfg, torch.device(device), RecipeReport(report, report_path, start, log),
                 stop_ids, pad_id)
    report["config"] = asdict(cfg)
    report["device"] = str(run.dev)
    report["prompts"] = pool.counts()
    report["head"] = {"path": str(out), "written": False}
    store = _generate(run, pool)
    got = _train(run, store, out, target_name, init_from)
    if got.head is not None:
        _evaluate_and_save(run, got, out, init_from)
    return run.rep.finish()


def _begin(model: Any, cfg: ScaleConfig, dev: torch.device, rep: RecipeReport,
           stop_ids: Sequence[int], pad_id: int) -> _Run:
    """The run's clock (phase ends), random sources and the target in evaluation mode."""
    end = rep.start + 60.0 * cfg.minutes
    tail = max(cfg.tail_s, 0.04 * 60.0 * cfg.minutes)
    now = time.monotonic()  # loading took what it took: shares of what is left
    model.eval()
    return _Run(model, cfg, dev, rep, stop_ids, pad_id,
                gen_end=now + max(0.0, end - now) * cfg.gen_share, train_end=end - tail,
                full_head=model.get_output_embeddings().weight.detach().float(),
                gen_rng=torch.Generator(device=dev).manual_seed(cfg.seed),
                row_rng=random.Random(cfg.seed))


# -- phase 2: generation + features ------------------------------------------------------


def _generate(run: _Run, pool: PromptPool) -> FeatureStore:
    """Generate and extract features until ``run.gen_end``; the report's ``generation``."""
    cfg, store = run.cfg, FeatureStore()
    stats: dict[str, Any] = {"batches": 0, "sequences": 0, "tokens_generated": 0,
                             "prompt_tokens": 0, "oom_retries": 0,
                             "batch_size": cfg.gen_batch, "features_s": 0.0}
    run.rep.report["generation"] = stats
    run.rep.say(f"generate: {len(pool.train)} training and {len(pool.held_out)} held-out "
                f"prompts; batches of {cfg.gen_batch}, up to {cfg.max_new_tokens} new tokens, "
                f"until {run.gen_end - run.rep.start:.0f}s")
    with run.rep.phase("generate"):
        _generate_until(run, interleave(pool, cfg.val_share), store, stats)
    stats["features_s"] = round(stats["features_s"], 1)
    stats["sequences_by_source"] = dict(store.sources)
    run.rep.save()
    return store


def _generate_until(run: _Run, order: list[tuple[PromptItem, bool]], store: FeatureStore,
                    stats: dict[str, Any]) -> None:
    """Walk ``order`` (round again when done) one batch at a time until the phase ends."""
    batch, cursor, epoch = run.cfg.gen_batch, 0, 0
    while time.monotonic() < run.gen_end and order:
        if cursor >= len(order):  # every prompt used: go round again, temperatures flip
            cursor, epoch = 0, epoch + 1
        chunk = order[cursor : cursor + batch]
        try:
            made = _generate_chunk(run, [p for p, _ in chunk], epoch, stats)
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            batch = max(1, batch // 2)
            stats["oom_retries"] += 1
            stats["batch_size"] = batch
            if run.dev.type == "cuda":
                torch.cuda.empty_cache()
            run.rep.say(f"generate: out of memory, batch now {batch}")
            continue
        cursor += len(chunk)
        _keep(run, store, stats, chunk, made)


def _generate_chunk(run: _Run, items: list[PromptItem], epoch: int, stats: dict[str, Any]
                    ) -> tuple[torch.Tensor, ...]:
    """Continue ``items``, then extract their features: ``(tokens, feats, lengths, plen)``."""
    cfg = run.cfg
    # Later passes over the prompts sample every row (greedy would repeat the first).
    temps = [cfg.temperature if epoch > 0 or run.row_rng.random() < cfg.sample_share
             else 0.0 for _ in items]
    tokens, lengths, plen = generate_batch(
        run.model, [p.ids for p in items], temps, cfg.max_new_tokens, run.stop_ids,
        run.pad_id, run.dev, run.gen_rng, deadline=run.gen_end, check_every=cfg.check_every)
    tf = time.monotonic()
    feats = extract_batch_features(run.model, tokens, cfg.feature_rows)  # [B, W, H] fp16
    run.sync()
    stats["features_s"] += time.monotonic() - tf
    return tokens, feats, lengths, plen


def _keep(run: _Run, store: FeatureStore, stats: dict[str, Any],
          chunk: list[tuple[PromptItem, bool]], made: tuple[torch.Tensor, ...]) -> None:
    """Add a generated batch to ``store`` and count it."""
    tokens, feats, lengths, plen = made
    items = [p for p, _ in chunk]
    store.tokens.append(tokens)
    store.feats.append(feats)
    store.lengths.append(lengths)
    store.starts.append(plen)
    store.held.append(torch.tensor([h for _, h in chunk], device=run.dev))
    store.sources.update(p.source for p in items)
    n_prompt = sum(len(p.ids) for p in items)
    n_new = int(lengths.sum()) - n_prompt
    stats["batches"] += 1
    stats["sequences"] += len(items)
    stats["prompt_tokens"] += n_prompt
    stats["tokens_generated"] += n_new
    run.rep.say(f"generate: batch {stats['batches']} ({len(items)} rows, {n_new:,} new "
                f"tokens); total {stats['tokens_generated']:,} generated, "
                f"{stats['sequences']} sequences")


# -- phase 3: training -------------------------------------------------------------------


def _train(run: _Run, store: FeatureStore, out: Path, target_name: str,
           init_from: Path | None) -> _Trained:
    """Pack, make the head, evaluate it once, then fit it until ``run.train_end``."""
    cfg, rep, got = run.cfg, run.rep, _Trained()
    stats: dict[str, Any] = {"steps": 0, "epochs": 0, "positions_trained": 0}
    rep.report["train"] = stats
    with rep.phase("train"):
        rows, got.val = _pack(run, store)
        got.head = make_head(run.model, rows.tokens, rows.lengths, size=cfg.draft_vocab,
                             vocab=int(run.full_head.shape[0]), stop_ids=run.stop_ids,
                             target_name=target_name, intermediate=cfg.intermediate,
                             seed=cfg.seed, device=run.dev, init_from=init_from)
        rep.report["head"].update(draft_vocab=len(got.head.spec.draft_vocab),
                                  intermediate=got.head.spec.intermediate)
        if got.val is not None and time.monotonic() < run.train_end:
            got.head.eval()
            rep.report["eval_before"] = evaluate_head(got.head, got.val, run.full_head)
            rep.say(f"eval before training: {format_metrics(rep.report['eval_before'])}")
        head = got.head

        def checkpoint(steps: int) -> None:
            rep.report["head"].update(written=True, bytes=save_head(head, out),
                                      checkpoint_step=steps)
            rep.save()

        fit_head(head, rows, cfg.fit_config(), rng=run.row_rng, deadline=run.train_end,
                 stats=stats, checkpoint=checkpoint,
                 progress=_TrainLines(run, rep.report["data"]["train_positions"]))
    rep.save()
    return got


def _pack(run: _Run, store: FeatureStore) -> tuple[FeatureRows, FeatureRows | None]:
    """The training and the held-out rows (at most ``eval_rows``); the report's ``data``.

    Raises:
        TrainingDataError: no training sequence was generated.
    """
    rows, val = store.pack(run.pad_id)  # the packed copies hold the data now
    if val is not None and len(val) > run.cfg.eval_rows:
        val = val.first(run.cfg.eval_rows)
    if rows is None:
        raise TrainingDataError("no training sequence was generated")
    run.rep.report["data"] = {
        "train_sequences": len(rows), "train_positions": rows.positions(run.cfg.prompt_weight),
        "held_out_sequences": len(val) if val is not None else 0,
        "feature_dtype": str(rows.feats.dtype), "width": rows.width}
    return rows, val


# -- phase 4: evaluation and save --------------------------------------------------------


def _evaluate_and_save(run: _Run, got: _Trained, out: Path, init_from: Path | None) -> None:
    """Evaluate the trained head on the held-out rows, then write it (if it was trained)."""
    rep = run.rep
    got.head.eval()
    with rep.phase("eval"):
        if got.val is not None:
            rep.report["eval_after"] = evaluate_head(got.head, got.val, run.full_head)
            rep.say(f"eval after training: {format_metrics(rep.report['eval_after'])}")
        else:
            rep.say("eval: no held-out sequence was generated")
    with rep.phase("save"):
        if rep.report["train"]["steps"] > 0 or init_from is not None:
            size = save_head(got.head, out)
            rep.report["head"].update(written=True, bytes=size, checkpoint_step=None)
            rep.say(f"head written to {out} ({size / 2**20:.1f} MB)")
        else:
            rep.say("head not written: it was never trained")
