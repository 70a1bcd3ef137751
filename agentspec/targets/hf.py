"""The transformers target: a causal LM with a KV cache that can score many tokens in one
forward and roll rejected positions back exactly.

fp32 (the default) is the exact mode: speculative output is token-identical to plain greedy
decoding. bf16 is an opt-in fast mode whose numerics depend on batch shape, so its
divergence is measured rather than promised.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import platform
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentspec.errors import Cancelled, ConfigError, PromptTooLongError
from agentspec.models import agentspec_home, load_model_and_tokenizer
from agentspec.targets import attention, costs, linear
from agentspec.targets.block_features import FeatureLog
from agentspec.targets.cost_curves import CostCurves, FormsProbe
from agentspec.targets.fingerprint import folder_fingerprint, module_fingerprint
from agentspec.targets.kv_cache import new_cache, reusable_layers
from agentspec.targets.kv_spill import KVSpill
from agentspec.targets.live_cost import LiveCost
from agentspec.targets.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache

_log = logging.getLogger(__name__)

#: Tokens per forward when a prompt's tail is fed after reused KV. One forward over the
#: whole tail attends every new token to every new token (a full [tail, cached + tail]
#: mask: the causal kernel's skipping needs a cache-free prefill); in chunks each chunk
#: attends only to what precedes it plus itself, which on long tails roughly halves the
#: tail's attention. Measured on 2 CPU cores, SmolLM2-135M, 3,151 new tokens after 2,816
#: reused: one forward 15.5 s, chunks of 512 13.3-13.7 s, of 256 13.9-14.8 s (a cold
#: prefill of all 5,967: 16.5-18.3 s).
PREFILL_CHUNK = 512


@dataclass(frozen=True)
class TargetConfig:
    """Settings of a :class:`HFTarget`.

    Attributes:
        model: Embedded model name or a local Hugging Face folder (see ``resolve_model``).
        dtype: ``"float32"`` (exact) or ``"bfloat16"`` (fast, not bit-exact).
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when available).
        prefix_cache_bytes: Budget of the KV prefix store (see
            :mod:`agentspec.targets.prefix_cache`); 0 disables prefix reuse.
        prefix_spill_bytes: Budget of the store's disk copies under
            ``$AGENTSPEC_HOME/prefix-kv/<model>-<fingerprint>-<dtype>`` (a session's prefix
            KV survives a restart; see :mod:`agentspec.targets.kv_spill`); 0: memory only.
        measure_costs: Measure the verify cost curves the draft gate prices drafts with
            when the model loads, if ``$AGENTSPEC_HOME/costs`` does not hold them yet (once
            per machine, a progress line); ``False`` leaves the gate on its safe prior
            (short drafts only) until forwards have been timed.
    """

    model: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES
    prefix_spill_bytes: int = 0
    measure_costs: bool = True

    def __post_init__(self) -> None:
        for name in ("prefix_cache_bytes", "prefix_spill_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")

    def resolved_device(self) -> str:
        """The device actually used."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


def _check_cancel(cancel: threading.Event | None) -> None:
    """Raise :class:`Cancelled` once ``cancel`` is set (between prefill forwards)."""
    if cancel is not None and cancel.is_set():
        raise Cancelled("the request was cancelled during its prefill")


