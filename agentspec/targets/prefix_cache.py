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

Memory is bounded by ``budget_bytes`` (the blocks' key and value tensors): inserting past
it evicts the least recently used blocks. Lookups and inserts touch a chain leaf first, so
a chain's parents are always more recent than its children and evictions take the tails
of conversations before the system prompt they share.

With a :class:`~agentspec.targets.kv_spill.KVSpill` every stored block is also written to
disk (checksummed), and a lookup that misses in memory reads it back: a session's prefix KV
survives a restart of the process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentspec.errors import ConfigError
from agentspec.targets.kv_spill import KVSpill

#: Tokens per block: 16 is vLLM's default; a prompt reuses its longest shared prefix
#: rounded down to a block (the session's live KV covers the last partial block).
DEFAULT_BLOCK_SIZE = 16

#: Default budget of the store: 1 GiB holds ~23k tokens of SmolLM2-135M fp32 KV
#: (30 layers x 2 x 3 KV heads x 64 dims x 4 bytes = 45 KiB per token).
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [1, kv_heads, block, head_dim]


@dataclass
class _Block:
    tokens: tuple[int, ...]
    kv: list[LayerKV]
    nbytes: int


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


class PrefixCache:
    """KV blocks of token prefixes, per scope, within a byte budget (LRU).

    Args:
        budget_bytes: Most bytes of key/value tensors held; 0 stores nothing.
        block_size: Tokens per block.
        spill: Disk copies of the blocks (``None``: memory only).
        device: Where blocks read back from disk are put (the target's device).

    Raises:
        ConfigError: a negative budget or a block size below 1.
    """

    def __init__(self, budget_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
                 block_size: int = DEFAULT_BLOCK_SIZE, spill: KVSpill | None = None,
                 device: str = "cpu") -> None:
        if budget_bytes < 0:
            raise ConfigError(f"prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        if block_size < 1:
            raise ConfigError(f"prefix cache block size must be >= 1, got {block_size}")
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # LRU order: oldest first
        self.bytes_used = 0
        self.stats = PrefixCacheStats()
        self.spill = spill
        self.device = device

    @property
    def enabled(self) -> bool:
        """Whether anything can be stored (a zero budget disables the store)."""
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._blocks)

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

    def match(self, scope: str, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens``' longest stored prefix in ``scope`` (a block multiple)."""
        return len(self._chain(scope, tokens)) * self.block_size

    def _chain(self, scope: str, tokens: Sequence[int]) -> list[_Block]:
        out: list[_Block] = []
        b = self.block_size
        for i, key in enumerate(self._keys(scope, tokens)):
            block_tokens = tuple(tokens[i * b : (i + 1) * b])
            blk = self._blocks.get(key)
            if blk is None and self.enabled and self.spill is not None and key in self.spill:
                blk = self._restore(key, block_tokens)
            if blk is None or blk.tokens != block_tokens:
                break
            out.append(blk)
        return out

    def _restore(self, key: bytes, block_tokens: tuple[int, ...]) -> _Block | None:
        """Read a spilled block back into memory (``None``: unreadable or too large)."""
        assert self.spill is not None
        kv = self.spill.load(key, block_tokens, self.device)
        if kv is None:
            return None
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.budget_bytes:
            return None
        self._evict(self.budget_bytes - nbytes)
        blk = _Block(block_tokens, kv, nbytes)
        self._blocks[key] = blk
        self.bytes_used += nbytes
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
        keys = self._keys(scope, tokens)
        chain = self._chain(scope, tokens)
        n = min(len(chain) * self.block_size, max(0, limit))
        self.record(len(tokens), n)
        if n == 0:
            return 0, []
        for key in reversed(keys[: len(chain)]):  # leaf first: parents end most recent
            self._blocks.move_to_end(key)
        with torch.inference_mode():
            kv = [
                (torch.cat([blk.kv[layer][0] for blk in chain], dim=-2)[..., :n, :],
                 torch.cat([blk.kv[layer][1] for blk in chain], dim=-2)[..., :n, :])
                for layer in range(len(chain[0].kv))
            ]
        return n, kv

    def insert(self, scope: str, tokens: Sequence[int], kv: Sequence[LayerKV]) -> int:
        """Store the full blocks of ``tokens`` whose KV ``kv`` holds (per layer keys and
        values ``[1, kv_heads, >= len(tokens), head_dim]``, position i = token i).

        Blocks already stored are only touched; new ones are copied. Least recently used
        blocks are evicted to stay within the budget (a block larger than the whole budget
        is not stored).

        Returns:
            Number of blocks newly stored.
        """
        if not self.enabled or not kv:
            return 0
        b = self.block_size
        keys = self._keys(scope, tokens)
        added = 0
        with torch.inference_mode():
            for i, key in enumerate(keys):
                blk = self._blocks.get(key)
                block_tokens = tuple(tokens[i * b : (i + 1) * b])
                if blk is not None and blk.tokens == block_tokens:
                    self._blocks.move_to_end(key)  # not evicted for its own children
                    continue
                parts = [(k[..., i * b : (i + 1) * b, :].clone(),
                          v[..., i * b : (i + 1) * b, :].clone()) for k, v in kv]
                nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                             for k, v in parts)
                if nbytes > self.budget_bytes:
                    break
                if blk is not None:  # a hash collision: the newer block replaces it
                    self._drop(key)
                self._evict(self.budget_bytes - nbytes)  # never over budget, even briefly
                self._blocks[key] = _Block(block_tokens, parts, nbytes)
                self.bytes_used += nbytes
                added += 1
                if self.spill is not None:
                    self.spill.save(key, block_tokens, parts)
        for key in reversed(keys):  # leaf first: parents end most recent
            if key in self._blocks:
                self._blocks.move_to_end(key)
        self.stats.inserted_blocks += added
        return added

    def _drop(self, key: bytes) -> None:
        blk = self._blocks.pop(key)
        self.bytes_used -= blk.nbytes

    def _evict(self, limit: int) -> None:
        while self.bytes_used > limit and self._blocks:
            self._drop(next(iter(self._blocks)))
            self.stats.evicted_blocks += 1

    def clear(self) -> None:
        """Drop every block."""
        self._blocks.clear()
        self.bytes_used = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (budget, use, hit rate)."""
        s = self.stats
        return {
            "budget_bytes": self.budget_bytes,
            "bytes_used": self.bytes_used,
            "blocks": len(self._blocks),
            "block_size": self.block_size,
            "lookups": s.lookups,
            "hit_tokens": s.hit_tokens,
            "looked_up_tokens": s.looked_up_tokens,
            "hit_rate": round(s.hit_rate, 4),
            "inserted_blocks": s.inserted_blocks,
            "evicted_blocks": s.evicted_blocks,
            "restored_blocks": s.restored_blocks,
        }
