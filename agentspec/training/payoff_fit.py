"""Training the payoff predictor from greedy traces (``agentspec train-predictor``).

Pipeline: validate traces -> split sessions (train / validation, per workload) -> replay
both sides -> fit the MLP on MSE (epoch early-stopped on an inner split of the training
sessions) -> pick τ on validation ->
report held-out quality (MAE, RMSE, precision/recall of "accepted ≥ 6") next to two
baselines: the suffix tree's own score used as the prediction, and the training mean.

Only positions where the cache drafter has a draft are trained on: with an empty draft
there is nothing to verify and the choice is the model drafter regardless of ŷ.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentspec.errors import ConfigError
from agentspec.payoff.features import FEATURE_NAMES, TokenTable
from agentspec.payoff.predictor import PayoffPredictor
from agentspec.training.payoff_replay import (
    HIGH_PAYOFF,
    Sample,
    pick_tau,
    prediction_quality,
    replay,
    split_sessions,
)
from agentspec.training.payoff_traces import Trace, TraceError, TraceSet


@dataclass(frozen=True)
class TrainConfig:
    """Settings of :func:`train_predictor`.

    Attributes:
        val_fraction: Share of each workload's sessions held out for validation.
        max_draft: Cache draft length asked during replay (the engine's ``max_draft``).
        hidden: Hidden units per MLP layer.
        epochs: Full-batch Adam epochs.
        seed: Seed of the split and the MLP's initialisation.
        folds: Session folds of the cross-validation in the report (skipped with fewer
            sessions than folds).
        residual: Learn a correction to the suffix tree's score (see
            :mod:`agentspec.payoff.predictor`) instead of ŷ from scratch.
    """

    val_fraction: float = 0.3
    max_draft: int = 32
    hidden: int = 16
    epochs: int = 400
    seed: int = 0
    folds: int = 4
    residual: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        for name in ("max_draft", "hidden", "epochs", "folds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")


def _rows(samples: Sequence[Sample]) -> tuple[list[list[float]], list[int]]:
    kept = [s for s in samples if s.draft_len > 0]
    return [s.phi for s in kept], [s.accepted for s in kept]


def train_predictor(
    traces: TraceSet, table: TokenTable, config: TrainConfig | None = None,
    progress: bool = True,
) -> tuple[PayoffPredictor, dict[str, Any]]:
    """Fit a predictor on ``traces``; return it and a JSON-ready training report.

    Raises:
        TraceError: fewer than two sessions (no session-level split is possible) or no
            cache drafts on one side of the split.
    """
    cfg = config or TrainConfig()
    t0 = time.perf_counter()
    if len(traces.traces) < 2:
        raise TraceError(
            f"need at least 2 sessions to split train/validation by session, got "
            f"{len(traces.traces)}"
        )
    train_ids, val_ids = split_sessions(traces.traces, cfg.val_fraction, cfg.seed)
    if not val_ids:  # every workload has a single session: hold out one whole session
        first = sorted(train_ids)[0]
        train_ids.discard(first)
        val_ids = {first}
    samples = replay(traces.traces, table, cfg.max_draft, progress=progress)
    x_tr, y_tr = _rows([s for s in samples if s.session_id in train_ids])
    x_va, y_va = _rows([s for s in samples if s.session_id in val_ids])
    if not x_tr or not x_va:
        raise TraceError(
            f"replay produced {len(x_tr)} training and {len(x_va)} validation cache drafts; "
            "both must be non-empty (add sessions or turns)"
        )
    pred = fit_early_stopped(samples, traces.traces, train_ids, cfg)
    p_va = pred.predict_many(x_va)
    pred.tau = pick_tau(p_va, y_va)
    quality = prediction_quality(p_va, y_va, pred.tau)
    # Baselines on the same validation rows: the suffix tree's own expected acceptance
    # (its score) as the prediction, and a constant (the training mean).
    score_col = FEATURE_NAMES.index("log_score")
    score_pred = [math.expm1(r[score_col]) for r in x_va]
    mean_y = sum(y_tr) / len(y_tr)
    report: dict[str, Any] = {
        "sessions": {"train": len(train_ids), "validation": len(val_ids)},
        "validation_sessions": sorted(val_ids),
        "positions": len(samples),
        "rows": {"train": len(x_tr), "validation": len(x_va)},
        "validation": quality.to_dict(),
        "per_workload": {},
        "baseline_suffix_score": prediction_quality(
            score_pred, y_va, pick_tau(score_pred, y_va)).to_dict(),
        "baseline_mean": prediction_quality([mean_y] * len(y_va), y_va, mean_y).to_dict(),
        "config": cfg.__dict__,
        "seconds": 0.0,
    }
    if len(traces.traces) >= cfg.folds:
        report["cross_validation"] = cross_validate(samples, traces.traces, cfg)
    for wl in sorted({s.workload for s in samples}):
        xs, ys = _rows([s for s in samples if s.session_id in val_ids and s.workload == wl])
        if xs:
            report["per_workload"][wl] = prediction_quality(
                pred.predict_many(xs), ys, pred.tau).to_dict()
    report["seconds"] = round(time.perf_counter() - t0, 2)
    pred.meta = {
        "model": traces.model,
        "vocab_size": traces.vocab_size,
        "tokenizer": traces.tokenizer,
        "trace_tokens": traces.num_output_tokens,
        "validation": quality.to_dict(),
        "sessions": report["sessions"],
        "seed": cfg.seed,
        "max_draft": cfg.max_draft,
    }
    return pred, report


def fit_early_stopped(
    samples: Sequence[Sample], traces: Sequence[Trace], train_ids: set[str], cfg: TrainConfig
) -> PayoffPredictor:
    """Fit on the ``train_ids`` sessions, early-stopped on an inner split of those sessions.

    The MLP overfits a few dozen sessions within tens of epochs (position and prompt
    length identify a session), so the epoch is chosen on sessions it does not train on;
    those are carved out of ``train_ids`` (by session, per workload), never taken from
    the held-out sessions, whose numbers therefore stay honest. With too few sessions for
    an inner split it trains all ``cfg.epochs`` epochs.
    """
    inner_tr, inner_va = split_sessions([t for t in traces if t.session_id in train_ids],
                                        cfg.val_fraction, cfg.seed + 1)
    if not inner_va or not inner_tr:
        inner_tr, inner_va = set(train_ids), set()
    x_tr, y_tr = _rows([s for s in samples if s.session_id in inner_tr])
    x_va, y_va = _rows([s for s in samples if s.session_id in inner_va])
    if not x_tr or not x_va:  # an inner side without cache drafts: no early stopping
        x_tr, y_tr = _rows([s for s in samples if s.session_id in train_ids])
        x_va, y_va = [], []
    return PayoffPredictor.fit(x_tr, [float(y) for y in y_tr], x_va, [float(y) for y in y_va],
                               hidden=cfg.hidden, epochs=cfg.epochs, seed=cfg.seed,
                               residual=cfg.residual)


def cross_validate(
    samples: Sequence[Sample], traces: Sequence[Trace], cfg: TrainConfig
) -> dict[str, Any]:
    """Grouped k-fold cross-validation by session: every session is predicted once by a
    model that never saw it, so the pooled numbers use all the data yet stay held-out.

    Each fold's model is early-stopped on an inner split of its own training sessions
    (:func:`fit_early_stopped`) and picks its τ on its own training rows.
    """
    import random

    by_wl: dict[str, list[str]] = {}
    for s in samples:
        by_wl.setdefault(s.workload, [])
        if s.session_id not in by_wl[s.workload]:
            by_wl[s.workload].append(s.session_id)
    rng = random.Random(cfg.seed)
    fold_of: dict[str, int] = {}
    i = 0
    for wl in sorted(by_wl):  # deal each workload's sessions round-robin over the folds
        ids = sorted(by_wl[wl])
        rng.shuffle(ids)
        for sid in ids:
            fold_of[sid] = i % cfg.folds
            i += 1
    preds: list[float] = []
    trues: list[int] = []
    called: list[bool] = []
    for f in range(cfg.folds):
        x_tr, y_tr = _rows([s for s in samples if fold_of[s.session_id] != f])
        x_te, y_te = _rows([s for s in samples if fold_of[s.session_id] == f])
        if not x_tr or not x_te:
            continue
        pred = fit_early_stopped(samples, traces,
                                 {sid for sid, fold in fold_of.items() if fold != f}, cfg)
        tau = pick_tau(pred.predict_many(x_tr), y_tr)
        p_te = pred.predict_many(x_te)
        preds += p_te
        trues += y_te
        called += [p >= tau for p in p_te]
    n = len(trues)
    if n == 0:
        return {"folds": cfg.folds, "rows": 0}
    pos = [t >= HIGH_PAYOFF for t in trues]
    hits = sum(1 for c, p in zip(called, pos, strict=True) if c and p)
    return {
        "folds": cfg.folds,
        "rows": n,
        "positives": sum(pos),
        "mae": round(sum(abs(p - t) for p, t in zip(preds, trues, strict=True)) / n, 4),
        "rmse": round(math.sqrt(sum((p - t) ** 2 for p, t in zip(preds, trues, strict=True))
                                / n), 4),
        "precision": round(hits / sum(called), 4) if sum(called) else 0.0,
        "recall": round(hits / sum(pos), 4) if sum(pos) else 0.0,
    }
