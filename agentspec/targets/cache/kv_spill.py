"""Prefix KV blocks on disk: what lets a session's prompt KV survive a restart.

The prefix store (:mod:`agentspec.targets.cache.prefix_cache`) holds blocks in memory. With a spill
folder (``$AGENTSPEC_HOME/prefix-kv/<model>-<fingerprint>-<dtype>`` by default, see
:mod:`agentspec.targets.base.fingerprint`) every block it stores is also written there, one file
per block named by its chained key (which encodes the tenant and every token up to the
block's end). A lookup that misses in memory reads the block back, so after a restart a
session's next request reuses its earlier prompts' KV and prefills only what is new.

**Only the owner reads them, only the owner's writes are accepted.** KV tells what a tenant
sent: the folder (and every parent agentspec creates) is made 0700 and each file 0600,
whatever the umask. A file is ``MAGIC || HMAC-SHA256(key, MAGIC || block key || payload) ||
payload``, the payload a ``torch.save`` of the token ids, key/value tensors and the
block's feature rows (``[block, H]``; files of older versions have none), unpickled
(``weights_only=True``) only after the MAC matched; a plain checksum would not do, anyone
able to write a file can recompute it. The key, 32 random bytes, is
``$AGENTSPEC_HOME/keys/kv-hmac.key``: made 0600 on first use (a temporary file linked into
place, so nobody reads half a key; when another process links first, its key is used). A
key file others may read or write, another user owns, or of the wrong length is not
trusted and is replaced by a fresh key (files signed with the old one become misses);
where no key file can be kept, the process signs with a key of its own.

**A bad file costs time, never a wrong output or an error.** A file whose format (files of
older versions: a plain sha256), MAC, tokens or tensor layout (layers, shapes with one
position per token, dtypes: as the first block this object wrote or read; feature rows, if
any: ``[tokens, H]`` in the keys' dtype, ``H`` as in the first rows seen) do not match is
deleted and counted in :attr:`KVSpill.rejected`; the KV is recomputed. A failed write
(disk full, I/O error, no folder) is counted in :attr:`KVSpill.write_errors`, logged once
per kind every few minutes, and its partial file removed; the block stays in memory.
Temporary files of crashed writers (pid gone, or older than :data:`STALE_TMP_S`) are
deleted when a :class:`KVSpill` is made.

**Processes may share a folder.** After every write the ``*.kv`` sizes are recounted (a
listing; sizes of names seen before are remembered), so every process's files count
against ``budget_bytes``; past it the least recently used files (modification time,
refreshed on reads) are deleted down to 15/16 of it, so the full scan of times runs once
per 1/16 of the budget written. :attr:`KVSpill.bytes_used` is an estimate corrected at
each write; a file another process deletes between a listing and a ``stat``, ``utime`` or
``unlink`` is skipped.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import io
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from agentspec.errors import ConfigError
from agentspec.models import agentspec_home, private_dir
from agentspec.targets.cache.block_features import check_feature_rows

log = logging.getLogger(__name__)

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [1, kv_heads, block, head_dim]
#: Per layer (key shape, value shape, key dtype, value dtype), the block axis left out.
Layout = tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.dtype], ...]
#: A block as read back: its KV and its feature rows ``[block, H]`` (``None``: none stored).
SpilledBlock = tuple[list[LayerKV], torch.Tensor | None]

_MAGIC = b"agentspec-kv-v2\n"  # files of the plain-sha256 format lack it
_MAC = 32  # HMAC-SHA256
KEY_BYTES = 32
#: A temporary file older than this is a crashed write whatever its pid says (pids are
#: reused, and a write takes milliseconds).
STALE_TMP_S = 600.0
WARN_EVERY_S = 300.0  # one warning per kind of failure this often, at most
_TMP_PID = re.compile(r"\.tmp(\d+)")


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new 0600 file (``O_EXCL``: never through someone's link)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            if not n:  # a regular file takes nothing only when the disk is full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            view = view[n:]
    finally:
        os.close(fd)


def _read_key(path: Path) -> bytes | None:
    """The key in ``path``; ``None`` when absent, ``b""`` when it is not to be trusted."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink: someone else chose the key
            return b""
        raise
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
                or st.st_mode & 0o077 or st.st_size != KEY_BYTES):
            return b""
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    return data if len(data) == KEY_BYTES else b""


