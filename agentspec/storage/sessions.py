"""SessionStore: every turn a session has seen, persisted in SQLite and keyed by tenant.

A session's cache drafter rebuilds its suffix trees from :meth:`SessionStore.load` and adds
each committed turn with :meth:`SessionStore.append_turn`. One turn is one row (int32 token
ids in a BLOB plus their crc32) written in one transaction, so after a crash or SIGKILL a
turn is either fully there or absent.

Concurrency: one connection per store behind a lock (threads); WAL mode, ``BEGIN IMMEDIATE``
(writers queue on SQLite's busy handler instead of dead-locking on a lock upgrade) and
retries on ``database is locked`` (processes). See :mod:`agentspec.storage`, the SQLite
layer this store shares with the regret ledger.

Quotas and fairness: ``max_sessions`` bounds the whole store; ``max_sessions_per_tenant``
and ``max_tokens_per_tenant`` bound each tenant. A tenant over its own quota evicts its own
least recently used sessions; when the whole store is full, the victims come from the
tenant holding the most sessions, so one busy tenant cannot push every other tenant's
history out.

Durability: :meth:`SessionStore.close` checkpoints the write-ahead log into the main file,
so after a clean shutdown the file alone holds every acknowledged turn;
:meth:`SessionStore.backup` copies a live store with SQLite's online backup API.

Corruption: a damaged file (garbage, truncation) is found on open by ``PRAGMA quick_check``
or later by SQLite's CORRUPT/NOTADB errors and raises :class:`StoreCorruptError` naming the
file and what to do. In recover mode (``StoreConfig(recover=True)`` or
:meth:`SessionStore.open_or_recover`) the file and its WAL move to
``<file>.corrupt-<timestamp>``, an empty store starts, ``recovered`` becomes True and a
warning is logged, so the engine never crashes on it. A turn that fails its checksum makes
``load``/``export`` raise :class:`StoreCorruptError` in strict mode; recover mode skips that
turn with a warning, because each turn is an independent token sequence for the cache
drafter and the others stay useful.
"""

from __future__ import annotations

import logging
import sqlite3
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from agentspec.errors import (
    AgentSpecError,
    ConfigError,
    SessionTooLargeError,
    StoreCorruptError,
    UnknownSessionError,
)
from agentspec.interfaces import TurnStore
from agentspec.models import agentspec_home
from agentspec.storage import SYNC_MODES, Schema, SQLiteFile
from agentspec.storage.quotas import evict
from agentspec.types import SessionRef, check_id

log = logging.getLogger(__name__)

STORE_FILE = "sessions.sqlite3"
EXPORT_FORMAT = "agentspec.session/1"
_Key = tuple[str, str, str]

SESSION_SCHEMA = Schema(
    kind="session store",
    app_id=0x41475350,  # "AGSP" in the SQLite header: tells our files from foreign databases
    version=1,
    ddl=(
        "CREATE TABLE IF NOT EXISTS sessions (id INTEGER PRIMARY KEY, tenant TEXT NOT NULL,"
        " agent TEXT NOT NULL, session_id TEXT NOT NULL, turns INTEGER NOT NULL,"
        " tokens INTEGER NOT NULL, created REAL NOT NULL, last_used REAL NOT NULL,"
        " UNIQUE (tenant, agent, session_id))",
        "CREATE INDEX IF NOT EXISTS sessions_lru ON sessions (last_used, id)",
        # One row per turn: int32 little-endian token ids in ``data``, ``crc`` = crc32(data).
        "CREATE TABLE IF NOT EXISTS turns (session INTEGER NOT NULL, idx INTEGER NOT NULL,"
        " n INTEGER NOT NULL, crc INTEGER NOT NULL, data BLOB NOT NULL,"
        " PRIMARY KEY (session, idx))",
    ),
    recover_hint=(
        "open it in recover mode (SessionStore.open_or_recover, "
        "`agentspec sessions --recover ...`)"
    ),
)


