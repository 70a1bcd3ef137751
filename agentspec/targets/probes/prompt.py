"""Load-time probe of a prompt's forwards: below how many rows they give the same bits with
one thread as with the process's count, so a prefill may take one thread on a busy machine
without changing an answer.
"""

from __future__ import annotations

from typing import Any

import torch

from agentspec.targets.base import cpu

__all__ = ["prompt_thread_rows"]


def prompt_thread_rows(kv: Any, switch: int | None = None,
                       lengths: tuple[int, ...] = (70, 40, 9), seed: int = 0) -> int | None:
    """Below how many rows a prompt's forwards give the same bits with one thread as with
    the process's thread count: ``None`` for any row count, 0 for none. Where this allows
    a forward, a prefill may run with one thread on a busy machine without changing an
    answer (:meth:`~agentspec.targets.cost.cost_meter.CostMeter.prefill`).

    First a cold prefill of ``lengths[0]`` random tokens (a forward of many rows, as every
    chunk of 64 rows or more), then chunks of the other lengths fed after them (tails after
    reused KV: one of :data:`~agentspec.targets.forward.attention.SPLIT_ROWS` rows or more, whose
    attention is split, and a short one, which may take other kernels); each chunk's last
    logits and the keys and values every position left in the cache are compared. Where
    they differ: 0. Where the model's products change kernel at ``switch`` rows, above those
    lengths (w8a16's integer product leaves for bf16's GEMM:
    :func:`~agentspec.targets.kernels.w8a8.prefill_switch`), a cold forward of ``switch`` rows is
    compared too: where it differs, ``switch``.

    Args:
        kv: The target's :class:`~agentspec.targets.forward.kv.ModelKV` (its cache is left
            empty).
        switch: The row count at which the products change kernel, if above ``lengths``.
    """
    if torch.get_num_threads() == 1:
        return None
    if not _prompt_agrees(kv, lengths, seed):
        return 0
    # A switch past the model's window is never reached: every prompt forward is below it.
    if switch is not None and switch <= kv.max_positions and not _prompt_agrees(
            kv, (switch,), seed):
        return switch
    return None


def _prompt_agrees(kv: Any, lengths: tuple[int, ...], seed: int) -> bool:
    """Whether chunks of ``lengths`` fed from an empty cache give the same logits and keys
    and values with one thread as with the process's count."""
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, kv.vocab, (sum(lengths),), generator=gen).tolist()
    outs = []
    try:
        for t in (threads, 1):
            with cpu.threads(t):
                kv.cache = kv.new_cache()
                start, seen = 0, []
                for n in lengths:
                    seen.append(kv.forward(ids[start : start + n], last_only=True))  # [1, V]
                    start += n
                seen += [x.clone() for layer in kv.layers() for x in layer]  # [1, h, Σ, d]
                outs.append(seen)
    finally:
        kv.cache = kv.new_cache()
    return all(torch.equal(a, b) for a, b in zip(outs[0], outs[1], strict=True))
