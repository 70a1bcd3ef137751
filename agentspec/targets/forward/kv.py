"""The target's model and its one KV cache: every forward the target runs goes through here.

:class:`ModelKV` owns what a forward touches and nothing about why it runs: the transformers
model, its KV cache (one request's positions, appended and cut in place, see
:mod:`agentspec.targets.cache.kv_cache`), the final-norm hidden states of the latest forward (a
hook on the final norm: an EAGLE head drafts from them) and a count of the cache's changes.
Which token ids the cache holds and whether its KV is in the prefix store is
:mod:`agentspec.targets.request.reuse`'s business; what to feed and which positions to keep after a
tree or a batch is :mod:`agentspec.targets.request.scoring`'s. Keeping the forwards in one place is
what makes "the same forwards" checkable: the three shapes below are the only calls into
the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from agentspec.errors import ConfigError, PromptTooLongError
from agentspec.targets.base.step_mode import stable_step
from agentspec.targets.cache.kv_cache import GrowingLayer, StepPlan, new_cache, reusable_layers
from agentspec.targets.forward.decoder import DirectDecoder
from agentspec.targets.forward.shapes import StablePolicy, attend_length, chunks, step_inputs
from agentspec.targets.forward.step_graph import StepGraph

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
        stable: The shape-stable policy of decode forwards (:mod:`.stable`), ``None``:
            every forward has the shape of what it feeds.
        plan: Steers the next forward's cache writes (shared by every cache made here).
        decoder: Runs shape-stable decode forwards without transformers' wrappers
            (:mod:`.decoder`; CPU, Llama-family models), ``None``: transformers runs them.
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
        self.stable: StablePolicy | None = None
        self.plan = StepPlan()
        self._static: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.graph: StepGraph | None = None
        self.decoder: DirectDecoder | None = None
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
        return new_cache(self.model.config, self.max_positions, self.plan, self._static)

    def make_stable(self, policy: StablePolicy) -> None:
        """Shape every decode forward by ``policy`` from now on (:mod:`.stable`). A policy
        over the whole static cache (``align=None``) allocates it here: one zeroed key and
        value buffer per layer, the context window plus one bucket long, that every cache
        made afterwards sits on (a CUDA graph captured over them stays valid)."""
        self.stable = policy
        self.plan.align = policy.align
        if policy.align is None:
            cfg = self.model.config
            heads = int(cfg.num_attention_heads)
            kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
            dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
            length = self.max_positions + max(policy.max_rows, policy.min_rows)
            dtype = next(self.model.parameters()).dtype
            self._static = [
                (torch.zeros(1, kv_heads, length, dim, dtype=dtype, device=self.device),
                 torch.zeros(1, kv_heads, length, dim, dtype=dtype, device=self.device))
                for _ in range(int(cfg.num_hidden_layers))]
        self.decoder = DirectDecoder.build(self.model, self.device)
        if policy.graphs and policy.one_shape and str(self.device).startswith("cuda"):
            self.graph = StepGraph(self, policy.min_rows, self.static_length)
        self.cache = None

    @property
    def static_length(self) -> int:
        """Positions of the static buffers (0 without them)."""
        return 0 if self._static is None else int(self._static[0][0].shape[-2])

    def _growing_layers(self) -> list[GrowingLayer]:
        return [layer for layer in self.cache.layers if isinstance(layer, GrowingLayer)]

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

    def forward(self, tokens: Sequence[int], last_only: bool = False,
                step: bool = False) -> torch.Tensor:
        """Append ``tokens`` to the cache's one row in one forward; their logits ``[n, V]``
        (``[1, V]`` when ``last_only``), fp32 on the CPU: verifiers compare them against
        drafts built there (a no-op on CPU; on CUDA one small copy per forward).

        ``step``: a decode-phase forward (a plain step or a verify), shaped by
        :attr:`stable` when set (padded rows, chunks, a fixed key length)."""
        if step and self.stable is not None:
            return self._stable_forward(tokens)
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, n]
        self.version += 1
        with torch.inference_mode():
            kwargs = {self._cache_kw: self.cache}
            out = self.model(
                input_ids=ids, use_cache=True, logits_to_keep=1 if last_only else 0, **kwargs
            )
        return out.logits[0].float().cpu()  # [n, V] (or [1, V] when last_only)

    def _stable_forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """:meth:`forward` of a decode step under :attr:`stable`: each chunk of at most
        ``max_rows`` tokens is padded to ``min_rows`` rows and attends a fixed key length;
        the real rows' logits ``[n, V]`` (fp32, CPU) and features are kept."""
        policy = self.stable
        assert policy is not None
        logits: list[torch.Tensor] = []
        feats: list[torch.Tensor] = []
        for chunk in chunks(tokens, policy.max_rows):
            n, start = len(chunk), self.num_cached
            rows = max(policy.min_rows, n)
            ids = chunk + [chunk[-1]] * (rows - n)  # padding rows: any valid token
            attend = self._whole_buffer(attend_length(start + rows, policy,
                                                      self.static_length))
            out, feat = self._stable_chunk(ids, start, n, attend)
            logits.append(out[:n].float().cpu())  # [n, V]
            if feat is not None:
                feats.append(feat[:, :n].clone())  # [1, n, H] (a graph reuses its output)
        self.features = (feats[0] if len(feats) == 1 else torch.cat(feats, dim=1)) \
            if feats else None
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _whole_buffer(self, attend: int) -> int:
        """``attend``, or the cache buffers' whole aligned length where that is at most one
        alignment block longer: a product over a whole buffer reads contiguous keys (see
        :meth:`GrowingLayer._reserve`), and under the policy a row's bits are the same for
        any aligned key length (the positions past it are masked)."""
        align = self.plan.align
        layers = self._growing_layers() if self.cache is not None else []
        if align is None or not layers:
            return attend
        capacity = layers[0].capacity
        if capacity % align == 0 and attend < capacity <= attend + align:
            return capacity
        return attend

    def _stable_chunk(self, ids: list[int], start: int, n: int,
                      attend: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One shape-stable forward of ``len(ids)`` rows at ``start`` of which the first
        ``n`` are real; logits ``[rows, V]`` and features ``[1, rows, H]`` (device)."""
        self.version += 1
        graph = self.graph
        if graph is not None and len(ids) == graph.rows and self._on_static():
            out = graph.run(ids, start)
            if out is not None:
                for layer in self._growing_layers():
                    layer.set_filled(start + n)
                return out
        start_t = torch.tensor(start, dtype=torch.long, device=self.device)
        ids_t = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, rows]
        return self.stable_call(ids_t, start_t, attend, real=n), self.features

    def stable_call(self, ids: torch.Tensor, start: torch.Tensor, attend: int,
                    real: int | None = None, device_slots: bool = False) -> torch.Tensor:
        """The model over ``ids`` ``[1, rows]`` whose first row sits at position ``start``
        (a 0-d long tensor on the device), every query attending ``attend`` key positions
        under the causal mask of :func:`~agentspec.targets.forward.shapes.step_inputs`; the raw
        logits ``[rows, V]``.

        ``real``: rows the fill mark advances by. ``device_slots``: the keys go to the
        slots computed from ``start`` on the device and the fill mark is left to the caller
        (what a captured CUDA graph replays: no host value inside)."""
        dtype = next(self.model.parameters()).dtype
        # positions [1, rows], mask [1, 1, rows, attend]
        pos, mask = step_inputs(start, int(ids.shape[1]), attend, dtype)
        plan = self.plan
        plan.real, plan.attend = real, attend
        if device_slots:
            plan.slots, plan.defer = pos[0], True
        decoder = self.decoder
        if decoder is not None and (not decoder.usable or device_slots or self.cache is None
                                    or len(self._growing_layers()) != len(self.cache.layers)):
            decoder = None  # transformers runs this step
        try:
            with stable_step(), torch.inference_mode():
                if decoder is None:
                    return self._hf_call(ids, pos, mask)
                if decoder.checked:
                    return decoder.forward(ids, pos, mask, self.cache)
                return self._checked_direct(decoder, ids, pos, mask, real, attend)
        finally:
            plan.clear()

    def _hf_call(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """transformers' forward of a stable step (the plan already set): logits ``[rows, V]``."""
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask,
                         cache_position=pos[0], use_cache=True, **{self._cache_kw: self.cache})
        return out.logits[0]

    def _checked_direct(self, decoder: DirectDecoder, ids: torch.Tensor, pos: torch.Tensor,
                        mask: torch.Tensor, real: int | None, attend: int) -> torch.Tensor:
        """The decoder's first step, run twice: by the decoder, then (from the same fill
        mark) by transformers, whose logits, keys and values it must match bit for bit or
        it is dropped. The cache keeps transformers' writes; its logits are returned."""
        layers = self._growing_layers()
        start, rows = self.num_cached, int(ids.shape[1])
        try:
            mine = decoder.forward(ids, pos, mask, self.cache)
        except Exception as exc:  # any failure means: not for this model
            decoder.drop(f"{type(exc).__name__}: {exc}")
            mine = None
        written = []  # per layer, the rows' keys and values ([1, kv, rows, d]), padding too
        if mine is not None:
            written = [tuple(t.clone() for t in layer.slots(start, rows)) for layer in layers]
        for layer in layers:
            layer.set_filled(start)
        self.plan.real, self.plan.attend = real, attend
        ref = self._hf_call(ids, pos, mask)
        if mine is None:
            return ref
        same = torch.equal(mine, ref) and all(
            torch.equal(k, ref_k) and torch.equal(v, ref_v)
            for (k, v), (ref_k, ref_v) in zip(written, (layer.slots(start, rows)
                                                        for layer in layers), strict=True))
        if same:
            decoder.checked = True
        else:
            decoder.drop("its first step's logits or keys differ from transformers' forward")
        return ref

    def _on_static(self) -> bool:
        """Whether the live cache sits on the static buffers (one row, never regrown)."""
        layers = self._growing_layers() if self.cache is not None else []
        return bool(layers) and all(layer.on_static() for layer in layers)

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
        forward on a fresh cache, which becomes :attr:`cache` meanwhile. On static buffers
        this overwrites what they held (the scorer's scratch forgets the live ids)."""
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
        """Row 0 of :attr:`features` ``[n, H]``, fp32 on the model's device (drafters that
        read them follow the target's device).

        Raises:
            ConfigError: no forward has run, or the model has no final norm to hook.
        """
        if self.features is None:
            raise ConfigError("last_features() before any forward (or the model has no "
                              "model.norm to read hidden states from)")
        return self.features[0].float()  # [n, H]

    @property
    def body_params(self) -> int:
        """Parameters every prompt token goes through (all but the embeddings and the
        output layer, which a prefill runs for the last position only)."""
        if self._n_body is None:
            skip = {id(self.model.get_input_embeddings().weight),
                    id(self.model.get_output_embeddings().weight)}
            self._n_body = sum(p.numel() for p in self.model.parameters() if id(p) not in skip)
        return self._n_body
