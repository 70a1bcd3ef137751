"""Seeded random sequences over a real PrefixCache with a real KVSpill: random tenants,
prompts sharing prefixes, budgets down to nothing, injected faults (failed writes,
corrupt, truncated, forged and deleted files, crashed writers' leftovers), clears and
restarts over one folder, two processes on it. Nothing may raise, and every lookup must
return exactly the KV inserted for those tokens, never more than its tenant stored."""

from __future__ import annotations

import errno
import hashlib
import os
import random
from pathlib import Path

import pytest
import torch

from agentspec.targets.cache.kv_spill import KVSpill
from agentspec.targets.cache.prefix_cache import PrefixCache

LAYERS, HEADS, DIM = 2, 1, 4
KEY = b"fuzz-key" * 4
SEQUENCES = 240
OPS = 30


def _kv_of(tokens: list[int], extra: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV that is a function of the token prefix: position i holds the bytes of a digest
    of ``tokens[: i + 1]`` (``extra`` further positions of noise, as a live cache holds
    the answer after the prompt)."""
    rows = []
    state = b"root"
    for t in tokens:
        state = hashlib.blake2b(state + t.to_bytes(4, "little"), digest_size=16).digest()
        rows.append(list(state))
    rows += [[255] * 16] * extra
    table = torch.tensor(rows, dtype=torch.float32).reshape(-1, LAYERS, 2, HEADS, DIM)
    # [positions, layers, (k, v), heads, dim] -> per layer [1, heads, positions, dim]
    return [(table[:, layer, 0].permute(1, 0, 2).unsqueeze(0).contiguous(),
             table[:, layer, 1].permute(1, 0, 2).unsqueeze(0).contiguous())
            for layer in range(LAYERS)]


def _bound(stored: list[list[int]], query: list[int], block: int) -> int:
    """Most tokens of ``query`` a tenant's earlier inserts can serve."""
    best = 0
    for prompt in stored:
        common = 0
        for a, b in zip(prompt, query, strict=False):
            if a != b:
                break
            common += 1
        best = max(best, common // block * block)
    return best


def _fail_writes(patch: pytest.MonkeyPatch, rng: random.Random) -> None:
    real = os.write
    kind = rng.choice([errno.ENOSPC, errno.EIO])

    def write(fd: int, data: bytes) -> int:
        real(fd, bytes(data[: len(data) // 3]))
        raise OSError(kind, os.strerror(kind))

    patch.setattr(os, "write", write)


def _damage(folder: Path, rng: random.Random) -> None:
    files = sorted(folder.glob("*.kv")) if folder.is_dir() else []
    how = rng.choice(["flip", "truncate", "delete", "garbage", "tmp", "empty"])
    if how in ("garbage", "tmp", "empty"):
        if folder.is_dir():
            name = rng.randbytes(16).hex()
            {"garbage": folder / f"{name}.kv", "tmp": folder / f"{name}.tmp999999999",
             "empty": folder / f"{name}.kv"}[how].write_bytes(
                b"" if how == "empty" else rng.randbytes(rng.randrange(1, 64)))
        return
    if not files:
        return
    path = rng.choice(files)
    data = bytearray(path.read_bytes())
    if not data:
        path.unlink()
    elif how == "flip":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[: rng.randrange(len(data))]))
    else:
        path.unlink()


def _sequence(seed: int, folder: Path) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    block = rng.choice([1, 2, 3, 4])
    block_bytes = LAYERS * 2 * HEADS * block * DIM * 4
    memory = rng.choice([0, block_bytes, 3 * block_bytes, 8 * block_bytes,
                         rng.randrange(1, 20 * block_bytes)])
    disk = rng.choice([1, 1500, 6000, 20_000, 10**6])
    scopes = [f"tenant{i}" for i in range(rng.randrange(1, 4))]
    systems = [[rng.randrange(6) for _ in range(rng.randrange(0, 10))] for _ in range(3)]
    stored: dict[str, list[list[int]]] = {s: [] for s in scopes}

    def process(key: bytes = KEY) -> PrefixCache:
        return PrefixCache(memory, block_size=block, spill=KVSpill(folder, disk, key=key))

    caches = [process() for _ in range(rng.choice([1, 1, 2]))]  # two processes, one folder
    biggest = 0  # largest block file seen (the folder may pass its budget by one)
    for _ in range(OPS):
        cache = rng.choice(caches)
        scope = rng.choice(scopes)
        prompt = rng.choice(systems) + [rng.randrange(6) for _ in range(rng.randrange(0, 14))]
        op = rng.choices(["insert", "lookup", "match", "fault", "damage", "clear", "restart"],
                         weights=[30, 30, 5, 5, 10, 3, 5])[0]
        if op in ("insert", "fault"):
            with pytest.MonkeyPatch.context() as patch:
                if op == "fault":
                    _fail_writes(patch, rng)
                cache.insert(scope, prompt, _kv_of(prompt, extra=rng.randrange(3)))
            stored[scope].append(prompt)
            assert cache.bytes_used <= memory
            if folder.is_dir():
                sizes = [f.stat().st_size for f in folder.glob("*.kv")]
                biggest = max([biggest, *sizes])
                assert sum(sizes) <= disk + biggest
            assert not [p for p in folder.glob(f"*.tmp{os.getpid()}*")]  # nothing partial
        elif op == "lookup":
            limit = rng.randrange(0, len(prompt) + 2)
            n, kv = cache.lookup(scope, prompt, limit)
            assert n <= min(limit, _bound(stored[scope], prompt, block))
            if n:
                want = _kv_of(prompt[:n])
                assert len(kv) == LAYERS
                for (k, v), (wk, wv) in zip(kv, want, strict=True):
                    assert k.shape == (1, HEADS, n, DIM)
                    assert torch.equal(k, wk) and torch.equal(v, wv)
            else:
                assert kv == []
        elif op == "match":
            assert cache.match(scope, prompt) <= _bound(stored[scope], prompt, block)
        elif op == "damage":
            _damage(folder, rng)
        elif op == "clear":
            cache.clear()
        else:  # a restart; now and then a new key (every file on disk becomes a miss)
            key = KEY if rng.random() < 0.85 else rng.randbytes(32)
            caches[caches.index(cache)] = process(key)
        summary = cache.to_dict()
        assert summary["bytes_used"] <= memory
        assert summary["rejected_blocks"] >= 0 and summary["spill_write_errors"] >= 0


def test_random_sequences_never_raise_and_never_return_wrong_kv(tmp_path: Path) -> None:
    for seed in range(SEQUENCES):
        _sequence(seed, tmp_path / f"seq{seed}")
