"""Load-time probe of decode attention: whether
:func:`~agentspec.targets.forward.attention.stable_attention` gives a query row the same
bits whatever the forward's row count, the row's place and the thread count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from agentspec.targets.base import cpu
from agentspec.targets.forward import attention  # called as a module attribute: tests replace it
from agentspec.targets.forward.shapes import CPU_ALIGN, step_inputs

__all__ = ["PROBE_KEYS", "attention_invariant", "attention_rows_invariant"]


#: Key lengths :func:`attention_invariant` tries: one, four and eight alignment blocks.
PROBE_KEYS = (CPU_ALIGN, 4 * CPU_ALIGN, 8 * CPU_ALIGN)


def attention_invariant(model: Any, trials: int = 4, seed: int = 0) -> bool:
    """Whether decode attention
    (:func:`~agentspec.targets.forward.attention.stable_attention`) gives a query row the
    same bits in a forward of any row count (1-33), at any place among the rows, with one
    thread as with the process's thread count, and over the next aligned key length (the
    keys past the row masked), in ``model``'s head shapes and activation dtype, at the key
    lengths of :data:`PROBE_KEYS` (those within its window). Where it does not, a CPU target
    runs every decode forward in one shape with a pinned thread count
    (:func:`~agentspec.targets.probes.policy.stable_policy`).

    Why a probe: the products inside attention pick their kernel by shape like any other
    product, and a kernel that rounds a row otherwise for some row counts breaks a verify's
    exactness as surely as a linear layer would (docs/cpu_step.md has the case found)."""
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    dtype = model.get_input_embeddings().weight.dtype
    window = int(getattr(cfg, "max_position_embeddings", 0) or PROBE_KEYS[-1])
    keys = [n for n in PROBE_KEYS if n <= window] or [window]
    return attention_rows_invariant(heads, kv, dim, dtype, keys, trials, seed)


def attention_rows_invariant(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                             keys: Sequence[int] = PROBE_KEYS, trials: int = 4,
                             seed: int = 0) -> bool:
    """:func:`attention_invariant` for explicit head shapes. Per trial and key length
    ``n``: a block of 33 consecutive query rows near the end of ``n`` keys, each row
    attended alone (a one-row forward, the process's threads); then for every row count
    2-33 windows of that many consecutive rows of the block at random offsets (every other
    count with one thread, every third window over ``n`` + 512 keys), each of their rows
    compared with its one-row bits."""
    gen = torch.Generator().manual_seed(seed)
    scale, block = head_dim ** -0.5, 33
    with torch.inference_mode():
        for _ in range(trials):
            for n in keys:
                spread = 1.0 + 4.0 * float(torch.rand(1, generator=gen))  # softmax peakiness
                long = n + CPU_ALIGN  # a longer key span: the next aligned length
                key = (torch.randn(1, kv_heads, long, head_dim, generator=gen)
                       * spread).to(dtype)  # [1, kv, n + align, d]
                value = torch.randn(1, kv_heads, long, head_dim, generator=gen).to(dtype)
                rows = (torch.randn(1, heads, block, head_dim, generator=gen)
                        * spread).to(dtype)  # [1, heads, 33, d]
                first = max(0, n - block - int(torch.randint(0, 64, (1,), generator=gen)))
                # Row i at position first + i sees keys 0 .. first + i: [1, 1, 33, long]
                mask = step_inputs(torch.tensor(first), block, long, dtype)[1]
                alone = torch.cat([attention.stable_attention(
                    rows[:, :, i : i + 1], key[:, :, :n], value[:, :, :n],
                    mask[:, :, i : i + 1, :n], scale)
                    for i in range(block)], dim=1)  # [1, 33, heads, d]
                # Short windows cost little: a few of each, so rare roundings show.
                counts = [q for q in range(2, block + 1) for _ in range(max(1, 12 // q))]
                for j, q in enumerate(counts):
                    at = int(torch.randint(0, block - q + 1, (1,), generator=gen))
                    span = long if j % 3 == 0 else n  # also over more (masked) keys
                    with cpu.threads(1 if q % 2 else None):
                        got = attention.stable_attention(
                            rows[:, :, at : at + q], key[:, :, :span], value[:, :, :span],
                            mask[:, :, at : at + q, :span], scale)
                    if not torch.equal(got, alone[:, at : at + q]):
                        return False
    return True