class HFTarget:
    """A transformers causal LM behind the :class:`~agentspec.interfaces.Target` protocol.

    The KV cache holds every token fed since the last :meth:`prefill`; :meth:`score`
    appends, :meth:`rollback` drops positions from the end.

    Prefix reuse (``prefix_cache`` with a budget, and ``prefill(..., scope=tenant)``): the
    target knows which token ids its KV holds (every feeding method keeps ``_ids`` in step,
    and anything it cannot follow, such as a tree never resolved, forgets them). When the
    next request comes, the finished request's KV is stored in the scope's blocks, and
    the new prompt is fed from the end of its longest prefix shared with the live KV (same
    scope) or the stored blocks. Keys and values at a position depend only on the tokens up
    to it, so the output is the same as without reuse (in fp32 up to rounding, as for any
    draft length: token-identical in the tests).
    """

    def __init__(self, model: Any, tokenizer: Any, name: str, dtype: str, device: str,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.dtype = dtype
        self.device = device
        self._cache: Any = None
        self._live: LiveCost | None = None  # built on first use (reads the cost file)
        self._measuring = False  # measure_costs() runs: its forwards are not observed
        self._retired = False  # the live KV is in the prefix store as it stands (retire())
        cfg = model.config
        self.max_positions: int = int(getattr(cfg, "max_position_embeddings", 8192) or 8192)
        self._vocab = int(model.get_output_embeddings().weight.shape[0])
        forms = None
        if device == "cpu":  # bit-identical, no KV copy per query head (see attention.py)
            attention.install(model)
            # A short draft's few rows in the product form measured fastest on this machine.
            forms = FormsProbe(linear.install(model), lambda bar: linear.measure(model, bar=bar),
                               linear.shapes(model))
        # The measured c(k, L) curves and their file (measured at load, never in a request).
        self.curves = CostCurves(name, self._cost_key(), self.max_positions,
                                 lambda ctx, repeats, bar: self.measure_costs(ctx, repeats, bar),
                                 forms)
        # Final-norm hidden states of the latest forward ([B, n, H]), captured by a hook on
        # the final norm (it runs on every position even when only the last logits are
        # kept). Holding a reference costs nothing; only last_features() copies.
        self._features: torch.Tensor | None = None
        self._tree_n = 0  # tokens of the latest score_tree(), until keep_tree_path()
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            prefix_cache.device = device  # blocks read back from disk go to the model
        # The token ids whose KV the cache holds, in order (None: unknown, never reused),
        # the scope (tenant) they were fed under, the rows of an unresolved score_batch()
        # and the tokens of an unresolved score_tree().
        self._ids: list[int] | None = None
        self._scope: str | None = None
        self._batch_rows: list[list[int]] | None = None
        self._tree_tokens: list[int] | None = None
        self._reusable: bool | None = None  # every cache layer full attention (reusable_layers)
        self.reused_tokens = 0  # prompt tokens the latest prefill() did not feed
        self._n_body: int | None = None
        norm = getattr(getattr(model, "model", None), "norm", None)
        if isinstance(norm, torch.nn.Module):
            norm.register_forward_hook(self._keep_features)
        # The rows of every cached position, in step with _ids, where prefix blocks are
        # stored: blocks keep them, so a reused prompt still gives an EAGLE head every row.
        self._log = FeatureLog() if isinstance(norm, torch.nn.Module) and self.reuse_enabled \
            else None
        # transformers 5.2x renames forward(past_key_values=) to forward(cache=).
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def load(cls, config: TargetConfig | None = None) -> HFTarget:
        """Load the model named by ``config`` (the embedded model by default)."""
        config = config or TargetConfig()
        device = config.resolved_device()
        model, tok, files = load_model_and_tokenizer(config.model, config.dtype, device)
        spill = None
        if config.prefix_spill_bytes and config.prefix_cache_bytes:
            # KV is only valid for the weights (and dtype) that computed it: a folder each,
            # named by a fingerprint of the files, not by the folder's name alone.
            folder = f"{files.name}-{folder_fingerprint(files.path)}-{config.dtype}"
            spill = KVSpill(agentspec_home() / "prefix-kv" / folder.replace("/", "_"),
                            config.prefix_spill_bytes)
        target = cls(model, tok, files.name, config.dtype, device,
                     PrefixCache(config.prefix_cache_bytes, spill=spill))
        if config.measure_costs:  # here, not inside the first request
            target.measure_cost_curves(progress=True)
        return target

    def _keep_features(self, _module: Any, _inputs: Any, output: Any) -> None:
        self._features = output if isinstance(output, torch.Tensor) else None

    # -- the Target protocol -------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of logits per position."""
        return self._vocab

    @property
    def num_cached(self) -> int:
        """Positions currently in the KV cache."""
        return 0 if self._cache is None else int(self._cache.get_seq_length())

    def _forward(self, tokens: Sequence[int], last_only: bool = False) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, n]
        self._retired = False
        with torch.inference_mode():
            kwargs = {self._cache_kw: self._cache}
            out = self.model(
                input_ids=ids, use_cache=True, logits_to_keep=1 if last_only else 0, **kwargs
            )
        if self._features is not None:
            self._log_rows(self._features[0])  # [n, H]: this forward's positions
        # Verifiers compare against drafts built on the CPU: logits come back there (a
        # no-op on CPU; on CUDA one small copy per forward).
        return out.logits[0].float().cpu()  # [n, V] (or [1, V] when last_only)

    def check_fits(self, n_tokens: int) -> None:
        """Raise :class:`PromptTooLongError` if ``n_tokens`` positions exceed the model."""
        if n_tokens > self.max_positions:
            raise PromptTooLongError(
                f"{n_tokens} tokens exceed the model's context window of "
                f"{self.max_positions} positions; shorten the prompt or lower max_tokens"
            )

    @property
    def reuse_enabled(self) -> bool:
        """Whether :meth:`prefill` reuses KV (a prefix store with a non-zero budget)."""
        return self.prefix_cache is not None and self.prefix_cache.enabled

    @property
    def reuse_keeps_features(self) -> bool:
        """Whether a reused prefix comes with its feature rows (``prefill(features=True)``):
        reuse on and a final norm to read them from."""
        return self._log is not None and self.reuse_enabled

    def _log_rows(self, rows: torch.Tensor) -> None:
        """Append the rows ``[m, H]`` of positions just kept in the cache to the log."""
        if self._log is not None and not self._measuring and self._ids is not None:
            self._log.append(rows)

    def prefill(self, tokens: Sequence[int], *, scope: str | None = None,
                cancel: threading.Event | None = None, features: bool = False) -> torch.Tensor:
        """Start a request: the cache ends up holding ``tokens``; return the last position's
        logits ``[V]``.

        Without ``scope`` (or with reuse disabled) the cache is reset and every token fed.
        With ``scope`` (the tenant), the previous request's KV is first stored under its
        own scope, then the longest prefix of ``tokens`` that the live KV (same scope) or
        the scope's stored blocks hold is reused and only the rest is fed: at least one
        token, so the logits are this request's. :attr:`reused_tokens` says how many
        were reused. With ``features`` (the request's drafter reads :meth:`last_features`)
        only a prefix whose feature rows are kept is reused (a block stored without rows
        ends it), and :meth:`last_features` then covers every position, as after a
        prefill without reuse.

        ``cancel`` is checked before every forward of the prompt: a tail fed in chunks
        after reused KV stops within one chunk (:data:`PREFILL_CHUNK` tokens) of the event
        being set. A cold prefill is one forward and cannot be interrupted; the engine
        checks again right after it. What was fed stays cached (and reusable).

        Raises:
            Cancelled: ``cancel`` was set before the prompt was fed.
        """
        self.check_fits(len(tokens))
        tokens = list(tokens)
        self._retire()
        self.reused_tokens = 0
        cache: Any = None
        if scope is not None and self.reuse_enabled and len(tokens) > 1 and self._can_reuse():
            cache = self._reuse(scope, tokens, features)
        if cache is None:
            cache = self._new_cache()
            if self._log is not None:
                self._log.reset()
        self._cache = cache
        self._scope = scope
        self._retired = False
        self._ids = tokens[: self.reused_tokens]
        self._batch_rows = self._tree_tokens = None
        self._tree_n = 0
        if not tokens:
            self._features = torch.zeros(1, 0, int(self.model.config.hidden_size))
            return torch.zeros(self._vocab)
        logits = self._feed_prompt(tokens[self.reused_tokens :], chunked=self.reused_tokens > 0,
                                   cancel=cancel)
        self._ids = tokens
        if self.reused_tokens and self._log is not None and self._log.covers(len(tokens)):
            # Every position's rows, the reused ones from where their KV came from (a copy:
            # the log's buffer is written over after a rollback).
            self._features = self._log.view(len(tokens)).clone()[None]  # [1, n, H]
        return logits

    def _feed_prompt(self, tokens: list[int], chunked: bool,
                     cancel: threading.Event | None = None) -> torch.Tensor:
        """Feed prompt ``tokens`` (after the cached ones); the last position's logits
        ``[V]``. A tail after reused KV goes in :data:`PREFILL_CHUNK`-token forwards (a
        cache-free prefill keeps one forward: it runs the causal kernel); ``cancel`` is
        checked before each."""
        step = PREFILL_CHUNK if chunked else len(tokens)
        if len(tokens) <= step:
            _check_cancel(cancel)
            return self._forward(tokens, last_only=True)[-1]
        feats = []
        for start in range(0, len(tokens), step):
            _check_cancel(cancel)
            chunk = tokens[start : start + step]
            logits = self._forward(chunk, last_only=True)[-1]
            if self._ids is not None:  # in step with the cache: a cancelled prefill's
                self._ids.extend(chunk)  # fed chunks stay reusable by a retry
            if self._features is not None:
                feats.append(self._features)
        # last_features() covers every position this prefill fed, as after one forward.
        self._features = torch.cat(feats, dim=1) if len(feats) > 1 else self._features
        return logits

    def _worth_reusing(self, reused: int, total: int) -> bool:
        """Whether reusing ``reused`` of ``total`` prompt tokens beats a cold prefill.

        A cold prefill runs the causal kernel over all ``total`` tokens: ``total**2 / 2``
        query-key pairs. After reuse the tail (``fed`` tokens) goes in chunks of ``c`` with
        masks: ``fed * reused + fed**2 / 2 + fed * c / 2`` pairs, but ``reused`` tokens
        less through the weights. Reuse wins unless the reused part is tiny against a long
        tail (e.g. a new session sharing only the first few dozen tokens of another
        session's system prompt): there the extra masked attention costs more than the
        handful of tokens saved.
        """
        fed = total - reused
        c = min(fed, PREFILL_CHUNK)
        cfg = self.model.config
        heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
        head_dim = int(getattr(cfg, "head_dim", 0) or cfg.hidden_size // heads)
        layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
        pair_flops = 4 * heads * head_dim * layers  # QK^T and AV, 2 FLOPs per MAC
        saved = 2 * self._body_params * reused + pair_flops * (reused * reused / 2)
        extra = pair_flops * fed * c / 2
        return saved >= extra

    @property
    def _body_params(self) -> int:
        """Parameters every prompt token goes through (all but the embeddings and the
        output layer, which a prefill runs for the last position only)."""
        if self._n_body is None:
            skip = {id(self.model.get_input_embeddings().weight),
                    id(self.model.get_output_embeddings().weight)}
            self._n_body = sum(p.numel() for p in self.model.parameters() if id(p) not in skip)
        return self._n_body

    def _can_reuse(self) -> bool:
        """Whether this model's cache layers can be cut and rebuilt (plain full-attention
        layers; sliding-window layers drop old positions, so they never reuse)."""
        if self._reusable is None:
            self._reusable = reusable_layers(self._new_cache())
        return self._reusable

    def _new_cache(self) -> Any:
        """An empty KV cache whose full-attention layers append in place (kv_cache.py)."""
        return new_cache(self.model.config, self.max_positions)

    def _reuse(self, scope: str, tokens: list[int], features: bool = False) -> Any:
        """A cache holding the longest reusable prefix of ``tokens`` (``None``: nothing),
        setting :attr:`reused_tokens`. The live cache is cut in place when it holds at
        least as much as the store; else the stored blocks are copied into a new cache.
        With ``features`` only a prefix whose feature rows are known is reused."""
        assert self.prefix_cache is not None
        limit = len(tokens) - 1  # feed at least one token: its logits are the answer
        live = 0
        # (Unresolved batch rows: the live cache has K rows, so only the store serves.)
        if (self._scope == scope and self._ids is not None and self._cache is not None
                and self._batch_rows is None):
            for a, b in zip(self._ids, tokens[:limit], strict=False):
                if a != b:
                    break
                live += 1
        log = self._log
        if log is not None and self._ids is not None and len(log) != len(self._ids):
            log.forget(len(self._ids))  # out of step with the cache: no row is trusted
        if features and not (log is not None and log.covers(live)):
            live = 0  # the live rows are unknown: only blocks with rows may serve
        stored = min(self.prefix_cache.match(scope, tokens, features), limit)
        if not self._worth_reusing(max(live, stored), len(tokens)):
            self.prefix_cache.record(len(tokens), 0)
            return None
        if live and live >= stored:
            drop = self.num_cached - live
            if drop:
                self._cache.crop(-drop)
            if log is not None:
                log.truncate(live)
            self.reused_tokens = live
            self.prefix_cache.record(len(tokens), live)
            return self._cache
        hit = self.prefix_cache.fetch(scope, tokens, limit, features)
        if not hit.n:
            return None
        cache = self._new_cache()
        with torch.inference_mode():
            for i, (k, v) in enumerate(hit.kv):  # full-attention layers (see _can_reuse)
                cache.update(k, v, i)
        if log is not None:  # (rows None: blocks stored without them, e.g. old files)
            log.reset(hit.features, hit.n)
        self.reused_tokens = hit.n
        return cache

    def retire(self) -> None:
        """Store the live KV of the request that just ended in the prefix store, now.

        The runtime calls it when a request ends (under the model lock, after the request's
        numbers are taken), so the copy is never part of the next request's timed prefill:
        that request may be another tenant's, and its reported ``prefill_s`` would otherwise
        tell it how much the previous tenant sent. :meth:`prefill` still retires a request
        nobody retired (direct engine use); a second call stores nothing.
        """
        self._retire()

    def _retire(self) -> None:
        """Store the live KV (the request that just ended) under its scope, when its
        token ids are known, no tree or batch rows are pending and it is not stored yet."""
        if (self._retired or self._scope is None or self._ids is None or self._cache is None
                or not self.reuse_enabled or self._tree_n or self._batch_rows is not None
                or not self._can_reuse() or len(self._ids) != self.num_cached):
            return
        assert self.prefix_cache is not None
        rows, first = (self._log.known() if self._log is not None
                       and len(self._log) == len(self._ids) else (None, 0))
        self.prefix_cache.insert(self._scope, self._ids,
                                 [(layer.keys, layer.values) for layer in self._cache.layers],
                                 features=rows, features_from=first)
        self._retired = True  # until the cache changes (every forward and cut clears it)

    def score(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` in one forward; return their logits ``[len(tokens), V]``."""
        if self._cache is None:
            raise ConfigError("score() called before prefill()")
        if not tokens:
            raise ConfigError("score() needs at least one token")
        self.check_fits(self.num_cached + len(tokens))
        with self._timed(len(tokens)):
            logits = self._forward(tokens)
        if self._ids is not None:
            self._ids.extend(tokens)
        return logits

    def score_batch(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Score K equal-length continuations of the cached prefix in one batched forward.

        For multi-draft verification (``MultiDraftDecoder``): the cache is expanded to K
        rows, row j appends ``rows[j]``. Call :meth:`select_row` before the next
        :meth:`score` to keep one row; :meth:`rollback` works on all rows meanwhile.

        Returns:
            Logits ``[K, n, V]``.
        """
        if self._cache is None:
            raise ConfigError("score_batch() called before prefill()")
        if not rows or not rows[0] or any(len(r) != len(rows[0]) for r in rows):
            raise ConfigError("score_batch() needs non-empty rows of equal length")
        self.check_fits(self.num_cached + len(rows[0]))
        self._cache.batch_repeat_interleave(len(rows))
        self._retired = False
        ids = torch.tensor([list(r) for r in rows], dtype=torch.long, device=self.device)
        with self._timed(ids.numel()), torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_kw: self._cache})
        self._batch_rows = [list(r) for r in rows]
        return out.logits.float().cpu()  # [K, n, V] (on the CPU, as _forward)

    def score_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Append a token tree to the cached prefix in one forward (tree attention).

        ``tokens[0]`` is the pending token (the root); node ``i > 0`` follows
        ``tokens[parents[i]]``. Each position attends to the cached prefix and to its own
        ancestors only, at position ``cached + depth``, so its logits equal those of the
        chain root -> ... -> node. Call :meth:`keep_tree_path` before the next forward.

        Returns:
            Logits ``[len(tokens), V]``.
        """
        if self._cache is None:
            raise ConfigError("score_tree() called before prefill()")
        n = len(tokens)
        if n == 0 or len(parents) != n or parents[0] != -1:
            raise ConfigError("score_tree() needs a root token (parent -1) and a parent per token")
        past = self.num_cached
        depth = [0] * n
        for i in range(1, n):
            if not 0 <= parents[i] < i:
                raise ConfigError(f"score_tree(): parent {parents[i]} of node {i} must come "
                                  "before it")
            depth[i] = depth[parents[i]] + 1
        self.check_fits(past + max(depth) + 1)
        # anc[i, j]: node j is node i or one of its ancestors (rows built parent first).
        anc = torch.zeros(n, n, dtype=torch.bool)  # [n, n]
        for i in range(n):
            if i:
                anc[i] = anc[parents[i]]
            anc[i, i] = True
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(1, 1, n, past + n, dtype=dtype)  # [1, 1, n, past + n], additive
        mask[0, 0, :, past:].masked_fill_(~anc, torch.finfo(dtype).min)
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, n]
        pos = torch.tensor([[past + d for d in depth]], dtype=torch.long, device=self.device)
        with self._timed(n), torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask.to(self.device),
                             position_ids=pos, use_cache=True,
                             **{self._cache_kw: self._cache})
        self._tree_n = n
        self._tree_tokens = list(tokens)
        self._retired = False
        return out.logits[0].float().cpu()  # [n, V]

    def keep_tree_path(self, path: Sequence[int]) -> None:
        """After :meth:`score_tree` of ``n`` tokens: keep the root and the nodes ``path``
        (indices into that call's tokens, root to leaf, without the root) in the cache."""
        n_tree, self._tree_n = self._tree_n, 0
        if not n_tree:
            raise ConfigError("keep_tree_path() without a score_tree() before it")
        tree, self._tree_tokens = self._tree_tokens, None
        if self._ids is not None and tree is not None:
            self._ids.extend([tree[0], *(tree[int(i)] for i in path)])
        else:
            self._ids = None
        past = self.num_cached - n_tree
        n = len(path)
        if n and list(path) != list(range(1, n + 1)):
            # Move the kept nodes' keys and values right behind the root, in place: only
            # the tree's tail is touched (copying the whole cache would cost O(context)
            # per step). index_select copies the sources first, so overlaps are safe.
            src = torch.tensor([past + int(i) for i in path], dtype=torch.long,
                               device=self.device)  # [n]
            with torch.inference_mode():  # the cache tensors are inference tensors
                for layer in self._cache.layers:
                    for kv in (layer.keys, layer.values):
                        kv[..., past + 1 : past + 1 + n, :] = kv.index_select(-2, src)
        if n_tree - 1 - n:
            self._cache.crop(-(n_tree - 1 - n))
        if self._features is not None and self._features.shape[1] == n_tree:
            local = torch.tensor([0, *(int(i) for i in path)], dtype=torch.long)
            self._features = self._features.index_select(1, local.to(self._features.device))
            self._log_rows(self._features[0])  # [n + 1, H]: the kept path (else out of step)

    def select_row(self, row: int) -> None:
        """Keep only cache row ``row`` of the last :meth:`score_batch`."""
        self._cache.batch_select_indices(torch.tensor([row], device=self.device))
        rows, self._batch_rows = self._batch_rows, None
        if self._ids is not None and rows is not None and 0 <= row < len(rows):
            self._ids.extend(rows[row])
        else:
            self._ids = None
        if self._features is not None and self._features.shape[0] > row:
            self._features = self._features[row : row + 1]
            if rows is not None and 0 <= row < len(rows):  # (after a rollback: fewer rows)
                self._log_rows(self._features[0, : len(rows[row])])

    def last_features(self) -> torch.Tensor:
        """Final-norm hidden states ``[n, H]`` (fp32, CPU) of the positions fed by the
        latest prefill/score (the kept row after :meth:`select_row`); after a prefill that
        reused KV, of every prompt position when their rows are kept (always with
        ``prefill(features=True)``).

        Raises:
            ConfigError: no forward has run, or the model has no final norm to hook.
        """
        if self._features is None:
            raise ConfigError("last_features() before any forward (or the model has no "
                              "model.norm to read hidden states from)")
        return self._features[0].float().cpu()  # [n, H]

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` cached positions (exact: later logits equal a fresh run's)."""
        if n < 0 or n > self.num_cached:
            raise ConfigError(f"rollback({n}) with {self.num_cached} cached positions")
        if n:
            # transformers >= 5.2 takes a negative count of positions to remove.
            self._cache.crop(-n)
            self._retired = False
            if self._batch_rows is not None:  # rows not yet resolved by select_row()
                if n <= len(self._batch_rows[0]):
                    self._batch_rows = [r[: len(r) - n] for r in self._batch_rows]
                else:
                    self._batch_rows, self._ids = None, None
            elif self._tree_n:  # a tree not resolved by keep_tree_path(): unknown layout
                self._ids = None
            elif self._ids is not None:
                del self._ids[len(self._ids) - n :]
                if self._log is not None:
                    self._log.truncate(len(self._ids))

    def verify_cost(self, k: int) -> float:
        """Measured seconds of one forward over ``k`` new tokens with a ~500-token cache.

        Measured once per model, dtype, device and machine, then cached as JSON under
        ``$AGENTSPEC_HOME/costs``.
        """
        if k < 1:
            raise ConfigError(f"verify_cost needs k >= 1, got {k}")
        return costs.interpolate(self.curves.base_curve(), k)

    @property
    def live_cost(self) -> LiveCost:
        """The cost of a forward on the machine as loaded now (:mod:`.live_cost`): its prior
        is the measured curves when the cost file has them (never measured here: a request
        must not wait for a measurement), else the safe prior until
        :meth:`measure_cost_curves` runs."""
        if self._live is None:
            self._live = LiveCost(threads=torch.get_num_threads())
            if self.curves.stored() is not None:
                self._live.set_prior(self._measured_cost, measured=True)
        return self._live

    def context_cost(self, k: int, context: int) -> float:
        """c(k, L) now: seconds of one forward over ``k`` new tokens on a cache of
        ``context`` positions, the measured curves (:mod:`agentspec.targets.costs`)
        corrected by the forwards timed since (:attr:`live_cost`). Never measures."""
        if k < 1 or context < 0:
            raise ConfigError(f"context_cost needs k >= 1 and context >= 0, got {k}, {context}")
        return self.live_cost.cost(k, context)

    def cost_curve(self) -> dict[int, float]:
        """The measured c(k) points (seconds), measuring them if needed."""
        return dict(self.curves.base_curve())

    def measure_cost_curves(self, progress: bool = False) -> dict[int, dict[int, float]]:
        """Measure the cost curves the cost file lacks (once per machine: seconds, with a
        progress line when ``progress``) and make them :attr:`live_cost`'s prior.
        :meth:`load` calls it (so does every runtime and server, which load through it),
        never a request."""
        curves = self.curves.ensure(progress)
        if not self.live_cost.measured:
            self.live_cost.set_prior(self._measured_cost, measured=True)
        return dict(curves)

    def _measured_cost(self, k: int, context: int) -> float:
        curves = self.curves.stored()
        assert curves is not None  # the prior is set only once they are
        return costs.at_context(curves, k, context)

    @contextlib.contextmanager
    def _timed(self, rows: int) -> Iterator[None]:
        """Run a verify forward over ``rows`` tokens with the thread count
        :attr:`live_cost` picks for it, and tell it what the forward took."""
        if self._measuring:
            yield
            return
        live, context = self.live_cost, self.num_cached
        threads = live.threads_for(rows, context) if self.device == "cpu" else live.threads
        before = torch.get_num_threads()
        if threads != before:
            torch.set_num_threads(threads)
        try:
            t0 = time.perf_counter()
            yield
            if self.device == "cuda":
                torch.cuda.synchronize()
            live.observe(rows, context, threads, time.perf_counter() - t0)
        finally:
            if threads != before:
                torch.set_num_threads(before)

    # -- cost measurement ----------------------------------------------------------------

    def _cost_key(self) -> str:
        """The cost file's name: model (name and a fingerprint of its weights, so two models
        of one name never share curves), dtype, device and machine."""

        machine = f"{platform.machine()}-{os.cpu_count()}cpu-{torch.get_num_threads()}thr"
        if self.device == "cuda":
            machine = torch.cuda.get_device_name().replace(" ", "_")
        model = f"{self.name}-{module_fingerprint(self.model)}"
        return f"{model}-{self.dtype}-{self.device}-{machine}".replace("/", "_")

    def measure_costs(self, context: int = costs.SHORT_CONTEXT,
                      repeats: int = 5, bar: Any = None) -> dict[int, float]:
        """Time one forward over k tokens on a ``context``-position cache (median of
        repeats). The cache holds random keys and values (attention costs the same
        whatever they are), so no prompt of ``context`` tokens is prefilled first."""
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self._vocab, (costs.COST_POINTS[-1],), generator=gen).tolist()
        saved = self._cache, self._ids, self._scope, self._features
        self._measuring = True
        try:
            self._cache, self._ids = self._random_cache(context, gen), None
            self.score(ids)  # warm-up
            self.rollback(len(ids))
            curve: dict[int, float] = {}
            for k in costs.COST_POINTS:
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    self.score(ids[:k])
                    if self.device == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                    self.rollback(k)
                curve[k] = sorted(times)[len(times) // 2]
                if bar is not None:
                    bar.update(1)
        finally:
            self._measuring = False
            self._cache, self._ids, self._scope, self._features = saved
        return curve

    def _random_cache(self, context: int, gen: torch.Generator) -> Any:
        """A KV cache of ``context`` positions of random keys and values (for timing): the
        layers' shapes are read from a one-token forward."""
        self._cache = self._new_cache()
        self._forward([0], last_only=True)
        shapes = [(layer.keys.shape, layer.keys.dtype) for layer in self._cache.layers]
        cache = self._new_cache()
        for i, (shape, dtype) in enumerate(shapes):
            full = (*shape[:-2], context, shape[-1])
            keys = torch.randn(full, generator=gen).to(dtype=dtype, device=self.device)
            values = torch.randn(full, generator=gen).to(dtype=dtype, device=self.device)
            cache.update(keys, values, i)
        return cache

