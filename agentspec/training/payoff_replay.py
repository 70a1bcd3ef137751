"""Trace replay: turn greedy traces into (φ_t, oracle accepted length) training rows.

For every output position p of every turn of a session, the cache drafter is put in exactly
the state it would have at that step of a real run — the request index holds the prompt
plus ``output[:p]``, the history index holds every earlier turn of the session — and asked
for its draft. Under strict greedy verification the draft's accepted length is then known
without running the target: it is the common prefix of the draft and the true greedy
continuation ``output[p:]`` (the target's argmax at each draft position *is* the trace).

The "recent accepted lengths" features need a step history, which depends on the decode
path. Replay walks the path a cache-only decoder would take (from position p it commits
``accepted + 1`` tokens) and, at every position, reads the last steps of that walk that
ended at or before it. This matches runtime, where the features read the engine's real
recent steps.

Train/validation splits are by *session*, never by step: neighbouring positions of one
turn share almost all their context, so a step-level split would leak the answer into
validation and overstate quality.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from agentspec.drafters.suffix.drafter import SuffixConfig, SuffixDrafter
from agentspec.errors import ConfigError
from agentspec.payoff.features import TokenTable, features
from agentspec.tokens import common_prefix
from agentspec.training.payoff_traces import Trace
from agentspec.types import DraftContext, SessionRef

# Accepted tokens that make a draft "high payoff" (train-predictor's precision / recall).
HIGH_PAYOFF = 6


@dataclass(frozen=True)
class Sample:
    """One replay position.

    Attributes:
        phi: The features of the cache draft at this position.
        accepted: Oracle accepted length of that draft.
        draft_len: Tokens in the draft.
        session_id: Session of the trace (the split unit).
        workload: Workload of the trace.
    """

    phi: list[float]
    accepted: int
    draft_len: int
    session_id: str
    workload: str


def replay_trace(
    trace: Trace,
    table: TokenTable,
    max_draft: int = 16,
    config: SuffixConfig | None = None,
) -> list[Sample]:
    """Replay one session; one :class:`Sample` per output position of every turn.

    Args:
        trace: The session's greedy turns.
        table: Character classes of the vocabulary.
        max_draft: Draft length asked of the cache drafter (the engine's ``max_draft``).
        config: Cache drafter settings (the runtime's defaults when ``None``).
    """
    drafter = SuffixDrafter(config)
    ref = SessionRef("replay")  # one scope per replayed session: a fresh drafter each
    out: list[Sample] = []
    for turn in trace.turns:
        tokens = list(turn.prompt)  # grown in place: the drafter checks only the seam
        plen = len(tokens)
        gen = turn.output
        walk_next = 0  # position where the cache-only walk takes its next step
        running: tuple[int, int, int] | None = None  # (end, draft_len, accepted)
        steps: list[tuple[int, int]] = []  # completed walk steps, oldest first
        for p in range(len(gen)):
            if running is not None and running[0] <= p:
                steps.append((running[1], running[2]))
                running = None
            draft = drafter.propose(DraftContext(tokens, plen, ref, step=p), max_draft)
            acc = common_prefix(draft.tokens, gen[p:])
            phi = features(tokens, plen, draft, steps, table)
            out.append(Sample(phi, acc, len(draft.tokens), trace.session_id, trace.workload))
            if p == walk_next:  # the walk verifies this draft: commits acc + 1 tokens
                walk_next = p + acc + 1
                running = (walk_next, len(draft.tokens), acc)
            tokens.append(gen[p])
        drafter.finish(DraftContext(tokens, plen, ref, step=len(gen)))
    return out


def replay(
    traces: Sequence[Trace], table: TokenTable, max_draft: int = 16, progress: bool = False
) -> list[Sample]:
    """Replay every trace (optionally with a tqdm bar over sessions)."""
    from tqdm import tqdm

    rows: list[Sample] = []
    for t in tqdm(traces, desc="replay", unit="session", disable=not progress):
        rows.extend(replay_trace(t, table, max_draft))
    return rows


def split_sessions(
    traces: Sequence[Trace], val_fraction: float = 0.3, seed: int = 0
) -> tuple[set[str], set[str]]:
    """Session ids for training and validation, split per workload (each workload keeps
    about ``val_fraction`` of its sessions in validation, at least one where it has two).

    Raises:
        ValueError: ``val_fraction`` outside (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    rng = random.Random(seed)
    by_wl: dict[str, list[str]] = {}
    for t in traces:
        by_wl.setdefault(t.workload, []).append(t.session_id)
    train: set[str] = set()
    val: set[str] = set()
    for wl in sorted(by_wl):
        ids = sorted(set(by_wl[wl]))
        rng.shuffle(ids)
        n_val = max(1, round(val_fraction * len(ids))) if len(ids) >= 2 else 0
        val.update(ids[:n_val])
        train.update(ids[n_val:])
    return train, val


@dataclass(frozen=True)
class Quality:
    """Held-out quality of a predictor.

    Attributes:
        rows: Validation positions with a non-empty cache draft.
        mae: Mean absolute error of ŷ (tokens).
        rmse: Root mean squared error of ŷ (tokens).
        precision: Of drafts predicted high-payoff (ŷ ≥ τ), the share with accepted ≥ 6.
        recall: Of drafts with accepted ≥ 6, the share predicted high-payoff.
        positives: Drafts with accepted ≥ 6.
        tau: The threshold used.
    """

    rows: int
    mae: float
    rmse: float
    precision: float
    recall: float
    positives: int
    tau: float

    def to_dict(self) -> dict[str, float | int]:
        """Rounded numbers for JSON and reports."""
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def prediction_quality(pred: Sequence[float], true: Sequence[int], tau: float) -> Quality:
    """Regression error and high-payoff precision/recall of predictions ``pred``."""
    n = len(true)
    if n == 0:
        return Quality(0, math.nan, math.nan, math.nan, math.nan, 0, tau)
    err = [p - t for p, t in zip(pred, true, strict=True)]
    hits = sum(1 for p, t in zip(pred, true, strict=True) if p >= tau and t >= HIGH_PAYOFF)
    called = sum(1 for p in pred if p >= tau)
    pos = sum(1 for t in true if t >= HIGH_PAYOFF)
    return Quality(
        n,
        sum(abs(e) for e in err) / n,
        math.sqrt(sum(e * e for e in err) / n),
        hits / called if called else 0.0,
        hits / pos if pos else 0.0,
        pos,
        tau,
    )


def pick_tau(pred: Sequence[float], true: Sequence[int]) -> float:
    """The threshold τ maximising F1 of "ŷ ≥ τ" against "accepted ≥ 6" on validation.

    F1 weighs a wasted verification (false positive) and a missed long copy (false
    negative) equally; candidates are the distinct predictions, so the result is exact.
    """
    best_f1, best_tau = -1.0, float(HIGH_PAYOFF)
    pos = sum(1 for t in true if t >= HIGH_PAYOFF)
    pairs = sorted(zip(pred, true, strict=True), key=lambda pt: -pt[0])
    hits = 0
    for i, (p, t) in enumerate(pairs):
        hits += t >= HIGH_PAYOFF
        # Predicting positive for the top i+1 rows means τ = p (ties resolved by next row).
        if i + 1 < len(pairs) and pairs[i + 1][0] == p:
            continue
        f1 = 2 * hits / (i + 1 + pos) if pos else 0.0
        if f1 > best_f1:
            best_f1, best_tau = f1, p
    return float(best_tau)
