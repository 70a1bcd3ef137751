"""What the prefix store (:mod:`.prefix_cache`) holds and reports: a block of KV, a hit
handed to a target, and the store's counters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["LayerKV", "PrefixCacheStats", "PrefixHit"]

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [1, kv_heads, block, head_dim]


@dataclass
class StoredBlock:
    scope: str
    tokens: tuple[int, ...]
    kv: list[LayerKV]
    nbytes: int  # keys, values and feature rows
    features: torch.Tensor | None = None  # [block, H]; None: stored without (older file)


@dataclass
class PrefixHit:
    """What :meth:`PrefixCache.fetch` reused: ``n`` tokens (0: a miss), per layer the keys
    and values of positions ``0..n-1`` (``[1, kv_heads, n, head_dim]``) and their feature
    rows ``[n, H]`` (``None`` when a block used has none); fresh tensors."""

    n: int
    kv: list[LayerKV]
    features: torch.Tensor | None = None


@dataclass
class PrefixCacheStats:
    """What the store did since it was created.

    Attributes:
        lookups: Prompts looked up.
        hit_tokens: Prompt tokens reused (from stored blocks or the target's live KV).
        looked_up_tokens: Prompt tokens looked up.
        inserted_blocks: Blocks stored.
        evicted_blocks: Blocks dropped to stay within the budget.
        restored_blocks: Blocks read back from the spill folder.
    """

    lookups: int = 0
    hit_tokens: int = 0
    looked_up_tokens: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    restored_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from the store."""
        return self.hit_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0


def block_nbytes(kv: Sequence[LayerKV], features: torch.Tensor | None = None) -> int:
    rows = 0 if features is None else features.numel() * features.element_size()
    return rows + sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                      for k, v in kv)
