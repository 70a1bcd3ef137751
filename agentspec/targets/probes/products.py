"""Load-time probes of a model's linear products: from how many rows a row's bits stop
depending on the row count (:func:`invariant_rows`), and whether they depend on the thread
count (:func:`thread_invariant`). Their answers shape the decode forwards
(:class:`~agentspec.targets.forward.shapes.StablePolicy`): a wrong "invariant" would let
speculation change an answer, so each runs on the model's own weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from agentspec.targets.base import cpu
from agentspec.targets.kernels.int8 import Int8Linear
from agentspec.targets.kernels.w8a8 import W8A8Linear

__all__ = ["invariant_rows", "thread_invariant"]


def _products(model: Any) -> Iterator[tuple[int, Callable[[torch.Tensor], torch.Tensor],
                                             torch.dtype]]:
    """Each distinct CPU product of ``model``'s linear layers once: (input width, the
    product ``x -> x @ Wᵀ`` its forward runs, the activations' dtype)."""
    seen: set[tuple[int, int, torch.dtype]] = set()
    product: Callable[[torch.Tensor], torch.Tensor]
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight
            product = partial(torch.nn.functional.linear, weight=w)
        elif isinstance(mod, (Int8Linear, W8A8Linear)):  # its own kernel, probed alike
            w = mod.qweight
            product = mod.product
        else:
            continue
        key = (int(w.shape[0]), int(w.shape[1]), w.dtype)
        if key in seen or w.device.type != "cpu":
            continue
        seen.add(key)
        yield key[1], product, torch.bfloat16 if w.dtype == torch.int8 else w.dtype


def _probe_input(width: int, dtype: torch.dtype, trial: int,
                 gen: torch.Generator) -> torch.Tensor:
    """``[1, width]``: inputs of varied scale; odd trials as an MLP's (heavy-tailed, many
    values near zero)."""
    scale = 10.0 * float(torch.rand(1, generator=gen)) + 1e-3
    x = torch.randn(1, width, generator=gen) * scale
    if trial % 2:
        x = F.silu(x) * torch.randn(1, width, generator=gen)
    return x.to(dtype)


def invariant_rows(model: Any, trials: int = 48, seed: int = 0) -> int | None:
    """The fewest rows from which every linear layer of ``model`` gives a row the same bits
    whatever the row count and the row's place among the rows: 1, 2, or ``None`` (no such
    count up to 33: the CPU policy then pads and chunks every decode forward to
    :data:`CPU_MIN_ROWS` rows).

    Measured on the model's own weights with inputs of varied scale: a one-row product is
    often another kernel (a matrix-vector product) whose fp32 sums round to bf16 one ulp
    apart in a few percent of rows, which random weights and unit inputs rarely show (on
    SmolLM2's MLP, 4 rows in 50).
    """
    gen = torch.Generator().manual_seed(seed)
    one_ok = True
    with torch.inference_mode():
        for width, product, dtype in _products(model):
            for trial in range(trials):
                x = _probe_input(width, dtype, trial, gen)
                outs = []
                for m in (1, 2, 8, 33):
                    xs = torch.randn(m, width, generator=gen).to(dtype)
                    at = m - 1 if trial % 3 else trial % m
                    xs[at] = x[0]
                    outs.append(product(xs)[at])
                if not all(torch.equal(outs[1], o) for o in outs[2:]):
                    return None
                one_ok = one_ok and torch.equal(outs[0], outs[1])
    return 1 if one_ok else 2


def thread_invariant(model: Any, trials: int = 8, seed: int = 0) -> bool:
    """Whether every linear layer of ``model`` gives the same bits with one thread as with
    the process's thread count, over 1-33 rows. The live cost model runs a forward with
    one thread when the machine is busy (:mod:`.live_cost`); where this is ``False`` a
    shape-stable target keeps the thread count fixed (:attr:`StablePolicy.pin_threads`)."""
    if torch.get_num_threads() == 1:
        return True
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for width, product, dtype in _products(model):
            for trial in range(trials):
                xs = torch.cat([_probe_input(width, dtype, trial, gen)
                                for _ in range((1, 2, 8, 33)[trial % 4])])  # [m, width]
                many = product(xs)
                with cpu.threads(1):
                    one = product(xs)
                if not torch.equal(one, many):
                    return False
    return True
