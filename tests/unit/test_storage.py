"""The shared SQLite layer (agentspec.storage) under both the session store and the ledger.

The regret ledger used to have its own SQLite code without retries or corruption handling;
these tests pin that it now has the session store's behaviour: damaged files are detected
(and quarantined in recover mode), foreign databases are refused, files written before the
header was stamped are adopted, concurrent processes' updates all land, and close leaves a
self-contained main file.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from agentspec.errors import ConfigError, StoreCorruptError
from agentspec.storage import Schema, SQLiteFile
from agentspec.storage.ledger import RegretLedger
from agentspec.storage.sessions import SessionStore
from agentspec.types import SessionRef

REF = SessionRef("s1", "t1", "a1")


def test_ledger_detects_and_recovers_a_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreCorruptError, match=r"regret ledger .* is corrupt"):
        RegretLedger(path)
    ledger = RegretLedger(path, recover=True)  # moved aside, started empty
    assert ledger.get(REF).requests == 0
    assert len(list(tmp_path.glob("ledger.sqlite.corrupt-*"))) == 1
    ledger.charge(REF, 1.5, 2, 1)
    ledger.close()
    assert RegretLedger(path).get(REF).exceptions == 2


def test_ledger_refuses_foreign_database_and_adopts_legacy_file(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE users (name TEXT)")
    conn.close()
    with pytest.raises(ConfigError, match="not an agentspec regret ledger"):
        RegretLedger(foreign)
    with pytest.raises(ConfigError, match="not an agentspec session store"):
        SessionStore(foreign)
    # A ledger written before the header was stamped: same table, application_id 0.
    legacy = tmp_path / "legacy.sqlite"
    with sqlite3.connect(legacy) as conn:
        conn.execute(
            "CREATE TABLE ledger (tenant TEXT NOT NULL, agent TEXT NOT NULL, session TEXT NOT "
            "NULL, regret REAL NOT NULL, exceptions INTEGER NOT NULL, requests INTEGER NOT "
            "NULL, updated REAL NOT NULL, PRIMARY KEY (tenant, agent, session))")
        conn.execute("INSERT INTO ledger VALUES ('t1', 'a1', 's1', 0.5, 1, 3, 0)")
    conn.close()
    ledger = RegretLedger(legacy)
    assert ledger.get(REF).requests == 3
    ledger.close()


CHARGER = """
import sys
from agentspec.storage.ledger import RegretLedger
from agentspec.types import SessionRef
ledger = RegretLedger(sys.argv[1])
for _ in range(int(sys.argv[2])):
    ledger.charge(SessionRef("s1", "t1", "a1"), 0.25, 1, 1)
ledger.close()
"""


def test_ledger_updates_from_concurrent_processes_all_land(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    RegretLedger(path).close()
    procs = [subprocess.Popen([sys.executable, "-c", CHARGER, str(path), "60"])
             for _ in range(3)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    entry = RegretLedger(path).get(REF)
    assert (entry.requests, entry.exceptions, entry.regret) == (180, 180, 45.0)


def test_close_leaves_a_self_contained_main_file(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    ledger = RegretLedger(path)
    ledger.charge(REF, 2.0, 1, 1)
    ledger.backup(tmp_path / "backup.sqlite")
    ledger.close()
    for source in (path, tmp_path / "backup.sqlite"):
        alone = tmp_path / "alone" / source.name
        alone.parent.mkdir(exist_ok=True)
        shutil.copy(source, alone)  # without any -wal beside it
        assert RegretLedger(alone).get(REF).regret == 2.0


def test_memory_file_and_schema_versions(tmp_path: Path) -> None:
    ledger = RegretLedger(":memory:")
    assert ledger.charge(REF, 1.0, 1).regret == 1.0
    ledger.close()
    schema = Schema("test file", 0x54455354, 2, ("CREATE TABLE IF NOT EXISTS x (a)",))
    db = SQLiteFile(tmp_path / "x.sqlite", schema)
    db.close()
    older = Schema("test file", 0x54455354, 1, schema.ddl)
    with pytest.raises(ConfigError, match="newer than this agentspec"):
        SQLiteFile(tmp_path / "x.sqlite", older)
