"""Linear layers over a few rows on CPU: ``W @ xᵀ`` instead of ``x @ Wᵀ``.

Verifying a short draft multiplies every weight matrix by 2-8 rows (the pending token plus
the draft). For such shapes MKL's ``x @ Wᵀ`` (``torch.nn.functional.linear``) takes a path
that costs about one pass over the weights *per row*, while the transposed product
``(W @ xᵀ)ᵀ`` (the same sums) reads them once. Measured on 2 CPU cores (fp32, torch
2.13, SmolLM2-135M shapes): the 576 x 49,152 output layer takes 7.3 ms for 1 row,
14.9 / 24.7 / 15.5 ms for 2 / 3 / 4 rows with ``linear`` and 4.2 / 4.5 / 3.5 ms with the
transposed product (2.2 / 2.7x at 6 / 8 rows, no gain from 12 rows on); the 576 x 1,536
MLP projections 1.5-1.9x faster at 2-4 rows, slower at 6-12. So a one-token verify (2
rows) cost more than a three-token one (4 rows), and a short draft cost far more than a
plain step: the draft gate (``agentspec/drafters/gate.py``) prices drafts by this curve.
On Qwen2.5-Coder-0.5B's shapes (896 x 151,936 output layer, 896 x 4,864 MLP) the
transposed product wins on the output layer at every row count up to 33, quiet or with
another process on the CPU, and on the MLP up to 8 rows (BENCHMARKS.md, "short verifies").

:func:`install` gives each ``nn.Linear`` of a CPU model a forward that takes the transposed
product for 2..:data:`BODY_ROWS` rows (2..:data:`WIDE_ROWS` for layers with at least
:data:`WIDE_OUT` outputs: the vocabulary projection) and ``linear`` otherwise; one-row
forwards (plain decoding) and prompts are untouched. The sums are the same, their order
is not: logits differ from ``linear``'s in the last bits (~1e-6 relative), as any change
of kernel does, and the lossless guarantee (outputs token-identical to plain decoding) is
tested on the tiny and the embedded model as before.
"""

from __future__ import annotations

import types
from typing import Any

import torch

BODY_ROWS = 8  # most rows for which the transposed product wins on the body's projections
WIDE_ROWS = 64  # ... on an output layer of at least WIDE_OUT features
WIDE_OUT = 8192


def _small_rows_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` with the transposed product for a few fp32 rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    limit = WIDE_ROWS if self.out_features >= WIDE_OUT else BODY_ROWS
    if 2 <= rows <= limit and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
        # [out, rows] -> [rows, out], made contiguous: a transposed view would reach
        # attention with a strided last dimension, and SDPA's flash kernel refuses it.
        y = torch.matmul(self.weight, x.reshape(rows, x.shape[-1]).T).T.contiguous()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def install(model: Any) -> int:
    """Give every ``nn.Linear`` of ``model`` the small-rows forward; returns how many.

    Only CPU models should call it (on CUDA, cuBLAS handles small batches well).
    """
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_small_rows_forward, module)  # type: ignore[method-assign]
            count += 1
    return count
