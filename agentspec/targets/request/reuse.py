"""Prefix reuse: which tokens the target's KV holds, and reusing them across requests.

An agent re-sends its whole conversation every turn, and every session of a tenant starts
with the same system prompt: keys and values at a position depend only on the tokens up to
it, so a prompt sharing a prefix with KV computed before needs only its tail fed.
:class:`PrefixReuse` keeps the token ids whose KV the live cache holds (every feeding and
cutting path keeps them in step; anything it cannot follow forgets them, and unknown ids are
never reused), the scope (tenant) they were fed under and, in a
:class:`~agentspec.targets.cache.block_features.FeatureLog`, their final-norm rows. When the next
request comes, the finished request's KV goes to the scope's blocks in the prefix store
(:mod:`agentspec.targets.cache.prefix_cache`) with those rows, and the new prompt starts from its
longest prefix shared with the live KV (same scope) or the stored blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from agentspec.models import ModelFiles, agentspec_home
from agentspec.targets.base.fingerprint import folder_fingerprint
from agentspec.targets.cache.block_features import FeatureLog
from agentspec.targets.cache.kv_spill import KVSpill
from agentspec.targets.cache.prefix_cache import PrefixCache
from agentspec.targets.forward.kv import ModelKV


def prefix_store(files: ModelFiles, dtype: str, budget_bytes: int | None,
                 spill_bytes: int) -> PrefixCache:
    """The prefix store of a model loaded from ``files``: ``budget_bytes`` in memory
    (``None``: sized from the memory available on the target's device, which
    :class:`PrefixReuse` sets) and, with ``spill_bytes``, disk copies under
    ``$AGENTSPEC_HOME/prefix-kv/<folder>``. KV is only valid for the weights (and dtype)
    that computed it: a folder each, named by a fingerprint of the files, not by the
    folder's name alone."""
    spill = None
    if spill_bytes and budget_bytes != 0:
        folder = f"{files.name}-{folder_fingerprint(files.path)}-{dtype}"
        spill = KVSpill(agentspec_home() / "prefix-kv" / folder.replace("/", "_"),
                        spill_bytes)
    return PrefixCache(budget_bytes, spill=spill)


