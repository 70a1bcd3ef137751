"""What a forward costs on the machine as loaded now: c(k, L) tracked from the target's own
timed forwards, and the thread count each multi-row forward runs with.

Why. A cost curve measured once, on a quiet machine, goes stale the moment another process
shares the CPU, and it goes stale unevenly: a one-token step is bound by memory bandwidth
and slows a little, while a forward over several rows runs parallel matrix products whose
threads wait for each other, so when one of two cores is taken every parallel region waits
for the descheduled thread. Drafts that paid on the quiet curve then cost more than the
plain steps they replace. The tracker keeps, per cell (thread count, row bucket, context
bucket), a decayed geometric mean of observed / prior seconds, so the prior curve's shape is
kept where nothing has been observed and replaced by the machine's behaviour where it has.

Threads. Each forward may run with the process's thread count ``T`` or with one thread: when
another process takes one of two cores, every parallel region of a ``T``-thread forward
waits for the descheduled thread, and one thread is then the faster choice, for one-row
steps as much as for verifies (beside a busy process a two-thread one-row step can take many
times its quiet time; ``docs/draft-cost.md``). The tracker picks the cheaper estimate per
cell and re-tries the other whenever its evidence has aged out (``explore_after`` seconds),
so it follows the load as it comes and goes. A one-row forward gives the same bits with one
thread or ``T`` (tested on both shipped models), so plain decoding, the reference of every
lossless guarantee, is unchanged. A prompt's forwards follow the load too
(:meth:`LiveCost.prefill_threads`), but only where a load-time probe found their bits the
same with either count (not fp32; docs/draft-cost.md lists which passed here). A verify
forward's thread count may change the order of its sums in the last bits, as a change of
kernel does; outputs are tested token-identical as before.

Estimates. ``ratio(t, r, c) = exp((w·mean_log + m·log fallback) / (w + m))`` with ``w`` the
cell's decayed weight (half-life ``half_life`` seconds of wall time), ``m`` pseudo
observations at the fallback: the next shorter row bucket of the same thread count, and for
one-row forwards the other contexts' one-row cells, else every cell's evidence pooled (or
1). A cell with no evidence thus
costs what the prior curve says scaled as its nearest observed neighbour, so a draft length
never tried is neither free nor forbidden; a one-thread cell starts as the same cell with
``T`` threads.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentspec.errors import ConfigError
from agentspec.types import ContextCost

#: How much cheaper one thread's forwards must be estimated than ``T``'s before a prefill
#: takes one thread (:meth:`LiveCost.prefill_threads`). Beside a busy process a two-thread
#: forward costs 1.3x to many times a one-thread one; on a quiet machine the two tie
#: within noise for one row and two threads win for many.
PREFILL_MARGIN = 0.8


def safe_prior(k: int, context: int) -> float:
    """The cost shape used before any curve is measured (units, not seconds: only ratios
    matter until forwards are observed): short forwards nearly free, longer ones steep, so
    the gate verifies short drafts only until the machine has shown what long ones cost."""
    rows = 0.15 * (k - 1) + 0.35 * max(0, k - 4)
    return (1.0 + rows) * (1.0 + context / 32768)


def row_bucket(k: int) -> int:
    """Cell of a forward over ``k`` rows: 1, 2, 3-4, 5-8, 9-16, 17-32, 33-64, ..."""
    return max(k - 1, 0).bit_length()


def context_bucket(context: int) -> int:
    """Cell of a context of ``context`` cached positions: < 1k, 1-2k, 2-4k, 4-8k, ..."""
    return (max(context, 0) >> 10).bit_length()


@dataclass(frozen=True)
class LiveCostConfig:
    """Settings of :class:`LiveCost`.

    Attributes:
        half_life: Seconds after which an observation counts half (load changes within
            seconds; a cell observed at every step adapts within a few of them).
        pseudo: Pseudo-observations at the fallback ratio (how much one timed forward moves
            a new cell away from its neighbour's estimate).
        explore_after: Seconds after the other thread count's last evidence for a cell at
            which one forward is run with it again (bounds what exploring costs: one forward
            per cell per this many seconds at most).
        adapt_threads: Whether forwards may run with one thread.
        learn: Whether timed forwards are recorded (``False``: c(k, L) is the prior curve
            and the gate's decisions do not depend on timings, e.g. to compare forward
            counts between runs).
    """

    half_life: float = 30.0
    pseudo: float = 2.0
    explore_after: float = 45.0
    adapt_threads: bool = True
    learn: bool = True

    def __post_init__(self) -> None:
        for name in ("half_life", "pseudo", "explore_after"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class _Cell:
    """Decayed sums of one cell: ``Σ w·log(observed / prior)``, ``Σ w``, last update."""

    log_sum: float = 0.0
    weight: float = 0.0
    stamp: float = 0.0

    def decayed(self, now: float, half_life: float) -> tuple[float, float]:
        f = 0.5 ** (max(0.0, now - self.stamp) / half_life)
        return self.log_sum * f, self.weight * f

    def add(self, log_ratio: float, now: float, half_life: float) -> None:
        self.log_sum, self.weight = self.decayed(now, half_life)
        self.log_sum += log_ratio
        self.weight += 1.0
        self.stamp = now


@dataclass
class LiveCost:
    """c(k, L) on the machine as loaded now (module docstring).

    Args:
        prior: The cost shape before observations: a measured curve (``HFTarget``'s,
            seconds) or :func:`safe_prior`.
        threads: The process's thread count ``T``.
        config: Decay and exploration settings.
        clock: Seconds (``time.monotonic``; tests pass their own).
    """

    prior: ContextCost = safe_prior
    threads: int = 1
    config: LiveCostConfig = field(default_factory=LiveCostConfig)
    clock: Callable[[], float] = time.monotonic
    measured: bool = False  # whether ``prior`` is a measured curve (not the safe prior)

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads!r}")
        self._cells: dict[tuple[int, int, int], _Cell] = {}
        self._lock = threading.Lock()
        self.observed = 0  # timed forwards seen

    def __deepcopy__(self, memo: dict[int, Any]) -> LiveCost:
        # A copied model (its hooks reach the target) gets a tracker of its own, without
        # the evidence: a lock cannot be copied, and another model copy's timings are not
        # this one's.
        return LiveCost(self.prior, self.threads, self.config, self.clock, self.measured)

    def set_prior(self, prior: ContextCost, measured: bool = True) -> None:
        """Replace the prior (a curve measured after the tracker was made); evidence kept
        as ratios to the old prior is dropped, since it no longer means the same."""
        with self._lock:
            self.prior, self.measured = prior, measured
            self._cells.clear()

    def _choices(self) -> tuple[int, ...]:
        if self.threads == 1 or not self.config.adapt_threads or not self.config.learn:
            return (self.threads,)
        return (self.threads, 1)

    def _ratio(self, t: int, rb: int, cb: int, now: float) -> float:
        """The cell's estimated observed / prior ratio (module docstring), lock held."""
        cell = self._cells.get((t, rb, cb))
        if t != self.threads:  # as the same forward with T threads until shown otherwise
            fallback = self._ratio(self.threads, rb, cb, now)
        elif rb > 0:
            fallback = self._ratio(t, rb - 1, cb, now)
        else:  # one-row forwards at other contexts, else every cell, else the prior
            logs = [c.decayed(now, self.config.half_life) for (tt, r, b), c in
                    self._cells.items() if tt == t and r == 0 and b != cb]
            w = sum(x[1] for x in logs)
            other = self._cells.get((1, rb, cb)) if t != 1 else None
            one = other.decayed(now, self.config.half_life) if other is not None else (0, 0)
            if w > 0:
                fallback = math.exp(sum(x[0] for x in logs) / w)
            elif one[1] > 0:
                # The same forward on one thread: its own evidence (as a one-thread cell
                # starts as this one). The machine-wide ratio below is shrunk toward the
                # prior, which a safe prior (units, not seconds: observed ratios ~0.03)
                # makes ~4x the evidence; measured, a draft model's one-row steps then
                # stayed on one thread, 31 ms, after two threads took 24.
                fallback = math.exp(one[0] / one[1])
            else:
                # No one-row evidence with T threads: the machine-wide ratio of whatever
                # was timed, shrunk toward the prior by ``m`` pseudo observations so that
                # it decays with its evidence (a prior measured under load is stale for
                # every k alike, and a policy that only ever runs 2-row verifies with one
                # thread would otherwise price the rest at the stale prior, never trying
                # them).
                logs = [c.decayed(now, self.config.half_life) for c in self._cells.values()]
                total = sum(x[0] for x in logs)
                fallback = math.exp(total / (sum(x[1] for x in logs) + self.config.pseudo))
        m = self.config.pseudo
        if cell is None:
            return fallback
        log_sum, w = cell.decayed(now, self.config.half_life)
        return math.exp((log_sum + m * math.log(fallback)) / (w + m))

    def estimate(self, k: int, context: int, threads: int) -> float:
        """Estimated seconds of a ``k``-row forward at ``context`` with ``threads``."""
        with self._lock:
            ratio = self._ratio(threads, row_bucket(k), context_bucket(context), self.clock())
        return self.prior(k, context) * ratio

    def cost(self, k: int, context: int) -> float:
        """c(k, L) now: the cheaper estimate over the thread counts the forward may use."""
        return min(self.estimate(k, context, t) for t in self._choices())

    def threads_for(self, k: int, context: int) -> int:
        """The thread count to run a ``k``-row forward at ``context`` with: the cheaper
        estimate, or the other one when its evidence has aged out (exploration)."""
        choices = self._choices()
        if len(choices) == 1:
            return choices[0]
        now = self.clock()
        rb, cb = row_bucket(k), context_bucket(context)
        with self._lock:
            ests = {t: self._ratio(t, rb, cb, now) for t in choices}
            best = min(choices, key=lambda t: ests[t])
            for t in choices:
                cell = self._cells.get((t, rb, cb))
                if t != best and (cell is None
                                  or now - cell.stamp > self.config.explore_after):
                    return t  # stale evidence: try it once
        return best

    def prefill_threads(self) -> int:
        """The thread count a prompt's forwards run with: one thread when the forwards
        timed with both counts recently say one thread is now clearly cheaper (under
        :data:`PREFILL_MARGIN` times ``T``'s); else ``T``.

        A prefill is a forward over many rows, the kind whose parallel regions wait on a
        descheduled thread when another process takes a core; it borrows the decode
        forwards' evidence instead of timing prefills of its own, which come in sizes too
        varied to explore (one exploring prefill with the wrong count costs seconds).

        The evidence is pooled over every cell (row bucket, context bucket) where both
        counts have fresh timings (within ``explore_after`` seconds): each cell gives
        ``log(observed₁ / observed_T)`` from its own timings alone (the estimates' pseudo
        observations would pull a cell explored once back to its neighbour's, making a
        clear case look like a tie), weighted by the lesser of the two cells' evidence and
        by the row bucket, since a prefill's rows are many. The margin keeps a near tie, as
        one-row steps on a quiet machine show (memory-bound either way), from sending a
        prefill to one thread, where a quiet machine runs it much slower."""
        if len(self._choices()) == 1:
            return self.threads
        now, fresh, half = self.clock(), self.config.explore_after, self.config.half_life
        total = weight = 0.0
        with self._lock:
            for (t, rb, cb), one in self._cells.items():
                many = self._cells.get((self.threads, rb, cb))
                if t != 1 or many is None or now - one.stamp > fresh \
                        or now - many.stamp > fresh:
                    continue
                (s1, w1), (st, wt) = one.decayed(now, half), many.decayed(now, half)
                if w1 <= 0 or wt <= 0:
                    continue
                w = min(w1, wt) * (1 + rb)
                total += w * (s1 / w1 - st / wt)  # w · log(observed₁ / observed_T)
                weight += w
        if weight == 0:
            return self.threads
        return 1 if total / weight < math.log(PREFILL_MARGIN) else self.threads

    def observe(self, k: int, context: int, threads: int, seconds: float) -> None:
        """Record a timed forward over ``k`` rows at ``context`` run with ``threads``."""
        if seconds <= 0 or k < 1 or not self.config.learn:
            return
        prior = self.prior(k, context)
        if prior <= 0:
            return
        now = self.clock()
        with self._lock:
            cell = self._cells.setdefault((threads, row_bucket(k), context_bucket(context)),
                                          _Cell())
            cell.add(math.log(seconds / prior), now, self.config.half_life)
            self.observed += 1

    def to_dict(self) -> dict[str, Any]:
        """The current estimates (seconds at the context buckets seen), for reports."""
        now = self.clock()
        with self._lock:
            cells = sorted(self._cells)
            out = {f"t{t}-rows{1 << r if r else 1}-ctx{b}": round(
                self._cells[(t, r, b)].decayed(now, self.config.half_life)[1], 2)
                for t, r, b in cells}
        return {"measured_prior": self.measured, "threads": self.threads,
                "observed": self.observed, "cell_weights": out}