@dataclass(frozen=True)
class StoreConfig:
    """Limits and behaviour of a :class:`SessionStore`.

    Attributes:
        max_sessions: Sessions kept; an append that creates one more evicts the least
            recently used sessions (by load or append) of the tenant holding the most.
        max_tokens_per_session: An append that would take a session past it raises
            :class:`SessionTooLargeError` and writes nothing.
        max_tokens_per_turn: Optional cap on one turn (same error).
        max_sessions_per_tenant: Optional cap per tenant; an append that creates one more
            evicts that tenant's own least recently used sessions.
        max_tokens_per_tenant: Optional cap on a tenant's stored tokens; an append past it
            evicts that tenant's own least recently used sessions (never the one appended
            to; if that one alone is too large, :class:`SessionTooLargeError`).
        max_total_tokens: Tokens kept in the whole store (4 bytes each in the file, the
            bound on its size); an append past it evicts the least recently used sessions
            of the tenant holding the most tokens.
        busy_timeout_s: How long to wait for other writers before ``StoreBusyError``.
        synchronous: SQLite ``synchronous`` mode. ``NORMAL`` (WAL) survives process
            crashes and SIGKILL; ``FULL`` also survives power loss, at an fsync per turn.
        verify_on_open: Run ``PRAGMA quick_check`` on open (reads the file once; turn it
            off for very large stores that must open instantly).
        recover: Move a corrupt file aside and start empty; skip damaged turns on load.
    """

    max_sessions: int = 10_000
    max_tokens_per_session: int = 4_000_000
    max_tokens_per_turn: int | None = None
    max_sessions_per_tenant: int | None = None
    max_tokens_per_tenant: int | None = None
    max_total_tokens: int = 250_000_000  # ~1 GB of token ids
    busy_timeout_s: float = 10.0
    synchronous: str = "NORMAL"
    verify_on_open: bool = True
    recover: bool = False

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_tokens_per_session", "max_tokens_per_turn",
                     "max_sessions_per_tenant", "max_tokens_per_tenant", "max_total_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"StoreConfig.{name} must be an int >= 1, got {value!r}")
        if not self.busy_timeout_s > 0:
            raise ConfigError(f"StoreConfig.busy_timeout_s must be > 0, got {self.busy_timeout_s}")
        if self.synchronous.upper() not in SYNC_MODES:
            raise ConfigError(
                f"StoreConfig.synchronous must be one of {SYNC_MODES}, got {self.synchronous!r}"
            )


@dataclass(frozen=True)
class SessionInfo:
    """One stored session. ``created`` and ``last_used`` are Unix times in seconds."""

    tenant: str
    agent: str
    session_id: str
    turns: int
    tokens: int
    created: float
    last_used: float

    @property
    def ref(self) -> SessionRef:
        """The session's :class:`SessionRef`."""
        return SessionRef(self.session_id, self.tenant, self.agent)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return asdict(self)


def open_store(
    store: str | Path | bool | None, config: StoreConfig | None = None
) -> SessionStore | None:
    """The one "open or recover" entry point of every runtime (embedded, LangChain, vLLM).

    Args:
        store: ``True`` for ``agentspec_home()/sessions.sqlite3``, a path, or
            ``False``/``None`` for no store.
        config: Limits and quotas (:class:`StoreConfig`; ``recover`` is forced on).

    Returns:
        The store in recover mode (a corrupt file is moved aside, logged, and an empty
        store starts, so serving never fails because of it), or ``None``.
    """
    if not store:
        return None
    path = None if store is True else Path(str(store)).expanduser()
    return SessionStore.open_or_recover(path, config)


def persist_turn(store: TurnStore, ref: SessionRef, tokens: Sequence[int]) -> bool:
    """Append one finished turn (prompt + output) to ``store``; ``False`` if it failed.

    The one place a finished turn is written, called by whoever owns the request's
    lifecycle (:class:`agentspec.runtime.Runtime`, the vLLM proposer), whichever drafter
    decoded it. The answer is already produced by then: a turn that cannot be written (an
    oversized session, a busy or damaged store) is logged and skipped, never raised.
    """
    try:
        store.append_turn(ref, [int(t) for t in tokens])
    except AgentSpecError as exc:
        log.warning("turn of session %s not persisted: %s", ref, exc)
        return False
    return True