class PrefixReuse:
    """The token ids the live KV holds, and its reuse through the prefix store.

    Args:
        kv: The model and its cache.
        store: The prefix store (``None`` or a zero budget: nothing is reused).

    Attributes:
        store: The prefix store (the target's ``prefix_cache``).
        ids: The token ids whose KV the cache holds, in order (``None``: unknown).
        scope: The scope (tenant) they were fed under.
        reused_tokens: Prompt tokens the latest :meth:`start` did not need fed.
        log: The rows of every cached position, in step with :attr:`ids` (``None``: reuse
            was off when the target was made, or the model has no final norm).
    """

    def __init__(self, kv: ModelKV, store: PrefixCache | None) -> None:
        self.kv = kv
        self.store = store
        if store is not None:
            # Blocks live on the model's device (read back from disk there too); an
            # auto-sized budget is sized from the memory free there now, the model loaded.
            store.device = kv.device
        self.ids: list[int] | None = None
        self.scope: str | None = None
        self.reused_tokens = 0
        # Blocks keep the rows with their KV, so a reused prompt still gives an EAGLE head
        # every row.
        self.log = FeatureLog() if kv.hooked and self.enabled else None
        self._stored: int | None = None  # kv.version when the live KV was last stored

    @property
    def enabled(self) -> bool:
        """Whether prefills reuse KV (a prefix store with a non-zero budget)."""
        return self.store is not None and self.store.enabled

    @property
    def keeps_features(self) -> bool:
        """Whether a reused prefix comes with its feature rows."""
        return self.log is not None and self.enabled

    # -- keeping the ids in step with the cache --------------------------------------------

    def fed(self, tokens: Sequence[int]) -> None:
        """``tokens`` were appended to the cache (unknown ids stay unknown)."""
        if self.ids is not None:
            self.ids.extend(tokens)

    def forget(self) -> None:
        """The cache's layout can no longer be followed: its ids are unknown."""
        self.ids = None

    def dropped(self, n: int) -> None:
        """The last ``n`` positions were cut from the cache's one row."""
        if self.ids is not None:
            del self.ids[len(self.ids) - n :]
            if self.log is not None:
                self.log.truncate(len(self.ids))

    def log_rows(self, rows: torch.Tensor) -> None:
        """Append the rows ``[m, H]`` of positions just kept in the cache to the log."""
        if self.log is not None and self.ids is not None:
            self.log.append(rows)

    # -- a request starts, a request ends --------------------------------------------------

    def start(self, tokens: list[int], scope: str | None, features: bool, live_ok: bool,
              chunk: int) -> Any:
        """The cache a prefill of ``tokens`` continues: the longest reusable prefix (setting
        :attr:`reused_tokens`), else an empty one; :attr:`ids` then says which prefix.

        Args:
            tokens: The prompt.
            scope: The tenant (``None``: no reuse).
            features: Reuse only a prefix whose feature rows are known.
            live_ok: Whether the live cache is one row (no unresolved batch rows).
            chunk: Tokens per forward the tail will be fed in (the reuse is priced by it).
        """
        self.reused_tokens = 0
        cache: Any = None
        if scope is not None and self.enabled and len(tokens) > 1 and self.kv.reusable():
            cache = self._reuse(scope, tokens, features, live_ok, chunk)
        if cache is None:
            cache = self.kv.new_cache()
            if self.log is not None:
                self.log.reset()
        self.scope = scope
        self._stored = None
        self.ids = tokens[: self.reused_tokens]
        return cache

    def _reuse(self, scope: str, tokens: list[int], features: bool, live_ok: bool,
               chunk: int) -> Any:
        """A cache holding the longest reusable prefix of ``tokens`` (``None``: nothing),
        setting :attr:`reused_tokens`. The live cache is cut in place when it holds at
        least as much as the store; else the stored blocks are copied into a new cache.
        With ``features`` only a prefix whose feature rows are known is reused."""
        assert self.store is not None
        limit = len(tokens) - 1  # feed at least one token: its logits are the answer
        live = 0
        # (Unresolved batch rows: the live cache has K rows, so only the store serves.)
        if self.scope == scope and self.ids is not None and self.kv.cache is not None \
                and live_ok:
            for a, b in zip(self.ids, tokens[:limit], strict=False):
                if a != b:
                    break
                live += 1
        log = self.log
        if log is not None and self.ids is not None and len(log) != len(self.ids):
            log.forget(len(self.ids))  # out of step with the cache: no row is trusted
        if features and not (log is not None and log.covers(live)):
            live = 0  # the live rows are unknown: only blocks with rows may serve
        stored = min(self.store.match(scope, tokens, features), limit)
        if not self._worth(max(live, stored), len(tokens), chunk):
            self.store.record(len(tokens), 0)
            return None
        if live and live >= stored:
            drop = self.kv.num_cached - live
            if drop:
                self.kv.crop(drop)
            if log is not None:
                log.truncate(live)
            self.reused_tokens = live
            self.store.record(len(tokens), live)
            return self.kv.cache
        hit = self.store.fetch(scope, tokens, limit, features)
        if not hit.n:
            return None
        cache = self.kv.cache_from(hit.kv)  # full-attention layers (see ModelKV.reusable)
        if log is not None:  # (rows None: blocks stored without them, e.g. old files)
            log.reset(hit.features, hit.n)
        self.reused_tokens = hit.n
        return cache

    def _worth(self, reused: int, total: int, chunk: int) -> bool:
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
        c = min(fed, chunk)
        cfg = self.kv.model.config
        heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
        head_dim = int(getattr(cfg, "head_dim", 0) or cfg.hidden_size // heads)
        layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
        pair_flops = 4 * heads * head_dim * layers  # QK^T and AV, 2 FLOPs per MAC
        saved = 2 * self.kv.body_params * reused + pair_flops * (reused * reused / 2)
        extra = pair_flops * fed * c / 2
        return saved >= extra

    def retire(self, pending: bool) -> None:
        """Store the live KV (the request that just ended) under its scope, when its token
        ids are known, nothing is ``pending`` (an unresolved tree or batch) and it is not
        stored as it stands yet (any forward or cut since makes it new again)."""
        kv = self.kv
        if (self._stored == kv.version or self.scope is None or self.ids is None
                or kv.cache is None or not self.enabled or pending or not kv.reusable()
                or len(self.ids) != kv.num_cached):
            return
        assert self.store is not None
        rows, first = (self.log.known() if self.log is not None
                       and len(self.log) == len(self.ids) else (None, 0))
        self.store.insert(self.scope, self.ids, kv.layers(), features=rows,
                          features_from=first)
        self._stored = kv.version
