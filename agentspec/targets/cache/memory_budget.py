"""How much memory the prefix KV store may take by default: a share of what is at hand.

A fixed budget is wrong on most machines: 1 GiB holds ~22k SmolLM2 tokens with their
feature rows, so with six tenants of 4.5k-token conversations the returning one keeps 84 %
of its prompt and prefills 3.5x faster than a cold tenant, against 90 % and 5.9x with
8 GiB (held-out conversations, a 2-core CPU); a GPU's free memory after the model loads is
another size again. The budget is therefore read from the memory available where the
blocks live (the target's device: :mod:`agentspec.targets.cache.prefix_cache`) when the store is
made, within fixed bounds.
"""

from __future__ import annotations

import os

import torch

__all__ = ["AUTO_PREFIX_CACHE_SHARE", "DEFAULT_PREFIX_CACHE_BYTES",
           "MAX_AUTO_PREFIX_CACHE_BYTES", "auto_budget_bytes", "available_bytes"]

#: Floor of the auto-sized budget, and the budget when the memory at hand is unknown: 1 GiB
#: holds ~22k tokens of SmolLM2-135M fp32 KV and features (30 layers x 2 x 3 KV heads x 64
#: dims x 4 bytes = 45 KiB of KV per token, plus 576 x 4 bytes = 2.25 KiB of feature row).
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30

#: Ceiling of the auto-sized budget (8 GiB: ~180k SmolLM2 tokens).
MAX_AUTO_PREFIX_CACHE_BYTES = 8 << 30

#: Share of the available memory the auto-sized budget takes.
AUTO_PREFIX_CACHE_SHARE = 0.25


def auto_budget_bytes(available: int | None) -> int:
    """The default budget for ``available`` bytes of memory where the blocks live.

    A quarter of ``available``, within :data:`DEFAULT_PREFIX_CACHE_BYTES` (1 GiB) ..
    :data:`MAX_AUTO_PREFIX_CACHE_BYTES` (8 GiB), and never more than half of ``available``
    (a nearly full device gets a small store rather than an out-of-memory error); 1 GiB when
    ``available`` is unknown (``None``).
    """
    if available is None:
        return DEFAULT_PREFIX_CACHE_BYTES
    available = max(0, int(available))
    share = int(available * AUTO_PREFIX_CACHE_SHARE)
    budget = min(max(share, DEFAULT_PREFIX_CACHE_BYTES), MAX_AUTO_PREFIX_CACHE_BYTES)
    return min(budget, available // 2)


def available_bytes(device: str | torch.device = "cpu") -> int | None:
    """Memory available now on ``device``: free memory of a CUDA device
    (``torch.cuda.mem_get_info``), else the host's ``MemAvailable`` (``/proc/meminfo``, or
    the free pages of ``os.sysconf``); ``None`` when it cannot be read."""
    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(dev)[0])
        except (RuntimeError, AssertionError, ValueError):  # no CUDA after all
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None
