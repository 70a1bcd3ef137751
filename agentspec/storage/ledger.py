"""The regret ledger of approximate (ASD) verification, persisted per (tenant, agent,
session).

Budgeted verification may commit a token the target would not have chosen; each such
*exception* costs logit regret ``r = z(y*) - z(x)``. The ledger is the audit trail and,
for session-scoped budgets, the account the budget is charged against: how much regret a
session has spent, in how many exceptions, over how many requests. It lives in one SQLite
file (``$AGENTSPEC_HOME/ledger.sqlite`` by default, WAL mode), so it survives restarts and
is shared by the processes of one machine; every update is a single ``BEGIN IMMEDIATE``
upsert that *adds* to the stored totals, so concurrent writers never lose an update.

The file is opened through :class:`agentspec.storage.SQLiteFile`, the layer the session
store uses too: the same retries while other processes hold the write lock, the same
detection of damaged files (:class:`~agentspec.errors.StoreCorruptError`, or quarantine
with ``recover=True``), WAL checkpoint on close and online backup. Strict is the default:
a ledger that silently started empty would hand every session a fresh regret budget.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar

from agentspec.errors import ConfigError
from agentspec.models import agentspec_home
from agentspec.storage import Schema, SQLiteFile
from agentspec.types import SessionRef

__all__ = ["LEDGER_SCHEMA", "LedgerEntry", "RegretLedger"]

T = TypeVar("T")

LEDGER_SCHEMA = Schema(
    kind="regret ledger",
    app_id=0x4147524C,  # "AGRL"
    version=1,
    ddl=(
        "CREATE TABLE IF NOT EXISTS ledger (tenant TEXT NOT NULL, agent TEXT NOT NULL,"
        " session TEXT NOT NULL, regret REAL NOT NULL, exceptions INTEGER NOT NULL,"
        " requests INTEGER NOT NULL, updated REAL NOT NULL,"
        " PRIMARY KEY (tenant, agent, session))",
    ),
    legacy_tables=frozenset({"ledger"}),  # files written before the header was stamped
    recover_hint="open it with RegretLedger(path, recover=True)",
)
# Add the deltas to the stored totals (or insert them): one atomic statement.
_UPSERT = (
    "INSERT INTO ledger (tenant, agent, session, regret, exceptions, requests, updated)"
    " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, agent, session) DO UPDATE SET"
    " regret = regret + excluded.regret, exceptions = exceptions + excluded.exceptions,"
    " requests = requests + excluded.requests, updated = excluded.updated"
)
_SELECT = (
    "SELECT regret, exceptions, requests FROM ledger WHERE tenant = ? AND agent = ?"
    " AND session = ?"
)


@dataclass(frozen=True)
class LedgerEntry:
    """One account's totals.

    Attributes:
        regret: Logit regret spent by accepted exceptions.
        exceptions: Mismatching tokens accepted.
        requests: Requests served under budgeted verification.
    """

    regret: float = 0.0
    exceptions: int = 0
    requests: int = 0


class RegretLedger:
    """Regret accounts keyed by :class:`~agentspec.types.SessionRef`.

    Args:
        path: SQLite file (created with its folder), ``":memory:"`` for a private
            in-memory ledger, or ``None`` for ``$AGENTSPEC_HOME/ledger.sqlite``.
        busy_timeout_s: How long a write waits for other processes' write locks.
        recover: Move a damaged file aside and start an empty ledger instead of raising.

    Raises:
        ConfigError: ``path`` is a folder, or an SQLite file that is not a ledger.
        StoreCorruptError: the file is damaged (and ``recover`` is False).
        StoreError: the file cannot be opened.
    """

    _shared: ClassVar[dict[str, RegretLedger]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self, path: str | Path | None = None, busy_timeout_s: float = 10.0,
        recover: bool = False,
    ) -> None:
        self.path = str(path) if path is not None else str(agentspec_home() / "ledger.sqlite")
        if self.path != ":memory:":
            self.path = str(Path(self.path).expanduser().absolute())
        self._db = SQLiteFile(self.path, LEDGER_SCHEMA, busy_timeout_s, recover=recover)

    @classmethod
    def default(cls, path: str | Path | None = None) -> RegretLedger:
        """The process-wide ledger for ``path`` (the default file when ``None``).

        Verifiers are built per request; they share this one connection.
        """
        key = str(path) if path is not None else str(agentspec_home() / "ledger.sqlite")
        with cls._shared_lock:
            if key not in cls._shared:
                cls._shared[key] = cls(key)
            return cls._shared[key]

    def get(self, session: SessionRef) -> LedgerEntry:
        """The totals of ``session``'s account (zeros if it has none)."""
        row = self._run(lambda c: c.execute(_SELECT, _session_key(session)).fetchone(), write=False)
        return LedgerEntry(float(row[0]), int(row[1]), int(row[2])) if row else LedgerEntry()

    def charge(
        self, session: SessionRef, regret: float, exceptions: int, requests: int = 0
    ) -> LedgerEntry:
        """Atomically add to ``session``'s totals; return the new totals.

        Raises:
            ConfigError: a negative amount (the ledger only grows).
        """
        if regret < 0 or exceptions < 0 or requests < 0:
            raise ConfigError(
                f"ledger charges must be >= 0, got regret={regret}, "
                f"exceptions={exceptions}, requests={requests}"
            )

        def upsert(c: sqlite3.Connection) -> tuple[float, int, int]:
            c.execute(_UPSERT, (*_session_key(session), regret, exceptions, requests, time.time()))
            row: tuple[float, int, int] = c.execute(_SELECT, _session_key(session)).fetchone()
            return row

        row = self._run(upsert, write=True)
        return LedgerEntry(float(row[0]), int(row[1]), int(row[2]))

    def count_request(self, session: SessionRef) -> LedgerEntry:
        """Count one more request for ``session``; return its totals."""
        return self.charge(session, 0.0, 0, requests=1)

    def reset(self, session: SessionRef) -> None:
        """Delete ``session``'s account (its budget starts over)."""
        self._run(
            lambda c: c.execute(
                "DELETE FROM ledger WHERE tenant = ? AND agent = ? AND session = ?",
                _session_key(session),
            ),
            write=True,
        )

    def entries(self) -> dict[tuple[str, str, str], LedgerEntry]:
        """Every account: ``(tenant, agent, session) -> totals``."""
        rows = self._run(
            lambda c: c.execute(
                "SELECT tenant, agent, session, regret, exceptions, requests FROM ledger"
                " ORDER BY tenant, agent, session"
            ).fetchall(),
            write=False,
        )
        return {(r[0], r[1], r[2]): LedgerEntry(float(r[3]), int(r[4]), int(r[5])) for r in rows}

    def close(self) -> None:
        """Checkpoint the WAL into the file and close the connection."""
        self._db.close()

    def backup(self, dest: str | Path) -> None:
        """A consistent copy of the live ledger in a new file (SQLite's online backup)."""
        self._db.backup(Path(dest))

    def _run(self, fn: Callable[[sqlite3.Connection], T], write: bool) -> T:
        return self._db.run(fn, txn=write)


def _session_key(session: SessionRef) -> tuple[str, str, str]:
    return (session.tenant, session.agent, session.session_id)
