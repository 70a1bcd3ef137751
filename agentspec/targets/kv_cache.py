"""A KV cache layer that appends in place: decoding on a long context without copying it.

transformers' ``DynamicLayer`` appends with ``torch.cat``, so every forward copies the
whole cache: at 4k tokens of SmolLM2-135M context that is ~190 MB per step (30 layers x
keys and values), about a sixth of a one-token step on 2 CPU cores, and more the longer an
agent's conversation grows. :class:`GrowingLayer` keeps keys and values in buffers with
spare capacity (grown by half, like a Python list: amortised O(1) per token) and writes new
positions into them; ``keys`` / ``values`` are views of the filled part, so everything that
reads a ``DynamicLayer`` (attention, :meth:`HFTarget.keep_tree_path`'s in-place moves, the
prefix store's copies) reads the same tensors, and the attention sees the same numbers: the
output is bit-identical to ``DynamicLayer``'s (tested).

Rolling back (``crop``) only moves the fill mark: the positions past it are overwritten by
the next append, which is what speculative decoding does after every rejected draft.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

#: Smallest capacity a buffer grows to (positions): a short prompt then needs no regrowth.
_MIN_CAPACITY = 256


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer over preallocated buffers (see the module docstring).

    Args:
        max_positions: Capacity is never grown past this (the model's context window; the
            target checks prompts against it before any forward), unless one append needs
            more.
    """

    def __init__(self, max_positions: int | None = None) -> None:
        super().__init__()
        self.max_positions = max_positions
        self._k: torch.Tensor | None = None  # [B, kv_heads, capacity, head_dim]
        self._v: torch.Tensor | None = None
        self._n = 0  # filled positions

    @property
    def capacity(self) -> int:
        """Positions the buffers hold before they must grow."""
        return 0 if self._k is None else int(self._k.shape[-2])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._k = key_states.new_empty(*key_states.shape[:-2], 0, key_states.shape[-1])
        self._v = value_states.new_empty(*value_states.shape[:-2], 0, value_states.shape[-1])
        self._n = 0
        self._publish()
        self.is_initialized = True

    def _publish(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._k is not None and self._v is not None
        keys = self._k[..., : self._n, :]  # [B, kv_heads, n, head_dim], a view
        values = self._v[..., : self._n, :]
        self.keys, self.values = keys, values
        return keys, values

    def _reserve(self, need: int) -> None:
        """Make room for ``need`` positions, copying the filled part once if it moves."""
        assert self._k is not None and self._v is not None
        if need <= self.capacity:
            return
        # A quarter beyond the need: a cache filled from stored prefix blocks is extended
        # by the prompt's tail and the answer next, without a second copy.
        grown = max(need + need // 4, self.capacity + self.capacity // 2, _MIN_CAPACITY)
        if self.max_positions is not None:
            grown = max(need, min(grown, self.max_positions))
        bufs = []
        for old in (self._k, self._v):
            buf = old.new_empty(*old.shape[:-2], grown, old.shape[-1])
            buf[..., : self._n, :] = old[..., : self._n, :]
            bufs.append(buf)
        self._k, self._v = bufs

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, kv_heads, q, head_dim]`` keys and values; return all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self._k is not None and self._v is not None
        end = self._n + int(key_states.shape[-2])
        self._reserve(end)
        self._k[..., self._n : end, :] = key_states
        self._v[..., self._n : end, :] = value_states
        self._n = end
        return self._publish()

    def get_seq_length(self) -> int:
        return self._n if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers' negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop() takes a negative count of positions to remove, got "
                             f"{tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._n = max(0, self._n + tokens_to_remove)
        self._publish()

    def reset(self) -> None:
        self._k = self._v = None
        self._n = 0
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            keys, values = self._publish()
            self._k = keys.repeat_interleave(repeats, dim=0)
            self._v = values.repeat_interleave(repeats, dim=0)
            self._publish()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            assert self._k is not None and self._v is not None
            self._k, self._v = self._k[indices, ...], self._v[indices, ...]
            self._publish()


def new_cache(config: Any, max_positions: int | None = None) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are
    :class:`GrowingLayer` s (sliding-window and other special layers stay as transformers
    builds them)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(max_positions) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache


def reusable_layers(cache: DynamicCache) -> bool:
    """Whether every layer of ``cache`` holds every position it was fed (full attention:
    a plain ``DynamicLayer`` or a :class:`GrowingLayer`), so its KV can be cut and
    stored. Sliding-window layers drop old positions and never qualify."""
    return bool(cache.layers) and all(type(layer) in (DynamicLayer, GrowingLayer)
                                      for layer in cache.layers)