def _install_key(path: Path, replace: bool) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{secrets.token_hex(4)}")
    _write_private(tmp, secrets.token_bytes(KEY_BYTES))
    try:
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if another process made one first: theirs is used
    except FileExistsError:
        pass
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def hmac_key(home: Path | None = None) -> bytes:
    """The key block files are signed with: ``<home>/keys/kv-hmac.key``, made on first use.

    Args:
        home: The agentspec home (``$AGENTSPEC_HOME`` by default).

    Returns:
        32 bytes; a key of this process only when no key file can be kept (logged).
    """
    path = (home or agentspec_home()) / "keys" / "kv-hmac.key"
    try:
        private_dir(path.parent, tighten=True)
        key = _read_key(path)
        if key is None:
            _install_key(path, replace=False)
            key = _read_key(path)
        if not key:
            log.warning("%s is readable or writable by others, not owned by this user or of "
                        "the wrong length: replaced by a new key (prefix KV files signed "
                        "with the old one are recomputed)", path)
            _install_key(path, replace=True)
            key = _read_key(path)
        if key:
            return key
        raise OSError(errno.EIO, "the key file cannot be read back", str(path))
    except OSError as exc:
        log.warning("no prefix KV key file at %s (%s): this process signs with a key of "
                    "its own, so its disk copies do not outlive it", path, exc)
        return secrets.token_bytes(KEY_BYTES)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only checks
    except PermissionError:  # another user's process
        return True
    except (OSError, OverflowError):  # ProcessLookupError: no such process
        return False
    return True


