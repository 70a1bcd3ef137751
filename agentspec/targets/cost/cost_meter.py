"""What the target's forwards cost: measured once per machine, tracked as the load changes.

:class:`CostMeter` puts together the two halves the draft gate prices drafts with: the c(k,
L) curves measured when the model loads and kept in the cost file
(:class:`~agentspec.targets.cost.cost_curves.CostCurves`, which owns the file), and the
correction by the forwards timed since (:class:`~agentspec.targets.cost.live_cost.LiveCost`,
which also picks each forward's thread count). It times the measurement itself too: one
forward per draft length on a cache of random keys and values, through the target's own
scoring, so the curves price exactly the forwards requests run.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from agentspec.errors import ConfigError
from agentspec.targets.base import cpu
from agentspec.targets.base.fingerprint import forward_code, module_fingerprint
from agentspec.targets.cost import costs
from agentspec.targets.cost.cost_curves import CostCurves, FormsProbe, Probe
from agentspec.targets.cost.costs import Curve
from agentspec.targets.cost.live_cost import LiveCost
from agentspec.targets.forward.kv import ModelKV
from agentspec.targets.kernels import int8_mm


class Scratchpad(Protocol):
    """What :meth:`CostMeter.measure` times forwards on (the target's
    :class:`~agentspec.targets.request.scoring.Scorer`)."""

    def score(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` in one forward."""
        ...

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` positions."""
        ...

    def scratch(self, context: int,
                gen: torch.Generator) -> contextlib.AbstractContextManager[None]:
        """Score on a throwaway cache of ``context`` random positions inside."""
        ...


def cost_key(name: str, model: Any, dtype: str, device: str) -> str:
    """The cost file's name: model (name and a fingerprint of its weights, so two models of
    one name never share curves), dtype, device, machine and the forwards' code (curves
    timed on an older agentspec's forwards would misprice this one's)."""
    machine = f"{platform.machine()}-{os.cpu_count()}cpu-{torch.get_num_threads()}thr"
    if device == "cuda":
        machine = torch.cuda.get_device_name().replace(" ", "_")
    fingerprint = f"{name}-{module_fingerprint(model)}"
    code = forward_code()[:8]
    return f"{fingerprint}-{dtype}-{device}-{machine}-{code}".replace("/", "_")


class CostMeter:
    """The target's measured cost curves and their live correction.

    Args:
        kv: The model and its cache (the cost file's key, the cache length of each timed
            forward, the vocabulary of the measurement's random tokens).
        name: The model's name.
        dtype: The model's dtype.
        probe: Times one forward per draft length at a context (the target's
            ``measure_costs``).
        forms: The model's product forms (``None``: none to choose, e.g. on a GPU).

    Attributes:
        curves: The measured c(k, L) curves and their file.
        live: The live tracker, built on first use (it reads the cost file); ``None`` until
            then.
        measuring: Whether :meth:`measure` runs (its forwards are not observed).
        prefill_rows: Below how many rows a prompt's forwards may run with one thread on
            a busy machine (:meth:`prefill`; ``None``: any, 0: none): where they were
            probed to give the same bits with either count
            (:func:`~agentspec.targets.forward.shapes.prompt_thread_rows`).
    """

    def __init__(self, kv: ModelKV, name: str, dtype: str, probe: Probe,
                 forms: FormsProbe | None = None) -> None:
        self.kv = kv
        # Measured at load, never in a request.
        self.curves = CostCurves(name, cost_key(name, kv.model, dtype, kv.device),
                                 kv.max_positions, probe, forms)
        self.live: LiveCost | None = None
        self.measuring = False
        self.prefill_rows: int | None = 0

    @property
    def live_cost(self) -> LiveCost:
        """The cost of a forward on the machine as loaded now: its prior is the measured
        curves when the cost file has them (never measured here: a request must not wait
        for a measurement), else the safe prior until :meth:`ensure` runs."""
        if self.live is None:
            self.live = LiveCost(threads=torch.get_num_threads())
            if self.curves.stored() is not None:
                self.live.set_prior(self._measured_cost, measured=True)
        return self.live

    def context_cost(self, k: int, context: int) -> float:
        """c(k, L) now: the measured curves corrected by the forwards timed since."""
        if k < 1 or context < 0:
            raise ConfigError(f"context_cost needs k >= 1 and context >= 0, got {k}, {context}")
        return self.live_cost.cost(k, context)

    def verify_cost(self, k: int) -> float:
        """Measured seconds of one forward over ``k`` new tokens with a ~500-token cache."""
        if k < 1:
            raise ConfigError(f"verify_cost needs k >= 1, got {k}")
        return costs.interpolate(self.curves.base_curve(), k)

    def cost_curve(self) -> dict[int, float]:
        """The measured c(k) points (seconds), measuring them if needed."""
        return dict(self.curves.base_curve())

    def ensure(self, progress: bool = False) -> dict[int, Curve]:
        """Measure the curves the cost file lacks (with a progress line when ``progress``)
        and make them :attr:`live_cost`'s prior."""
        curves = self.curves.ensure(progress)
        if not self.live_cost.measured:
            self.live_cost.set_prior(self._measured_cost, measured=True)
        return dict(curves)

    def _measured_cost(self, k: int, context: int) -> float:
        curves = self.curves.stored()
        assert curves is not None  # the prior is set only once they are
        return costs.at_context(curves, k, context)

    @contextlib.contextmanager
    def timed(self, rows: int, context: int) -> Iterator[None]:
        """Run a verify forward over ``rows`` tokens at ``context`` cached positions with
        the thread count :attr:`live_cost` picks for it, and tell it what the forward
        took (nothing while :meth:`measure` runs)."""
        if self.measuring:
            yield
            return
        live, device = self.live_cost, self.kv.device
        pinned = self.kv.stable is not None and self.kv.stable.pin_threads
        threads = (live.threads_for(rows, context) if device == "cpu" and not pinned
                   else live.threads)
        # The direct decode step's first forward runs twice (its check against
        # transformers': decoder.py), so it takes about twice a forward's time. Observed,
        # it would make the thread count it ran with look slow, and the tracker would not
        # try that count again until the evidence aged out (measured beside a busy
        # process: one thread 241 ms on that first step, then two threads chosen at 185 ms
        # a step for ~45 s where one thread took 130).
        decoder = self.kv.decoder
        # The decoder whose check this forward may run (None: no check pending).
        checking = (decoder if decoder is not None and decoder.usable and not decoder.checked
                    else None)
        # One int8 kernel for all the forward's products, timed for its choice (int8_mm).
        with cpu.threads(threads), int8_mm.timed_forward() as kernel:
            t0 = time.perf_counter()
            yield
            if device == "cuda":
                torch.cuda.synchronize()
            # Still pending after the forward: the check did not run in it. An int8 kernel
            # trial is not observed either: half of them run the slower kernel (~2.4x a
            # one-row step's time), and a thread count whose first forwards were trials
            # would look slow until its evidence aged out (measured: a draft model's
            # one-row steps kept on one thread, 31 ms, where two took 25).
            if not kernel.trial and (checking is None
                                     or (checking.usable and not checking.checked)):
                live.observe(rows, context, threads, time.perf_counter() - t0)

    @contextlib.contextmanager
    def prefill(self, rows: int) -> Iterator[None]:
        """Run a prompt's forwards, the longest of ``rows`` rows, with the thread count the
        machine's load calls for (:meth:`~agentspec.targets.cost.live_cost.LiveCost.
        prefill_threads`): beside a busy process one thread feeds a long prompt faster than
        two on a 2-core machine, two are faster on a quiet one (docs/draft-cost.md). Only
        where forwards of that many rows were probed to give the same bits with either
        count (:attr:`prefill_rows`); else the process's thread count."""
        limit = self.prefill_rows
        exact = limit is None or rows < limit
        threads = (self.live_cost.prefill_threads()
                   if exact and self.kv.device == "cpu" and not self.measuring else None)
        with cpu.threads(threads):
            yield

    def measure(self, pad: Scratchpad, context: int = costs.SHORT_CONTEXT,
                repeats: int = 5, bar: Any = None,
                budget_s: float | None = costs.MEASURE_BUDGET_S) -> Curve:
        """Time one forward over k tokens on a ``context``-position cache of random keys and
        values (median of ``repeats``; ``bar``: a progress bar to advance, or None). No
        prompt of ``context`` tokens is prefilled: attention costs the same whatever the
        keys are.

        The points are taken in :data:`costs.MEASURE_ORDER`; once ``budget_s`` seconds
        have passed (``None``: no limit) the points not yet measured are interpolated
        between the measured ones (the two ends always are).

        A point another process slowed down is timed again (:func:`costs.glitches`: more
        than :data:`costs.GLITCH` times the next point, or the last one above its slope);
        the lower median is kept, since load only adds time. A glitch that survives is
        clamped to that bound (:func:`costs.without_glitches`): a gate never tries the
        verifies such a point overprices, so it would never learn otherwise."""
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.kv.vocab, (costs.COST_POINTS[-1],), generator=gen).tolist()
        self.measuring = True
        try:
            with pad.scratch(context, gen):
                pad.score(ids)  # warm-up
                pad.rollback(len(ids))
                deadline = None if budget_s is None else time.perf_counter() + budget_s
                curve: Curve = {}
                for k in costs.MEASURE_ORDER:
                    if len(curve) >= 2 and deadline is not None and \
                            time.perf_counter() > deadline:
                        break
                    curve[k] = self._median_forward(pad, ids[:k], repeats)
                    if bar is not None:
                        bar.update(1)
                for k in costs.glitches(curve):
                    curve[k] = min(curve[k], self._median_forward(pad, ids[:k], repeats))
        finally:
            self.measuring = False
        if bar is not None:  # the points left to interpolation
            bar.update(len(costs.COST_POINTS) - len(curve))
        fixed = costs.without_glitches(curve)
        return {k: fixed[k] if k in fixed else costs.interpolate(fixed, k)
                for k in costs.COST_POINTS}

    def _median_forward(self, pad: Scratchpad, ids: list[int], repeats: int) -> float:
        """Median seconds of one forward over ``ids`` (each rolled back)."""
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            pad.score(ids)
            if self.kv.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            pad.rollback(len(ids))
        return sorted(times)[len(times) // 2]
