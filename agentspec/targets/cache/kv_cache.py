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

Shape-stable forwards (:mod:`agentspec.targets.forward.shapes`) steer a layer through a
:class:`StepPlan` shared by every layer of a cache: the next forward writes its keys at
device-side ``slots`` (an ``index_copy_`` a captured CUDA graph can replay), the fill mark
advances by the plan's ``real`` rows only (padding rows are written past it and overwritten
later), and attention reads a fixed ``attend`` positions whatever is filled, the positions
past a query masked out. A layer may also sit on buffers handed to it (``static``: one
preallocated pair per model on CUDA, so a graph captured over them stays valid from one
request to the next).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

#: Smallest capacity a buffer grows to (positions): a short prompt then needs no regrowth.
_MIN_CAPACITY = 256


class StepPlan:
    """What the next forward does to a cache's layers (shared by all of them).

    Attributes:
        real: Rows of the forward that count: the fill mark advances by this many
            (``None``: every row; padding rows past it are overwritten by later writes).
        attend: Key positions every query of the forward attends (a fixed shape: the mask
            hides what a query must not see); ``None``: the filled part.
        slots: ``[q]`` positions the forward's keys and values go to, on the cache's
            device (``None``: appended at the fill mark).
        defer: The caller advances the fill mark itself (:meth:`GrowingLayer.set_filled`;
            a replayed CUDA graph runs none of this host code).
        align: Buffers grow to a multiple of this many positions, exactly (``None``: with
            spare room). Kept across forwards (:meth:`clear` leaves it): the shape-stable
            policy's key alignment, so that a forward attending the whole buffer reads it
            as one contiguous block (see :meth:`GrowingLayer._reserve`).
    """

    def __init__(self) -> None:
        self.real: int | None = None
        self.attend: int | None = None
        self.slots: torch.Tensor | None = None
        self.defer = False
        self.align: int | None = None

    def clear(self) -> None:
        """Back to plain appends (the alignment stays)."""
        self.real = self.attend = self.slots = None
        self.defer = False


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer over preallocated buffers (see the module docstring).

    Args:
        max_positions: Capacity is never grown past this (the model's context window; the
            target checks prompts against it before any forward), unless one append needs
            more.
    """

    def __init__(self, max_positions: int | None = None, plan: StepPlan | None = None,
                 static: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.plan = plan or StepPlan()
        self.static = static  # [1, kv_heads, capacity, head_dim] each, never reallocated
        self._k: torch.Tensor | None = None  # [B, kv_heads, capacity, head_dim]
        self._v: torch.Tensor | None = None
        self._n = 0  # filled positions

    @property
    def capacity(self) -> int:
        """Positions the buffers hold before they must grow."""
        return 0 if self._k is None else int(self._k.shape[-2])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        if self.static is not None and key_states.shape[0] == 1:
            self._k, self._v = self.static
        else:
            self._k = key_states.new_empty(*key_states.shape[:-2], 0, key_states.shape[-1])
            self._v = value_states.new_empty(*value_states.shape[:-2], 0,
                                             value_states.shape[-1])
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
        if self.on_static():
            raise ValueError(f"{need} positions do not fit the static KV buffers of "
                             f"{self.capacity}")
        align = self.plan.align
        if align is not None:
            # Exactly the need rounded up to the alignment: a shape-stable forward attends
            # the aligned length, and when that is the whole buffer its keys are one
            # contiguous block per head. A slice of a longer buffer is not (each head's
            # rows sit a capacity apart), and PyTorch's CPU bf16 batched product then
            # copies the keys first: at 4k positions that copy cost ~3x the product itself.
            # The price is one copy of the cache per ``align`` positions grown.
            grown = -(-need // align) * align
        else:
            # A quarter beyond the need: a cache filled from stored prefix blocks is
            # extended by the prompt's tail and the answer next, without a second copy.
            grown = max(need + need // 4, self.capacity + self.capacity // 2, _MIN_CAPACITY)
            if self.max_positions is not None:
                grown = max(need, min(grown, self.max_positions))
        bufs = []
        for old in (self._k, self._v):
            # Zeros: a shape-stable forward reads past the fill mark (masked, weight 0), and
            # 0 * NaN from uninitialised memory would not be 0.
            buf = old.new_zeros(*old.shape[:-2], grown, old.shape[-1])
            buf[..., : self._n, :] = old[..., : self._n, :]
            bufs.append(buf)
        self._k, self._v = bufs

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, kv_heads, q, head_dim]`` keys and values; return all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plan = self.plan
        q = int(key_states.shape[-2])
        end = self._n + q
        self._reserve(max(end, plan.attend or 0))
        assert self._k is not None and self._v is not None
        if plan.slots is not None:  # device-side positions: replayable by a CUDA graph
            self._k.index_copy_(2, plan.slots, key_states)
            self._v.index_copy_(2, plan.slots, value_states)
        else:
            self._k[..., self._n : end, :] = key_states
            self._v[..., self._n : end, :] = value_states
        if not plan.defer:
            self._n += q if plan.real is None else plan.real
        if plan.attend is not None:
            self._publish()
            return self._k[..., : plan.attend, :], self._v[..., : plan.attend, :]
        return self._publish()

    def slots(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at positions ``start .. start + n`` of the buffers, filled or
        not (a padded forward's rows past the fill mark too): views ``[B, kv_heads, n, d]``."""
        if self._k is None or self._v is None:
            raise ValueError("slots() of a layer that holds no buffers yet")
        return self._k[..., start : start + n, :], self._v[..., start : start + n, :]

    def set_filled(self, n: int) -> None:
        """Set the fill mark to ``n`` positions (after a forward with a deferred plan)."""
        self._n = n
        self._publish()

    def on_static(self) -> bool:
        """Whether the layer's buffers are its static ones (a captured graph's)."""
        return self.static is not None and self._k is self.static[0]

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
            k, v = self._k[indices, ...], self._v[indices, ...]
            if self.static is not None and k.shape[0] == 1:  # back onto the static buffers
                n = min(int(k.shape[-2]), self.static[0].shape[-2])
                self.static[0][..., :n, :] = k[..., :n, :]
                self.static[1][..., :n, :] = v[..., :n, :]
                k, v = self.static
            self._k, self._v = k, v
            self._publish()


def new_cache(config: Any, max_positions: int | None = None, plan: StepPlan | None = None,
              static: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are
    :class:`GrowingLayer` s (sliding-window and other special layers stay as transformers
    builds them), steered by ``plan`` and, with ``static``, over those buffers (one pair per
    layer, in order)."""
    cache = DynamicCache(config=config)
    plan = plan or StepPlan()
    layers: list[Any] = []
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            layers.append(GrowingLayer(max_positions, plan,
                                       static[i] if static is not None else None))
        else:
            layers.append(layer)
    cache.layers = layers
    return cache


def reusable_layers(cache: DynamicCache) -> bool:
    """Whether every layer of ``cache`` holds every position it was fed (full attention:
    a plain ``DynamicLayer`` or a :class:`GrowingLayer`), so its KV can be cut and
    stored. Sliding-window layers drop old positions and never qualify."""
    return bool(cache.layers) and all(type(layer) in (DynamicLayer, GrowingLayer)
                                      for layer in cache.layers)
