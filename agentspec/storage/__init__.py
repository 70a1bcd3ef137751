"""agentspec's persistence layer: one SQLite file abstraction for every database it keeps.

:class:`SQLiteFile` (transactions, retries, corruption detection and quarantine, WAL
checkpoint on close, online backup) is used by :class:`agentspec.storage.sessions.SessionStore` and
:class:`agentspec.storage.ledger.RegretLedger`; each describes its tables with a :class:`Schema`.
"""

from __future__ import annotations

from agentspec.storage.sqlite import MEMORY, SYNC_MODES, Schema, SQLiteFile

__all__ = ["MEMORY", "SYNC_MODES", "SQLiteFile", "Schema"]
