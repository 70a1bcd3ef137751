"""Prefix KV blocks on disk: what lets a session's prompt KV survive a restart.

The prefix store (:mod:`agentspec.targets.prefix_cache`) holds blocks in memory. With a spill
folder (``$AGENTSPEC_HOME/prefix-kv`` by default) every block it stores is also written
there, one file per block named by its chained key (which already encodes the tenant and
every token before and inside the block). A lookup that misses in memory reads the block
back, so after a restart a session's next request reuses its earlier prompts' KV and
prefills only what is new.

Every file is checksummed: ``sha256(payload) || payload``, the payload a ``torch.save`` of
the block's token ids and key/value tensors, read back with ``weights_only=True``. A file
whose checksum, tokens or format do not match is deleted and treated as a miss (the KV is
recomputed, so a corrupt file costs time, never a wrong output). The folder is bounded by
``budget_bytes``: past it the least recently used files (by modification time, refreshed on
every read) are deleted.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from agentspec.errors import ConfigError

log = logging.getLogger(__name__)

LayerKV = tuple[torch.Tensor, torch.Tensor]
_DIGEST = 32  # sha256


class KVSpill:
    """A folder of checksummed KV block files within a byte budget.

    Args:
        folder: Where block files live (created on first write).
        budget_bytes: Most bytes of block files kept (> 0).

    Raises:
        ConfigError: a budget below 1 byte.
    """

    def __init__(self, folder: str | os.PathLike[str], budget_bytes: int) -> None:
        if budget_bytes < 1:
            raise ConfigError(f"spill budget must be >= 1 byte, got {budget_bytes}")
        self.folder = Path(folder)
        self.budget_bytes = budget_bytes
        self.bytes_used = sum(f.stat().st_size for f in self._files())
        self.writes = self.reads = self.rejected = 0

    def _files(self) -> list[Path]:
        return list(self.folder.glob("*.kv")) if self.folder.is_dir() else []

    def _path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.kv"

    def __contains__(self, key: bytes) -> bool:
        return self._path(key).is_file()

    def save(self, key: bytes, tokens: Sequence[int], kv: Sequence[LayerKV]) -> None:
        """Write a block (once: an existing file is kept), then trim to the budget."""
        path = self._path(key)
        if path.is_file():
            return
        buf = io.BytesIO()
        torch.save({"tokens": list(tokens),
                    "kv": [(k.detach().cpu(), v.detach().cpu()) for k, v in kv]}, buf)
        payload = buf.getvalue()
        data = hashlib.sha256(payload).digest() + payload
        if len(data) > self.budget_bytes:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        tmp.replace(path)  # atomic: a reader never sees half a file
        self.bytes_used += len(data)
        self.writes += 1
        self._trim()

    def load(self, key: bytes, tokens: Sequence[int], device: str | torch.device
             ) -> list[LayerKV] | None:
        """The block ``key`` holding exactly ``tokens`` (``None``: absent or rejected)."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        payload = data[_DIGEST:]
        try:
            if hashlib.sha256(payload).digest() != data[:_DIGEST]:
                raise ValueError("checksum mismatch")
            block = torch.load(io.BytesIO(payload), weights_only=True)
            if list(block["tokens"]) != list(tokens):
                raise ValueError("tokens differ")
            kv = [(k.to(device), v.to(device)) for k, v in block["kv"]]
        except Exception as exc:
            log.warning("prefix KV file %s rejected (%s); recomputing", path.name, exc)
            self.rejected += 1
            self._remove(path)
            return None
        os.utime(path)  # recently used: trimmed last
        self.reads += 1
        return kv

    def _remove(self, path: Path) -> None:
        try:
            size = path.stat().st_size
            path.unlink()
            self.bytes_used -= size
        except OSError:
            pass

    def _trim(self) -> None:
        if self.bytes_used <= self.budget_bytes:
            return
        files = sorted(self._files(), key=lambda f: f.stat().st_mtime)
        for f in files:
            if self.bytes_used <= self.budget_bytes:
                break
            self._remove(f)