class KVSpill:
    """A folder of signed KV block files within a byte budget.

    Args:
        folder: Where block files live (created 0700 on first write).
        budget_bytes: Most bytes of block files kept (> 0).
        key: The HMAC key (at least 16 bytes); ``None``: the home's key file
            (:func:`hmac_key`).

    Raises:
        ConfigError: a budget below 1 byte or a key shorter than 16 bytes.
    """

    def __init__(self, folder: str | os.PathLike[str], budget_bytes: int,
                 key: bytes | None = None) -> None:
        if budget_bytes < 1:
            raise ConfigError(f"spill budget must be >= 1 byte, got {budget_bytes}")
        if key is not None and len(key) < 16:
            raise ConfigError(f"spill key must be >= 16 bytes, got {len(key)}")
        self.folder = Path(folder)
        self.budget_bytes = budget_bytes
        self._key = hmac_key() if key is None else bytes(key)
        self.writes = self.reads = self.rejected = self.write_errors = 0
        #: What every block must look like (set by the first block written or read).
        self.layout: Layout | None = None
        self.feature_width: int | None = None  # H of the feature rows (first rows seen)
        # *.kv file name -> bytes (a file changes only when its block gains feature rows:
        # another process keeps counting the size it saw first, a few KiB short)
        self._sizes: dict[str, int] = {}
        self._warned: dict[str, float] = {}  # kind of failure -> when last logged
        self._dir_ok = False  # the folder was made (or checked) by this object
        self.bytes_used = 0
        self._remove_stale()
        self._recount()

    def _path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.kv"

    def __contains__(self, key: bytes) -> bool:
        return self._path(key).is_file()

    def _names(self) -> list[str]:
        with contextlib.suppress(OSError):  # not made yet, not a folder, unreadable
            return os.listdir(self.folder)
        return []

    def _recount(self) -> None:
        """Set :attr:`bytes_used` to the folder's ``*.kv`` bytes (every process's files)."""
        sizes: dict[str, int] = {}
        for name in self._names():
            if not name.endswith(".kv"):
                continue
            size = self._sizes.get(name)
            if size is None:
                try:
                    size = os.stat(self.folder / name).st_size
                except OSError:  # deleted since the listing (another process trimmed it)
                    continue
            sizes[name] = size
        self._sizes = sizes
        self.bytes_used = sum(sizes.values())

    def _remove_stale(self) -> None:
        now = time.time()
        for name in self._names():
            match = _TMP_PID.search(name)
            if match is None or name.endswith(".kv"):
                continue
            path, pid = self.folder / name, int(match[1])
            with contextlib.suppress(OSError):  # (another process removed it first)
                if now - path.stat().st_mtime > STALE_TMP_S or not (pid > 0 and _pid_alive(pid)):
                    path.unlink()

    def _warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        last = self._warned.get(kind)
        if last is None or now - last >= WARN_EVERY_S:
            self._warned[kind] = now
            log.warning(message + " (further ones logged every %.0f s at most)",
                        *args, WARN_EVERY_S)
        else:
            log.debug(message, *args)

    def _mac(self, key: bytes, payload: bytes) -> bytes:
        h = hmac.new(self._key, _MAGIC, hashlib.sha256)
        h.update(key)  # a file renamed to another block's name does not verify
        h.update(payload)
        return h.digest()

    def save(self, key: bytes, tokens: Sequence[int], kv: Sequence[LayerKV],
             features: torch.Tensor | None = None, replace: bool = False) -> None:
        """Write a block with its feature rows ``[len(tokens), H]`` (if any), then trim to
        the budget. Once: an existing file is kept, unless ``replace`` (a block stored
        without rows that now has them).

        Never raises ``OSError``: a failed write is counted in :attr:`write_errors`.
        """
        path = self._path(key)
        if path.is_file() and not replace:
            return
        block: dict[str, object] = {
            "tokens": list(tokens), "kv": [(k.detach().cpu(), v.detach().cpu()) for k, v in kv]}
        if features is not None:  # a key older versions ignore: their reads still work
            block["features"] = features.detach().cpu()
            self.feature_width = self.feature_width or int(features.shape[-1])
        buf = io.BytesIO()
        torch.save(block, buf)
        payload = buf.getvalue()
        data = _MAGIC + self._mac(key, payload) + payload
        if self.layout is None:  # this model's blocks look like this one
            self.layout = _layout(kv)
        if len(data) > self.budget_bytes:
            return
        tmp = self.folder / f"{key.hex()}.tmp{os.getpid()}-{secrets.token_hex(4)}"
        try:
            if not self._dir_ok:
                private_dir(self.folder, tighten=True)
                self._dir_ok = True
            _write_private(tmp, data)
            os.replace(tmp, path)  # atomic: a reader never sees half a file
        except OSError as exc:
            self.write_errors += 1
            self._dir_ok = False  # the folder may have gone: made again next time
            kind = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
            self._warn(kind, "prefix KV block not written to %s (%s: %s); kept in memory "
                       "only", self.folder, kind, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return
        self._sizes[path.name] = len(data)
        self.writes += 1
        self._trim()

    def load(self, key: bytes, tokens: Sequence[int], device: str | torch.device
             ) -> list[LayerKV] | None:
        """The KV of block ``key`` holding exactly ``tokens`` (``None``: absent or rejected)."""
        block = self.read(key, tokens, device)
        return None if block is None else block[0]

    def read(self, key: bytes, tokens: Sequence[int], device: str | torch.device
             ) -> SpilledBlock | None:
        """The block ``key`` holding exactly ``tokens``: its KV and feature rows (``None``
        for a file without them); ``None``: absent or rejected."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._warn("read", "prefix KV file %s unreadable (%s)", path.name, exc)
            return None
        start = len(_MAGIC) + _MAC
        try:
            if not data.startswith(_MAGIC):
                raise ValueError("not this format (an older version's file?)")
            if not hmac.compare_digest(data[len(_MAGIC):start], self._mac(key, data[start:])):
                raise ValueError("signature mismatch")
            block = torch.load(io.BytesIO(data[start:]), weights_only=True)
            if list(block["tokens"]) != list(tokens):
                raise ValueError("tokens differ")
            cpu_kv = [(k, v) for k, v in block["kv"]]
            layout = self._check(cpu_kv, len(tokens))
            rows = check_feature_rows(block.get("features"), cpu_kv[0][0].dtype, len(tokens),
                              self.feature_width)
        except Exception as exc:
            self.rejected += 1
            self._warn("rejected", "prefix KV file %s rejected (%s); recomputing",
                       path.name, exc)
            self._remove(path.name)
            return None
        try:
            kv = [(k.to(device), v.to(device)) for k, v in cpu_kv]
            rows = None if rows is None else rows.to(device)
        except (RuntimeError, MemoryError) as exc:  # no room on the device: a miss
            self._warn("device", "prefix KV block not restored (%s)", exc)
            return None
        # Recently used: trimmed last (deleted meanwhile by another process: still valid).
        with contextlib.suppress(OSError):
            os.utime(path)
        self.layout = layout
        if rows is not None:
            self.feature_width = int(rows.shape[1])
        self.reads += 1
        return kv, rows

    def _check(self, kv: list[LayerKV], n: int) -> Layout:
        """The block's layout; ``ValueError`` unless it is ``n`` positions of 4-d tensors
        laid out like every block before it."""
        if not kv:
            raise ValueError("no layers")
        for k, v in kv:
            if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
                raise ValueError("not tensors")
            if k.dim() != 4 or v.dim() != 4 or k.shape[-2] != n or v.shape[-2] != n:
                raise ValueError(f"shapes {tuple(k.shape)}, {tuple(v.shape)} for {n} tokens")
        layout = _layout(kv)
        if self.layout is not None and layout != self.layout:
            raise ValueError("layers, shapes or dtypes differ from this model's blocks")
        return layout

    def _remove(self, name: str) -> None:
        self.bytes_used -= self._sizes.pop(name, 0)
        with contextlib.suppress(OSError):  # gone already (another process)
            (self.folder / name).unlink()

    def _trim(self) -> None:
        self._recount()
        if self.bytes_used <= self.budget_bytes:
            return
        aged = []
        for name in list(self._sizes):
            try:
                aged.append((os.stat(self.folder / name).st_mtime_ns, name))
            except OSError:  # deleted since the recount
                self.bytes_used -= self._sizes.pop(name)
        low = self.budget_bytes - self.budget_bytes // 16
        for _, name in sorted(aged):
            if self.bytes_used <= low:
                break
            self._remove(name)


def _layout(kv: Sequence[LayerKV]) -> Layout:
    return tuple((tuple(k.shape[:-2]) + tuple(k.shape[-1:]),
                  tuple(v.shape[:-2]) + tuple(v.shape[-1:]), k.dtype, v.dtype)
                 for k, v in kv)
