"""Old import path of the session store's SQLite layer; see :mod:`agentspec.storage`.

Kept so code written against ``agentspec._store_db.StoreDB`` keeps working: ``StoreDB`` is
:class:`~agentspec.storage.SQLiteFile` bound to the session-store schema.
"""

from __future__ import annotations

from pathlib import Path

from agentspec.storage import SYNC_MODES, SQLiteFile
from agentspec.store import SESSION_SCHEMA

APP_ID = SESSION_SCHEMA.app_id
SCHEMA = SESSION_SCHEMA.version

__all__ = ["APP_ID", "SCHEMA", "SYNC_MODES", "StoreDB"]


class StoreDB(SQLiteFile):
    """:class:`~agentspec.storage.SQLiteFile` holding the session-store schema."""

    def __init__(
        self,
        path: Path,
        busy_timeout_s: float = 10.0,
        synchronous: str = "NORMAL",
        verify_on_open: bool = True,
        recover: bool = False,
    ) -> None:
        super().__init__(path, SESSION_SCHEMA, busy_timeout_s, synchronous, verify_on_open,
                         recover)
