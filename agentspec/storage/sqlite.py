"""The one SQLite layer of agentspec: the session store and the regret ledger both use it.

This layer knows nothing about sessions or regret: it opens the file (WAL mode, the
caller's schema, an optional ``PRAGMA quick_check``), runs callables in ``BEGIN IMMEDIATE``
transactions, retries while other processes hold the write lock, turns SQLite's
CORRUPT/NOTADB errors into :class:`StoreCorruptError`, and, in recover mode, moves a damaged
file aside and starts an empty one (:meth:`SQLiteFile.open` is the one "open or recover"
path). It also checkpoints the write-ahead log into the main file on :meth:`close` (so a
copy of the file alone holds every committed transaction) and takes consistent copies of a
live file with SQLite's online backup API (:meth:`SQLiteFile.backup`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from agentspec.errors import ConfigError, StoreBusyError, StoreCorruptError, StoreError
from agentspec.models import private_dir

log = logging.getLogger("agentspec.storage.sessions")

T = TypeVar("T")
SYNC_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")
MEMORY = ":memory:"
_CORRUPT_CODES = (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB
_BUSY_CODES = (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED


@dataclass(frozen=True)
class Schema:
    """What a kind of agentspec database holds and how it is recognised.

    Attributes:
        kind: Words for messages, e.g. ``"session store"``.
        app_id: ``PRAGMA application_id`` written into the header: tells our files from
            foreign databases at the same path.
        version: ``PRAGMA user_version``; a newer file than the code is refused.
        ddl: ``CREATE ... IF NOT EXISTS`` statements run when the file is new.
        legacy_tables: A file without our application id is adopted (stamped) when its
            tables are all among these: files written before the id existed.
        recover_hint: How a user recovers a corrupt file (CLI flag or API).
    """

    kind: str
    app_id: int
    version: int
    ddl: Sequence[str]
    legacy_tables: frozenset[str] = frozenset()
    recover_hint: str = "open it in recover mode"


class SQLiteFile:
    """An agentspec SQLite file shared by threads (one lock) and processes (WAL).

    Args:
        path: The SQLite file (created with its folder if missing), or ``":memory:"``.
        schema: What the file holds (:class:`Schema`).
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
        path: Path | str,
        schema: Schema,
        busy_timeout_s: float = 10.0,
        synchronous: str = "NORMAL",
        verify_on_open: bool = True,
        recover: bool = False,
    ) -> None:
        if synchronous.upper() not in SYNC_MODES:  # it is formatted into a PRAGMA: check it
            raise ConfigError(f"synchronous must be one of {SYNC_MODES}, got {synchronous!r}")
        self.schema = schema
        self.memory = str(path) == MEMORY
        path = Path(path)
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
        if not self.memory:
            if path.is_dir():
                raise ConfigError(f"{schema.kind} path {path} is a folder, not a file")
            private_dir(path.parent)
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
                raise StoreError(f"{self.schema.kind} {self.path} is closed")
            if self._pid != os.getpid():  # inherited through fork(): never share a connection
                self._conn = self._connect()
            try:
                return self._retry(attempt)
            except StoreCorruptError as exc:
                self._quarantine(exc)  # re-raises unless in recover mode
                self._conn = self._connect()
                return self._retry(attempt)

    def checkpoint(self) -> bool:
        """Copy every committed transaction from the WAL into the main file and empty it.

        Returns:
            True when the whole WAL was copied (False: another process's open read
            transaction kept part of it; that process's own close finishes the job).
        """
        with self._lock:
            if self._conn is None or self.memory:
                return True
            try:
                busy, _, _ = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            except sqlite3.Error as exc:
                log.warning("%s %s: WAL checkpoint failed: %s", self.schema.kind, self.path, exc)
                return False
            return not busy

    def backup(self, dest: Path) -> None:
        """Write a consistent copy of the live file to ``dest`` (SQLite's online backup API).

        Other threads and processes may keep writing; the copy is one committed state of
        the database, WAL contents included, and opens on its own.

        Raises:
            ConfigError: ``dest`` exists or is this very file.
            StoreError: SQLite failed (disk full, permissions).
        """
        dest = Path(dest).expanduser().absolute()
        if dest.exists():
            raise ConfigError(f"backup target {dest} exists; choose a new file")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.partial")
        with self._lock:
            if self._conn is None:
                raise StoreError(f"{self.schema.kind} {self.path} is closed")
            try:
                target = sqlite3.connect(tmp)
                try:
                    self._conn.backup(target)  # one step: one read snapshot, no restarts
                    target.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
                finally:
                    target.close()
            except sqlite3.Error as exc:
                tmp.unlink(missing_ok=True)
                raise StoreError(f"backup of {self.path} to {dest} failed: {exc}") from exc
        os.replace(tmp, dest)  # a failed backup never leaves half a file under dest

    def close(self) -> None:
        """Checkpoint the WAL into the main file, then close the connection.

        After this a copy of the main file alone holds every committed transaction.
        """
        self.checkpoint()
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def file_bytes(self) -> int:
        """Bytes on disk: the file plus its write-ahead log."""
        if self.memory:
            return 0
        files = (self.path, Path(f"{self.path}-wal"))
        return sum(p.stat().st_size for p in files if p.exists())

    # -- internals ---------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves; threads share
        # the connection under self._lock, hence check_same_thread=False.
        if not self.memory:
            _private_file(self.path)  # also after a quarantine moved the old file aside
        conn = sqlite3.connect(
            MEMORY if self.memory else self.path, self.busy_timeout_s, isolation_level=None,
            check_same_thread=False,
        )
        try:
            self._retry(lambda: self._init(conn))
        except BaseException:
            conn.close()
            raise
        self._pid = os.getpid()
        return conn

    def _init(self, conn: sqlite3.Connection) -> None:
        sch = self.schema
        if not self.memory:
            conn.execute("PRAGMA journal_mode=WAL")  # garbage in the header fails right here
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        if self.verify_on_open and not self.memory:  # finds truncation and damaged pages
            problems = [r[0] for r in conn.execute("PRAGMA quick_check(5)")]
            if problems != ["ok"]:
                raise StoreCorruptError(self._corrupt_msg("; ".join(problems)))
        app = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        legacy = app == 0 and names and names <= sch.legacy_tables
        if app != sch.app_id and names and not legacy:
            raise ConfigError(
                f"{self.path} is an SQLite database but not an agentspec {sch.kind}; "
                "point it at another file"
            )
        if version > sch.version:
            raise ConfigError(
                f"{self.path} has {sch.kind} schema {version}, newer than this agentspec "
                f"understands ({sch.version}); upgrade agentspec"
            )
        if app != sch.app_id:
            conn.execute("BEGIN IMMEDIATE")  # IF NOT EXISTS: concurrent creators are harmless
            for stmt in sch.ddl:
                conn.execute(stmt)
            conn.execute(f"PRAGMA application_id={sch.app_id}")
            conn.execute(f"PRAGMA user_version={sch.version}")
            conn.execute("COMMIT")

    def _corrupt_msg(self, detail: str) -> str:
        return (
            f"{self.schema.kind} {self.path} is corrupt ({detail}). Move or delete the file to "
            f"start an empty one, or {self.schema.recover_hint}, which moves it to "
            f"{self.path.name}.corrupt-<timestamp> and starts empty"
        )

    def _quarantine(self, exc: Exception) -> None:
        """Move the damaged file and its WAL/SHM aside (recover mode) or re-raise ``exc``."""
        if not self.recover or self.memory:
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
                    raise StoreError(f"{self.schema.kind} {self.path}: {text}") from exc
                if time.monotonic() >= deadline:
                    raise StoreBusyError(
                        f"{self.schema.kind} {self.path} stayed locked by other writers for "
                        f"{self.busy_timeout_s:g} s; raise its busy_timeout_s"
                    ) from exc
                # SQLite's busy handler already waited; back off with jitter so that
                # writers retrying together do not collide again.
                time.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, 0.2)


def _private_file(path: Path) -> None:
    """Create the database file 0600 (SQLite gives its WAL and shared-memory files the
    same mode), or take group and other access away from an existing one we own."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        st = path.stat()
        if st.st_mode & 0o077 and st.st_uid == os.getuid():
            os.chmod(path, 0o600)
        return
    os.close(fd)
