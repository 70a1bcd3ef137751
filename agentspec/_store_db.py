"""The SQLite file under :class:`agentspec.store.SessionStore`.

This layer holds the file's schema (the sessions tables below) but none of the session
logic: it opens the file (WAL mode, schema, an optional
``PRAGMA quick_check``), runs callables in ``BEGIN IMMEDIATE`` transactions, retries while
other processes hold the write lock, turns SQLite's CORRUPT/NOTADB errors into
:class:`StoreCorruptError`, and, in recover mode, moves a damaged file aside and starts an
empty one. :mod:`agentspec.store` holds the session logic on top of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from agentspec.errors import ConfigError, StoreBusyError, StoreCorruptError, StoreError

log = logging.getLogger("agentspec.store")

T = TypeVar("T")
APP_ID = 0x41475350  # "AGSP" in the SQLite header: tells our files from foreign databases
SCHEMA = 1
SYNC_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")
_CORRUPT_CODES = (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB
_BUSY_CODES = (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED
_DDL = (
    "CREATE TABLE IF NOT EXISTS sessions (id INTEGER PRIMARY KEY, tenant TEXT NOT NULL,"
    " agent TEXT NOT NULL, session_id TEXT NOT NULL, turns INTEGER NOT NULL,"
    " tokens INTEGER NOT NULL, created REAL NOT NULL, last_used REAL NOT NULL,"
    " UNIQUE (tenant, agent, session_id))",
    "CREATE INDEX IF NOT EXISTS sessions_lru ON sessions (last_used, id)",
    # One row per turn: int32 little-endian token ids in ``data``, ``crc`` = crc32(data).
    "CREATE TABLE IF NOT EXISTS turns (session INTEGER NOT NULL, idx INTEGER NOT NULL,"
    " n INTEGER NOT NULL, crc INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (session, idx))",
)


class StoreDB:
    """A session-store SQLite file shared by threads (one lock) and processes (WAL).

    Args:
        path: The SQLite file (created with its folder if missing).
        busy_timeout_s: How long to wait for other writers before :class:`StoreBusyError`.
        synchronous: SQLite ``synchronous`` mode (``NORMAL`` survives SIGKILL in WAL mode).
        verify_on_open: Run ``PRAGMA quick_check`` when opening.
        recover: Move a damaged file aside and start empty instead of raising.

    Attributes:
        recovered: True once a damaged file was moved aside.
        recovered_to: Where the damaged file went.
    """

    def __init__(
        self,
        path: Path,
        busy_timeout_s: float = 10.0,
        synchronous: str = "NORMAL",
        verify_on_open: bool = True,
        recover: bool = False,
    ) -> None:
        if synchronous.upper() not in SYNC_MODES:  # it is formatted into a PRAGMA: check it
            raise ConfigError(f"synchronous must be one of {SYNC_MODES}, got {synchronous!r}")
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self.synchronous = synchronous.upper()
        self.verify_on_open = verify_on_open
        self.recover = recover
        self.recovered = False
        self.recovered_to: Path | None = None
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()
        if path.is_dir():
            raise ConfigError(f"session store path {path} is a folder, not a file")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = self._connect()
        except StoreCorruptError as exc:
            self._quarantine(exc)  # re-raises unless in recover mode
            self._conn = self._connect()

    def run(self, fn: Callable[[sqlite3.Connection], T], txn: bool = True) -> T:
        """Run ``fn(conn)`` under the lock, in a write transaction unless ``txn`` is False.

        An exception inside ``fn`` rolls the transaction back, so nothing of it is written.

        Raises:
            StoreCorruptError: The file is damaged (never in recover mode: it starts over).
            StoreBusyError: Other writers held the lock past the busy timeout.
            StoreError: Any other SQLite failure (disk full, permissions, closed store).
        """

        def attempt() -> T:
            conn = self._conn
            assert conn is not None
            if not txn:
                return fn(conn)
            conn.execute("BEGIN IMMEDIATE")  # take the write lock now: no upgrade dead-lock
            try:
                out = fn(conn)
                conn.execute("COMMIT")
                return out
            except BaseException:
                with contextlib.suppress(sqlite3.Error):  # also when nothing is left to undo
                    conn.execute("ROLLBACK")
                raise

        with self._lock:
            if self._conn is None:
                raise StoreError(f"session store {self.path} is closed")
            if self._pid != os.getpid():  # inherited through fork(): never share a connection
                self._conn = self._connect()
            try:
                return self._retry(attempt)
            except StoreCorruptError as exc:
                self._quarantine(exc)  # re-raises unless in recover mode
                self._conn = self._connect()
                return self._retry(attempt)

    def close(self) -> None:
        """Close the connection (the last one to close checkpoints the WAL into the file)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def file_bytes(self) -> int:
        """Bytes on disk: the file plus its write-ahead log."""
        files = (self.path, Path(f"{self.path}-wal"))
        return sum(p.stat().st_size for p in files if p.exists())

    # -- internals ---------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves; threads share
        # the connection under self._lock, hence check_same_thread=False.
        conn = sqlite3.connect(
            self.path, self.busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        try:
            self._retry(lambda: self._init(conn))
        except BaseException:
            conn.close()
            raise
        self._pid = os.getpid()
        return conn

    def _init(self, conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA journal_mode=WAL")  # garbage in the header fails right here
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        if self.verify_on_open:  # finds truncation and damaged b-tree pages
            problems = [r[0] for r in conn.execute("PRAGMA quick_check(5)")]
            if problems != ["ok"]:
                raise StoreCorruptError(self._corrupt_msg("; ".join(problems)))
        app = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]
        if app != APP_ID and tables:
            raise ConfigError(
                f"{self.path} is an SQLite database but not an agentspec session store; "
                "point the store at another file"
            )
        if version > SCHEMA:
            raise ConfigError(
                f"{self.path} has session-store schema {version}, newer than this agentspec "
                f"understands ({SCHEMA}); upgrade agentspec"
            )
        if app != APP_ID:
            conn.execute("BEGIN IMMEDIATE")  # IF NOT EXISTS: concurrent creators are harmless
            for stmt in _DDL:
                conn.execute(stmt)
            conn.execute(f"PRAGMA application_id={APP_ID}")
            conn.execute(f"PRAGMA user_version={SCHEMA}")
            conn.execute("COMMIT")

    def _corrupt_msg(self, detail: str) -> str:
        return (
            f"session store {self.path} is corrupt ({detail}). Move or delete the file to start "
            "an empty store, or open it in recover mode (SessionStore.open_or_recover, "
            "`agentspec sessions --recover ...`), which moves it to "
            f"{self.path.name}.corrupt-<timestamp> and starts empty"
        )

    def _quarantine(self, exc: Exception) -> None:
        """Move the damaged file and its WAL/SHM aside (recover mode) or re-raise ``exc``."""
        if not self.recover:
            raise exc
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target, n = self.path.with_name(f"{self.path.name}.corrupt-{stamp}"), 1
        while target.exists():
            target, n = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}"), n + 1
        os.replace(self.path, target)
        # A stale WAL next to a fresh file would be replayed into it: move it along too.
        for suffix in ("-wal", "-shm"):
            side = Path(f"{self.path}{suffix}")
            if side.exists():
                os.replace(side, Path(f"{target}{suffix}"))
        self.recovered, self.recovered_to = True, target
        log.warning("%s; recovered: moved it to %s and started an empty store", exc, target)

    def _retry(self, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying while other writers hold the lock; map SQLite errors."""
        deadline, delay = time.monotonic() + self.busy_timeout_s, 0.005
        while True:
            try:
                return fn()
            except sqlite3.DatabaseError as exc:
                code, text = (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF, str(exc)
                if code in _CORRUPT_CODES or "malformed" in text or "not a database" in text:
                    raise StoreCorruptError(self._corrupt_msg(text)) from exc
                if code not in _BUSY_CODES and "locked" not in text:
                    raise StoreError(f"session store {self.path}: {text}") from exc
                if time.monotonic() >= deadline:
                    raise StoreBusyError(
                        f"session store {self.path} stayed locked by other writers for "
                        f"{self.busy_timeout_s:g} s; raise StoreConfig.busy_timeout_s"
                    ) from exc
                # SQLite's busy handler already waited; back off with jitter so that
                # writers retrying together do not collide again.
                time.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, 0.2)
