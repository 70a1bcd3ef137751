"""The target's model and its one KV cache: every forward the target runs goes through here.

:class:`ModelKV` owns what a forward touches and nothing about why it runs: the transformers
model, its KV cache (one request's positions, appended and cut in place, see
:mod:`agentspec.targets.kv_cache`), the final-norm hidden states of the latest forward (a
hook on the final norm: an EAGLE head drafts from them) and a count of the cache's changes.
Which token ids the cache holds and whether its KV is in the prefix store is
:mod:`agentspec.targets.reuse`'s business; what to feed and which positions to keep after a
tree or a batch is :mod:`agentspec.targets.scoring`'s. Keeping the forwards in one place is
what makes "the same forwards" checkable: the three shapes below are the only calls into
the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from agentspec.errors import ConfigError, PromptTooLongError
from agentspec.targets.kv_cache import new_cache, reusable_layers

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values of one layer


class ModelKV:
    """A causal LM and its KV cache, with the forwards and cuts the target is made of.

    Args:
        model: A transformers causal LM (``model.model.norm``, when present, is hooked).
        device: The device the model runs on (``"cpu"`` or ``"cuda"``).

    Attributes:
        cache: The KV cache (``None`` before the first prefill).
        features: Final-norm hidden states ``[B, n, H]`` of the latest forward over the
            model (any owner's: the hook sits on the model), ``None`` before one.
        version: Bumped by every forward and every cut: equal numbers mean the cache holds
            what it held (the prefix reuse asks whether its copy is still the live KV).
        cache_factory: Makes an empty cache (the in-place one of ``kv_cache``; a test may
            put transformers' own here to compare against).
    """

    def __init__(self, model: Any, device: str) -> None:
        self.model = model
        self.device = device
        cfg = model.config
        self.max_positions: int = int(getattr(cfg, "max_position_embeddings", 8192) or 8192)
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        self.cache: Any = None
        self.features: torch.Tensor | None = None
        self.version = 0
        self.cache_factory: Callable[[], Any] = self._growing_cache
        self._reusable: bool | None = None  # every cache layer full attention
        self._n_body: int | None = None
        # The hook runs on every position even when only the last logits are kept; holding
        # a reference costs nothing (only last_features() copies).
        norm = getattr(getattr(model, "model", None), "norm", None)
        self.hooked = isinstance(norm, torch.nn.Module)
        if isinstance(norm, torch.nn.Module):
            norm.register_forward_hook(self._keep_features)
        # transformers 5.2x renames forward(past_key_values=) to forward(cache=).
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def _keep_features(self, _module: Any, _inputs: Any, output: Any) -> None:
        self.features = output if isinstance(output, torch.Tensor) else None

    def _growing_cache(self) -> Any:
        return new_cache(self.model.config, self.max_positions)

    # -- the cache -------------------------------------------------------------------------

    @property
    def num_cached(self) -> int:
        """Positions currently in the cache."""
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def check_fits(self, n_tokens: int) -> None:
        """Raise :class:`PromptTooLongError` if ``n_tokens`` positions exceed the model."""
        if n_tokens > self.max_positions:
            raise PromptTooLongError(
                f"{n_tokens} tokens exceed the model's context window of "
                f"{self.max_positions} positions; shorten the prompt or lower max_tokens"
            )

    def new_cache(self) -> Any:
        """An empty KV cache (:attr:`cache_factory`)."""
        return self.cache_factory()

    def reusable(self) -> bool:
        """Whether this model's cache layers can be cut and rebuilt (plain full-attention
        layers; sliding-window layers drop old positions, so they never reuse)."""
        if self._reusable is None:
            self._reusable = reusable_layers(self.new_cache())
        return self._reusable

    def layers(self) -> list[LayerKV]:
        """The live cache's keys and values per layer (views, not copies)."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def cache_from(self, kv: Sequence[LayerKV]) -> Any:
        """A new cache holding ``kv`` (full-attention layers, in order: stored blocks)."""
        cache = self.new_cache()
        with torch.inference_mode():
            for i, (k, v) in enumerate(kv):
                cache.update(k, v, i)
        return cache

    def crop(self, n: int) -> None:
        """Drop the last ``n`` > 0 positions of every row."""
        # transformers >= 5.2 takes a negative count of positions to remove.
        self.cache.crop(-n)
        self.version += 1

    def expand(self, rows: int) -> None:
        """Repeat the cache's one row ``rows`` times (a batch of continuations)."""
        self.cache.batch_repeat_interleave(rows)
        self.version += 1

    def select_row(self, row: int) -> None:
        """Keep only cache row ``row`` (back to one row)."""
        self.cache.batch_select_indices(torch.tensor([row], device=self.device))
        self.version += 1

    def move(self, past: int, path: Sequence[int]) -> None:
        """Move the keys and values at positions ``past + path[i]`` to ``past + 1 + i``, in
        place: only the tail is touched (copying the whole cache would cost O(context) per
        step). ``index_select`` copies the sources first, so overlaps are safe."""
        n = len(path)
        src = torch.tensor([past + int(i) for i in path], dtype=torch.long,
                           device=self.device)  # [n]
        with torch.inference_mode():  # the cache tensors are inference tensors
            for layer in self.cache.layers:
                for kv in (layer.keys, layer.values):
                    kv[..., past + 1 : past + 1 + n, :] = kv.index_select(-2, src)
        self.version += 1

    # -- the forwards ----------------------------------------------------------------------

    def forward(self, tokens: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append ``tokens`` to the cache's one row in one forward; their logits ``[n, V]``
        (``[1, V]`` when ``last_only``), fp32 on the CPU: verifiers compare them against
        drafts built there (a no-op on CPU; on CUDA one small copy per forward)."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, n]
        self.version += 1
        with torch.inference_mode():
            kwargs = {self._cache_kw: self.cache}
            out = self.model(
                input_ids=ids, use_cache=True, logits_to_keep=1 if last_only else 0, **kwargs
            )
        return out.logits[0].float().cpu()  # [n, V] (or [1, V] when last_only)

    def run(self, ids: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """Append ``ids`` ``[B, n]`` to the cache's ``B`` rows in one forward (``inputs``: an
        attention mask and position ids for a tree); the raw logits ``[B, n, V]``."""
        self.version += 1
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, **inputs,
                             **{self._cache_kw: self.cache})
        return out.logits

    def random_cache(self, context: int, gen: torch.Generator) -> Any:
        """A cache of ``context`` positions of random keys and values (attention costs the
        same whatever they are: for timing); the layers' shapes are read from a one-token
        forward on a fresh cache, which becomes :attr:`cache` meanwhile."""
        self.cache = self.new_cache()
        self.forward([0], last_only=True)
        shapes = [(layer.keys.shape, layer.keys.dtype) for layer in self.cache.layers]
        cache = self.new_cache()
        for i, (shape, dtype) in enumerate(shapes):
            full = (*shape[:-2], context, shape[-1])
            keys = torch.randn(full, generator=gen).to(dtype=dtype, device=self.device)
            values = torch.randn(full, generator=gen).to(dtype=dtype, device=self.device)
            cache.update(keys, values, i)
        return cache

    # -- what the forwards leave -----------------------------------------------------------

    def last_features(self) -> torch.Tensor:
        """Row 0 of :attr:`features` ``[n, H]``, fp32 on the CPU.

        Raises:
            ConfigError: no forward has run, or the model has no final norm to hook.
        """
        if self.features is None:
            raise ConfigError("last_features() before any forward (or the model has no "
                              "model.norm to read hidden states from)")
        return self.features[0].float().cpu()  # [n, H]

    @property
    def body_params(self) -> int:
        """Parameters every prompt token goes through (all but the embeddings and the
        output layer, which a prefill runs for the last position only)."""
        if self._n_body is None:
            skip = {id(self.model.get_input_embeddings().weight),
                    id(self.model.get_output_embeddings().weight)}
            self._n_body = sum(p.numel() for p in self.model.parameters() if id(p) not in skip)
        return self._n_body