def _session_key(ref: SessionRef) -> _Key:
    # Re-check the ids: refs may be duck-typed, and ids end up in operators' CLI output.
    tenant, agent = getattr(ref, "tenant", None), getattr(ref, "agent", None)
    session = getattr(ref, "session_id", None)
    return (
        check_id("tenant", tenant),  # type: ignore[arg-type]
        check_id("agent", agent),  # type: ignore[arg-type]
        check_id("session", session),  # type: ignore[arg-type]
    )


def _pack(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes; ConfigError unless each is in [0, 2**31)."""
    try:
        # Fixed byte order: a store file copied to another machine still reads the same.
        data = struct.pack(f"<{len(tokens)}i", *tokens)
    except (struct.error, TypeError) as exc:
        bad = next((t for t in tokens if not isinstance(t, int) or not 0 <= t < 2**31), None)
        raise ConfigError(f"token ids must be ints in [0, 2**31); got {bad!r} ({exc})") from None
    if len(tokens) and min(tokens) < 0:
        raise ConfigError(f"token ids must be ints in [0, 2**31); got {min(tokens)}")
    return data


class SessionStore:
    """Persistent token history of sessions, keyed by (tenant, agent, session).

    Safe for several threads (they share one connection under a lock) and several
    processes (each opens its own store on the same file).

    Args:
        path: SQLite file; default ``agentspec_home()/sessions.sqlite3``.
        config: Limits and recovery behaviour (:class:`StoreConfig`).

    Raises:
        StoreCorruptError: The file is damaged and ``config.recover`` is False.
        ConfigError: The path is a folder, or an SQLite file that is not a session store.
    """

    def __init__(self, path: str | Path | None = None, config: StoreConfig | None = None) -> None:
        self.config = config or StoreConfig()
        path = Path(path).expanduser() if path is not None else agentspec_home() / STORE_FILE
        self.path = path.absolute()  # messages name the file unambiguously
        cfg = self.config
        self._db = SQLiteFile(
            self.path, SESSION_SCHEMA, cfg.busy_timeout_s, cfg.synchronous,
            cfg.verify_on_open, cfg.recover,
        )

    @classmethod
    def open_or_recover(
        cls, path: str | Path | None = None, config: StoreConfig | None = None
    ) -> SessionStore:
        """Open a store in recover mode: a corrupt file is moved aside instead of raised.

        ``store.recovered`` and ``store.recovered_to`` tell whether and where it went.
        """
        return cls(path, replace(config or StoreConfig(), recover=True))

    @property
    def recovered(self) -> bool:
        """True once this store moved a corrupt file aside and started empty."""
        return self._db.recovered

    @property
    def recovered_to(self) -> Path | None:
        """Where the corrupt file was moved (``None`` if it never happened)."""
        return self._db.recovered_to

    # -- the API the drafter uses ------------------------------------------------------------

    def load(self, ref: SessionRef) -> list[list[int]]:
        """The session's committed turns in order (``[]`` for an unknown session).

        Raises:
            StoreCorruptError: A turn fails its checksum (strict mode only).
        """
        key = _session_key(ref)
        found = self._db.run(lambda conn: self._rows(conn, key, touch=True))
        return [] if found is None else self._decode(key, found[1])[0]

    def append_turn(self, ref: SessionRef, tokens: Sequence[int]) -> None:
        """Append one turn atomically, creating the session if needed.

        Raises:
            ConfigError: A token id is not an int in ``[0, 2**31)``.
            SessionTooLargeError: A token limit would be exceeded; nothing is written.
        """
        key, data = _session_key(ref), _pack(tokens)
        n, crc, cfg = len(data) // 4, zlib.crc32(data), self.config
        if cfg.max_tokens_per_turn is not None and n > cfg.max_tokens_per_turn:
            raise SessionTooLargeError(
                f"a turn of {n} tokens for session {'/'.join(key)} exceeds "
                f"max_tokens_per_turn={cfg.max_tokens_per_turn}; nothing was written"
            )

        def write(conn: sqlite3.Connection) -> None:
            now, row = time.time(), self._find(conn, key)
            if row is None:
                sql = "INSERT INTO sessions VALUES (NULL, ?, ?, ?, 0, 0, ?, ?)"
                row = (conn.execute(sql, (*key, now, now)).lastrowid, *key, 0, 0)
            sid, turns, have = row[0], row[4], row[5]
            if have + n > cfg.max_tokens_per_session:  # raising rolls the insert back
                raise SessionTooLargeError(
                    f"session {'/'.join(key)} holds {have} tokens; appending {n} would exceed "
                    f"max_tokens_per_session={cfg.max_tokens_per_session}; nothing was written. "
                    "Start a new session or raise the limit."
                )
            if cfg.max_tokens_per_tenant is not None and have + n > cfg.max_tokens_per_tenant:
                raise SessionTooLargeError(
                    f"session {'/'.join(key)} would hold {have + n} tokens, more than its "
                    f"tenant's max_tokens_per_tenant={cfg.max_tokens_per_tenant}; nothing "
                    "was written"
                )
            conn.execute("INSERT INTO turns VALUES (?, ?, ?, ?, ?)", (sid, turns, n, crc, data))
            conn.execute(
                "UPDATE sessions SET turns=turns+1, tokens=tokens+?, last_used=? WHERE id=?",
                (n, now, sid),
            )
            self._evict(conn, sid, key[0])

        self._db.run(write)

    # -- operators' API ----------------------------------------------------------------------

    def list_sessions(self, tenant: str | None = None) -> list[SessionInfo]:
        """All sessions (of one tenant if given), sorted by tenant, agent and session id."""
        where, params = ("", ()) if tenant is None else (" WHERE tenant=?", (tenant,))
        if tenant is not None:
            check_id("tenant", tenant)
        sql = f"SELECT * FROM sessions{where} ORDER BY tenant, agent, session_id"
        rows = self._db.run(lambda conn: conn.execute(sql, params).fetchall(), txn=False)
        return [SessionInfo(*r[1:]) for r in rows]

    def info(self, ref: SessionRef) -> SessionInfo:
        """One session's summary. Raises :class:`UnknownSessionError` if it is not stored."""
        key = _session_key(ref)
        row = self._db.run(lambda conn: self._find(conn, key), txn=False)
        if row is None:
            raise self._unknown(key)
        return SessionInfo(*row[1:])

    def delete(self, ref: SessionRef) -> None:
        """Delete a session and its turns. Raises :class:`UnknownSessionError` if absent."""
        key = _session_key(ref)

        def drop(conn: sqlite3.Connection) -> None:
            row = self._find(conn, key)
            if row is None:
                raise self._unknown(key)  # raised inside the transaction: nothing changes
            self._drop(conn, [row[0]])

        self._db.run(drop)

    def export(self, ref: SessionRef) -> dict[str, Any]:
        """The session as a JSON-ready dict, token ids included.

        Keys: ``format``, ``tenant``, ``agent``, ``session_id``, ``num_turns``, ``tokens``,
        ``created``, ``last_used``, ``turns`` (one list of token ids per turn) and
        ``skipped_turns`` (damaged turns left out in recover mode; empty otherwise).

        Raises:
            UnknownSessionError: The session is not stored.
            StoreCorruptError: A turn fails its checksum (strict mode only).
        """
        key = _session_key(ref)
        found = self._db.run(lambda conn: self._rows(conn, key, touch=False))
        if found is None:
            raise self._unknown(key)
        turns, skipped = self._decode(key, found[1])
        info = SessionInfo(*found[0][1:]).to_dict()
        info["num_turns"] = info.pop("turns")  # "turns" holds the token lists themselves
        return {"format": EXPORT_FORMAT, **info, "turns": turns, "skipped_turns": skipped}

    def stats(self) -> dict[str, Any]:
        """Totals and limits: sessions, tenants, turns, tokens, bytes on disk."""
        sql = (
            "SELECT COUNT(*), COUNT(DISTINCT tenant), COALESCE(SUM(turns), 0),"
            " COALESCE(SUM(tokens), 0) FROM sessions"
        )
        sessions, tenants, turns, tokens = self._db.run(
            lambda conn: conn.execute(sql).fetchone(), txn=False
        )
        return {
            "path": str(self.path),
            "sessions": sessions,
            "tenants": tenants,
            "turns": turns,
            "tokens": tokens,
            "file_bytes": self._db.file_bytes(),
            "max_sessions": self.config.max_sessions,
            "max_tokens_per_session": self.config.max_tokens_per_session,
            "max_sessions_per_tenant": self.config.max_sessions_per_tenant,
            "max_tokens_per_tenant": self.config.max_tokens_per_tenant,
            "recovered": self.recovered,
            "recovered_to": str(self.recovered_to) if self.recovered_to else None,
        }

    def checkpoint(self) -> bool:
        """Copy the write-ahead log into the main file; True when all of it was copied."""
        return self._db.checkpoint()

    def backup(self, dest: str | Path) -> Path:
        """Write a consistent copy of the live store to a new file ``dest``; return its path.

        Uses SQLite's online backup API: writers (this and other processes) may go on; the
        copy is one committed state, WAL contents included, in a single self-contained file.

        Raises:
            ConfigError: ``dest`` exists.
            StoreError: SQLite failed.
        """
        out = Path(dest).expanduser().absolute()
        self._db.backup(out)
        return out

    def close(self) -> None:
        """Checkpoint the WAL into the main file and close; later calls raise ``StoreError``.

        After ``close`` the main file alone (``sqlite3 sessions.sqlite3``, or a copy of just
        that file) holds every turn this store acknowledged.
        """
        self._db.close()

    def __enter__(self) -> SessionStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (run inside StoreDB.run, i.e. under the lock and in a transaction) --------

    def _unknown(self, key: _Key) -> UnknownSessionError:
        return UnknownSessionError(f"no session {'/'.join(key)} in {self.path}")

    @staticmethod
    def _find(conn: sqlite3.Connection, key: _Key) -> Any:
        sql = "SELECT * FROM sessions WHERE tenant=? AND agent=? AND session_id=?"
        return conn.execute(sql, key).fetchone()

    def _rows(self, conn: sqlite3.Connection, key: _Key, touch: bool) -> Any:
        """The session row and its turn rows, read in one transaction (``None`` if unknown)."""
        row = self._find(conn, key)
        if row is None:
            return None
        if touch:  # a load is a use: it keeps the session away from the LRU end
            conn.execute("UPDATE sessions SET last_used=? WHERE id=?", (time.time(), row[0]))
        sql = "SELECT idx, n, crc, data FROM turns WHERE session=? ORDER BY idx"
        return row, conn.execute(sql, (row[0],)).fetchall()

    def _decode(self, key: _Key, rows: list[Any]) -> tuple[list[list[int]], list[int]]:
        """Turn rows to token lists, checking each row's length and crc32."""
        turns: list[list[int]] = []
        skipped: list[int] = []
        for idx, n, crc, data in rows:
            if isinstance(data, bytes) and len(data) == 4 * n and zlib.crc32(data) == crc:
                turns.append(list(struct.unpack(f"<{n}i", data)))
                continue
            msg = f"session {'/'.join(key)} in {self.path}: turn {idx} fails its checksum"
            if not self.config.recover:
                raise StoreCorruptError(
                    f"{msg}. Delete the session (`agentspec sessions delete {'/'.join(key)}`) "
                    "or open the store in recover mode, which skips damaged turns"
                )
            log.warning("%s; skipped it (recover mode)", msg)
            skipped.append(idx)
        return turns, skipped

    def _evict(self, conn: sqlite3.Connection, keep: int, tenant: str) -> None:
        """Enforce the quotas after an append (see :func:`agentspec.storage.quotas.evict`)."""
        victims = evict(conn, self.config, keep, tenant, self._drop)
        if victims:
            log.info("session store %s: evicted %d least recently used sessions",
                     self.path, victims)

    @staticmethod
    def _drop(conn: sqlite3.Connection, ids: list[int]) -> None:
        conn.executemany("DELETE FROM turns WHERE session=?", [(i,) for i in ids])
        conn.executemany("DELETE FROM sessions WHERE id=?", [(i,) for i in ids])
