"""A tenant-scoped store of KV blocks: the prompt prefixes a target has already read.

An agent re-sends its whole conversation every turn, and every session of one agent starts
with the same system prompt and tool schemas. The target's keys and values at position i
depend only on tokens ``0..i``, so KV computed once for a token prefix is valid for every
later prompt that starts with exactly those tokens.

The store holds KV in blocks of ``block_size`` tokens, vLLM-style: a block's key is
``blake2b(parent key, block tokens)`` and the chain starts from a root key derived from the
scope (the tenant). Two prompts reach the same block only if they agree on every token
before and inside it *and* belong to one scope: a tenant never reads KV another tenant's
prompts produced (a shared prefix would otherwise show up as a faster first token, a
timing side channel). The block also keeps its token ids, so a hash collision can never
hand out wrong KV (the lookup compares the tokens).

Memory is bounded by ``budget_bytes`` (the blocks' key and value tensors), never exceeded,
not even while inserting. Every block records its scope, and each scope holding blocks has
a fair share of the budget (budget / number of such scopes). Making room evicts from the
scope furthest over its share (the scope being inserted into counts with its new block),
its least recently used block first; a scope within its share is evicted only when every
scope is (then the least recently used block overall). A tenant flooding the store evicts
its own blocks, not another tenant's system prompt. Lookups and inserts touch a chain leaf
first, so within a scope (and overall) a chain's parents are always more recent than its
children and evictions take the tails of conversations before the system prompt they share.

A chain being inserted or assembled never evicts its own blocks: an insert stops at the
first block that has no room without doing so, and so does a lookup reading blocks back
from disk (it returns the prefix it could hold).

With a :class:`~agentspec.targets.cache.kv_spill.KVSpill` every stored block is also written to
disk (signed, owner-only files; see there), and a lookup that misses in memory reads it
back: a session's prefix KV survives a restart of the process. Disk faults never reach the
caller: a failed write leaves the block in memory only, a bad file is a miss (both counted
in :meth:`PrefixCache.to_dict`: ``spill_write_errors``, ``rejected_blocks``).

Each block also carries the target's final-norm feature rows of its positions
(``[block_size, H]``, the model's dtype; see :mod:`agentspec.targets.cache.block_features`):
an EAGLE head needs a row for every prompt position, so a prompt reused for it reuses only
blocks that have them (``features=True``: the chain stops at the first block without, e.g.
one read back from a file of an older version). The rows count in the budget, and a block
stored without them gets them when the same tokens are inserted again with rows.

Where blocks live: on the target's device. An inserted block is a copy (``clone``) of the
live cache's slices, so it stays where the model's KV is (the GPU's memory when the model
runs on CUDA: a hit is a device-to-device copy into the new cache, no host round trip). The
disk spill copies a block to the CPU to write it, and a block read back goes to
:attr:`PrefixCache.device` (the target sets it to its own). The budget counts the bytes on
that device.

The default budget (``budget_bytes=None``) is sized from the memory at hand where the blocks
live (:func:`auto_budget_bytes`, :func:`default_prefix_cache_bytes`): a quarter of what is
available (``MemAvailable`` of ``/proc/meminfo`` on the CPU; free memory from
``torch.cuda.mem_get_info`` on CUDA, read once the model is loaded), within 1 GiB .. 8 GiB
and never more than half of what is available. It is sized again when the store's device is
set (the target does so when it takes the store). An explicit budget is used as given.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

import torch

from agentspec.errors import ConfigError
from agentspec.lru import LRU
from agentspec.targets.cache.kv_spill import KVSpill
from agentspec.targets.cache.memory_budget import (  # re-exported: the store's budget rule
    AUTO_PREFIX_CACHE_SHARE as AUTO_PREFIX_CACHE_SHARE,
)
from agentspec.targets.cache.memory_budget import (
    DEFAULT_PREFIX_CACHE_BYTES as DEFAULT_PREFIX_CACHE_BYTES,
)
from agentspec.targets.cache.memory_budget import (
    MAX_AUTO_PREFIX_CACHE_BYTES as MAX_AUTO_PREFIX_CACHE_BYTES,
)
from agentspec.targets.cache.memory_budget import auto_budget_bytes as auto_budget_bytes
from agentspec.targets.cache.memory_budget import available_bytes as available_bytes
from agentspec.targets.cache.prefix_blocks import LayerKV as LayerKV
from agentspec.targets.cache.prefix_blocks import PrefixCacheStats as PrefixCacheStats
from agentspec.targets.cache.prefix_blocks import PrefixHit as PrefixHit
from agentspec.targets.cache.prefix_blocks import StoredBlock, block_nbytes

#: Tokens per block: 16 is vLLM's default; a prompt reuses its longest shared prefix
#: rounded down to a block (the session's live KV covers the last partial block).
DEFAULT_BLOCK_SIZE = 16


def default_prefix_cache_bytes(device: str | torch.device = "cpu") -> int:
    """The default budget of a store whose blocks live on ``device``
    (:func:`auto_budget_bytes` of :func:`available_bytes`)."""
    return auto_budget_bytes(available_bytes(device))

class PrefixCache:
    """KV blocks of token prefixes, per scope, within a byte budget (fair share, LRU).

    Args:
        budget_bytes: Most bytes of key/value tensors and feature rows held; 0 stores
            nothing; ``None`` sizes it from the memory available on ``device``
            (:func:`default_prefix_cache_bytes`), again whenever :attr:`device` is set.
        block_size: Tokens per block.
        spill: Disk copies of the blocks (``None``: memory only).
        device: Where the blocks live: the target's device (inserted blocks are copies of
            its live KV; blocks read back from disk are put there).

    Raises:
        ConfigError: a negative budget or a block size below 1.
    """

    def __init__(self, budget_bytes: int | None = DEFAULT_PREFIX_CACHE_BYTES,
                 block_size: int = DEFAULT_BLOCK_SIZE, spill: KVSpill | None = None,
                 device: str = "cpu") -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ConfigError(f"prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        if block_size < 1:
            raise ConfigError(f"prefix cache block size must be >= 1, got {block_size}")
        self.auto_budget = budget_bytes is None
        self.budget_bytes = (default_prefix_cache_bytes(device) if budget_bytes is None
                             else budget_bytes)
        self.block_size = block_size
        # Recency order, oldest first (no bound of their own: _make_room evicts by bytes
        # with a fair share per scope).
        self._blocks: LRU[bytes, StoredBlock] = LRU()
        self._scopes: dict[str, LRU[bytes, None]] = {}  # each scope's blocks
        self._scope_bytes: dict[str, int] = {}  # only scopes holding blocks
        self.bytes_used = 0
        self.stats = PrefixCacheStats()
        self.spill = spill
        self._device = device

    @property
    def device(self) -> str:
        """Where the blocks live (the target's device); setting it re-sizes an auto-sized
        budget (``budget_bytes=None``) from the memory available there."""
        return self._device

    @device.setter
    def device(self, device: str) -> None:
        self._device = device
        if self.auto_budget:
            self.budget_bytes = default_prefix_cache_bytes(device)

    @property
    def enabled(self) -> bool:
        """Whether anything can be stored (a zero budget disables the store)."""
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._blocks)

    def scope_bytes(self, scope: str) -> int:
        """Bytes of the blocks ``scope`` holds in memory."""
        return self._scope_bytes.get(scope, 0)

    def _keys(self, scope: str, tokens: Sequence[int]) -> list[bytes]:
        """Chained keys of the full blocks of ``tokens`` (``len(tokens) // block_size``)."""
        parent = hashlib.blake2b(b"scope\0" + scope.encode(), digest_size=16).digest()
        keys = []
        b = self.block_size
        for i in range(len(tokens) // b):
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(array("q", tokens[i * b : (i + 1) * b]).tobytes())
            parent = h.digest()
            keys.append(parent)
        return keys

    def match(self, scope: str, tokens: Sequence[int], features: bool = False) -> int:
        """Tokens of ``tokens``' longest stored prefix in ``scope`` (a block multiple);
        with ``features``, of blocks that all carry feature rows."""
        return len(self._chain(scope, tokens, features)) * self.block_size

    def _chain(self, scope: str, tokens: Sequence[int],
               features: bool = False) -> list[tuple[bytes, StoredBlock]]:
        """The stored blocks of ``tokens``' longest prefix, read back from disk where they
        are only there; with ``features`` it stops at the first block without rows.
        Making room for those never evicts the chain's own blocks: the chain stops where
        it would have to."""
        out: list[tuple[bytes, StoredBlock]] = []
        own: set[bytes] = set()
        b = self.block_size
        for i, key in enumerate(self._keys(scope, tokens)):
            block_tokens = tuple(tokens[i * b : (i + 1) * b])
            blk = self._blocks.get(key)
            if blk is None and self.enabled and self.spill is not None and key in self.spill:
                blk = self._restore(scope, key, block_tokens, own)
            if blk is None or blk.tokens != block_tokens or (features and blk.features is None):
                break
            out.append((key, blk))
            own.add(key)
        return out

    def _restore(self, scope: str, key: bytes, block_tokens: tuple[int, ...],
                 own: set[bytes]) -> StoredBlock | None:
        """Read a spilled block back into memory (``None``: unreadable, or no room without
        evicting ``own``, the blocks of the chain being assembled)."""
        assert self.spill is not None
        read = self.spill.read(key, block_tokens, self.device)
        if read is None:
            return None
        kv, rows = read
        nbytes = block_nbytes(kv, rows)
        if nbytes > self.budget_bytes or not self._make_room(scope, nbytes, own):
            return None
        blk = StoredBlock(scope, block_tokens, kv, nbytes, rows)
        self._add(key, blk)
        self.stats.restored_blocks += 1
        return blk

    def record(self, looked_up: int, hit: int) -> None:
        """Count a lookup served elsewhere (the target's live KV) in :attr:`stats`."""
        self.stats.lookups += 1
        self.stats.looked_up_tokens += looked_up
        self.stats.hit_tokens += hit

    def lookup(self, scope: str, tokens: Sequence[int], limit: int) -> tuple[int, list[LayerKV]]:
        """The stored KV of ``tokens``' longest prefix in ``scope``, at most ``limit`` tokens.

        Returns:
            ``(n, kv)``: ``n`` reused tokens and per layer the keys and values of positions
            ``0..n-1`` (``[1, kv_heads, n, head_dim]``, fresh tensors); ``(0, [])`` on a miss.
        """
        hit = self.fetch(scope, tokens, limit)
        return hit.n, hit.kv

    def fetch(self, scope: str, tokens: Sequence[int], limit: int,
              features: bool = False) -> PrefixHit:
        """As :meth:`lookup`, with the blocks' feature rows: with ``features`` only blocks
        that carry rows are reused (the hit's ``features`` is then never ``None``); without,
        the rows come along when every block used has them."""
        chain = self._chain(scope, tokens, features)
        n = min(len(chain) * self.block_size, max(0, limit))
        self.record(len(tokens), n)
        if n == 0:
            return PrefixHit(0, [])
        for key, _ in reversed(chain):  # leaf first: parents end most recent
            if key in self._blocks:
                self._touch(key)
        used = [blk for _, blk in chain[: -(-n // self.block_size)]]  # blocks covering n
        with torch.inference_mode():
            kv = [
                (torch.cat([blk.kv[layer][0] for blk in used], dim=-2)[..., :n, :],
                 torch.cat([blk.kv[layer][1] for blk in used], dim=-2)[..., :n, :])
                for layer in range(len(used[0].kv))
            ]
            parts = [blk.features for blk in used if blk.features is not None]
            rows = torch.cat(parts)[:n] if len(parts) == len(used) else None  # [n, H]
        return PrefixHit(n, kv, rows)

    def insert(self, scope: str, tokens: Sequence[int], kv: Sequence[LayerKV],
               features: torch.Tensor | None = None, features_from: int = 0) -> int:
        """Store the full blocks of ``tokens`` whose KV ``kv`` holds (per layer keys and
        values ``[1, kv_heads, >= len(tokens), head_dim]``, position i = token i), with
        their rows of ``features`` (``[>= len(tokens), H]``, row i = position i; rows
        before ``features_from`` are unknown: blocks starting there go without).

        Blocks already stored are only touched (one stored without rows gets them, room
        permitting); new ones are copied (and written to the spill folder). Room is made
        by the fair-share policy (see the module docstring); the insert stops at the first
        block that has no room without evicting this chain's own blocks (or is larger than
        the whole budget).

        Returns:
            Number of blocks newly stored.
        """
        if not self.enabled or not kv:
            return 0
        b = self.block_size
        keys = self._keys(scope, tokens)
        own: set[bytes] = set()  # this chain's blocks: never evicted for its children
        added = 0
        with torch.inference_mode():
            for i, key in enumerate(keys):
                blk = self._blocks.get(key)
                block_tokens = tuple(tokens[i * b : (i + 1) * b])
                rows = (features[i * b : (i + 1) * b].clone()
                        if features is not None and i * b >= features_from else None)
                if blk is not None and blk.tokens == block_tokens:
                    own.add(key)
                    if blk.features is None and rows is not None:
                        self._add_rows(key, blk, rows, own)
                    continue
                parts = [(k[..., i * b : (i + 1) * b, :].clone(),
                          v[..., i * b : (i + 1) * b, :].clone()) for k, v in kv]
                nbytes = block_nbytes(parts, rows)
                if nbytes > self.budget_bytes:
                    break
                if blk is not None:  # a hash collision: the newer block replaces it
                    self._drop(key)
                if not self._make_room(scope, nbytes, own):  # never over budget, even briefly
                    break
                self._add(key, StoredBlock(scope, block_tokens, parts, nbytes, rows))
                own.add(key)
                added += 1
                if self.spill is not None:  # never raises on disk faults (counted there)
                    self.spill.save(key, block_tokens, parts, rows)
        for key in reversed(keys):  # leaf first: parents end most recent
            if key in self._blocks:
                self._touch(key)
        self.stats.inserted_blocks += added
        return added

    def _add_rows(self, key: bytes, blk: StoredBlock, rows: torch.Tensor, own: set[bytes]) -> None:
        """Give a KV-only block its rows (and its disk copy), if they fit without
        evicting ``own``."""
        extra = block_nbytes([], rows)
        if not self._make_room(blk.scope, extra, own):
            return
        blk.features = rows
        blk.nbytes += extra
        self._scope_bytes[blk.scope] += extra
        self.bytes_used += extra
        if self.spill is not None:  # the old file has no rows: rewritten with them
            self.spill.save(key, blk.tokens, blk.kv, rows, replace=True)

    def _add(self, key: bytes, blk: StoredBlock) -> None:
        self._blocks.put(key, blk)
        self._scopes.setdefault(blk.scope, LRU()).put(key, None)
        self._scope_bytes[blk.scope] = self._scope_bytes.get(blk.scope, 0) + blk.nbytes
        self.bytes_used += blk.nbytes

    def _touch(self, key: bytes) -> None:
        self._blocks.touch(key)
        self._scopes[self._blocks[key].scope].touch(key)

    def _drop(self, key: bytes) -> None:
        blk = self._blocks[key]
        self._blocks.pop(key)
        lru = self._scopes[blk.scope]
        lru.pop(key)
        if len(lru):
            self._scope_bytes[blk.scope] -= blk.nbytes
        else:
            del self._scopes[blk.scope], self._scope_bytes[blk.scope]
        self.bytes_used -= blk.nbytes

    def _make_room(self, scope: str, nbytes: int, own: set[bytes]) -> bool:
        """Evict until ``nbytes`` more fit for ``scope``; ``False`` (nothing more evicted)
        when only blocks of ``own`` or of scopes within their share are left to take."""
        while self.bytes_used + nbytes > self.budget_bytes:
            victim = self._victim(scope, nbytes, own)
            if victim is None:
                return False
            self._drop(victim)
            self.stats.evicted_blocks += 1
        return True

    def _victim(self, scope: str, nbytes: int, own: set[bytes]) -> bytes | None:
        """The block to evict next: the LRU block of the scope furthest over its share."""
        holders = set(self._scopes) | {scope}
        share = self.budget_bytes / len(holders)

        def held(s: str) -> int:  # the scope being inserted into counts with its new block
            return self._scope_bytes.get(s, 0) + (nbytes if s == scope else 0)

        over = sorted(((held(s) - share, s) for s in holders if held(s) > share), reverse=True)
        for _, s in over:
            key = next((k for k in self._scopes.get(s, ()) if k not in own), None)
            if key is not None:
                return key
        if over:  # only the chain's own blocks are over: it stops, nobody else pays
            return None
        return next((k for k in self._blocks if k not in own), None)

    def clear(self) -> None:
        """Drop every block (the spill folder keeps its files)."""
        self._blocks.clear()
        self._scopes.clear()
        self._scope_bytes.clear()
        self.bytes_used = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (budget, use, hit rate, disk faults)."""
        s = self.stats
        return {
            "budget_bytes": self.budget_bytes,
            "bytes_used": self.bytes_used,
            "blocks": len(self._blocks),
            "block_size": self.block_size,
            "scopes": len(self._scopes),
            "lookups": s.lookups,
            "hit_tokens": s.hit_tokens,
            "looked_up_tokens": s.looked_up_tokens,
            "hit_rate": round(s.hit_rate, 4),
            "inserted_blocks": s.inserted_blocks,
            "evicted_blocks": s.evicted_blocks,
            "restored_blocks": s.restored_blocks,
            # Disk copies: files rejected on reading (signature, tokens, layout) and writes
            # that failed (disk full, I/O errors); both cost recomputation, never an error.
            "rejected_blocks": self.spill.rejected if self.spill is not None else 0,
            "spill_write_errors": self.spill.write_errors if self.spill is not None else 0,
        }
