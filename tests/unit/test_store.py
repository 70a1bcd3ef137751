"""SessionStore: persistence, crash safety, corruption handling, concurrency and limits."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest

from agentspec.errors import (
    AgentSpecError,
    ConfigError,
    SessionTooLargeError,
    StoreCorruptError,
    UnknownSessionError,
)
from agentspec.storage.sessions import SessionStore, StoreConfig
from agentspec.types import SessionRef

# The same deterministic turn generator runs in child processes (as source) and here.
TURN_SRC = """
def turn(i, base=0):
    n = 1 + (i * 2654435761 + base) % 12000  # up to 12k tokens: a turn takes a while to write
    return [(i * 7919 + base + j * 31) % 50000 for j in range(n)]
"""
_ns: dict[str, object] = {}
exec(TURN_SRC, _ns)
turn = cast("Callable[[int, int], list[int]]", _ns["turn"])

WRITER = TURN_SRC + """
import sys
from agentspec.storage.sessions import SessionStore
from agentspec.types import SessionRef
store = SessionStore(sys.argv[1])
ref, base, count = SessionRef(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if len(sys.argv) > 5:  # hang inside the transaction of turn N: after its INSERTs, before COMMIT
    import time
    hang_at, evict = int(sys.argv[5]), SessionStore._evict
    def _evict(self, conn, keep, tenant):
        evict(self, conn, keep, tenant)
        if conn.execute("SELECT MAX(idx) FROM turns").fetchone()[0] == hang_at:
            print("mid", flush=True)
            time.sleep(60)
    SessionStore._evict = _evict
for i in range(count):
    store.append_turn(ref, turn(i, base))
    print(i, flush=True)  # printed only after the turn's transaction committed
"""


def _child(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, *map(str, args)], stdout=subprocess.PIPE, text=True
    )


def _filled(path: Path, sessions: int = 6) -> None:
    with SessionStore(path) as store:
        for s in range(sessions):
            for i in range(3):
                store.append_turn(SessionRef(f"s{s}"), turn(i, s))


def test_round_trip_and_tenant_isolation(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.db")
    a, b = SessionRef("chat", tenant="acme"), SessionRef("chat", tenant="other")
    turns = [[1, 2, 3], [], list(range(5000)), [2**31 - 1, 0]]
    for t in turns:
        store.append_turn(a, t)
    store.append_turn(b, [9])
    assert store.load(a) == turns
    assert store.load(b) == [[9]]
    info = store.info(a)
    assert (info.turns, info.tokens, info.ref) == (4, 5005, a)
    assert info.created <= info.last_used
    assert [s.tenant for s in store.list_sessions()] == ["acme", "other"]
    assert [s.ref for s in store.list_sessions(tenant="other")] == [b]
    exported = store.export(a)
    assert exported["turns"] == turns and exported["num_turns"] == 4
    json.dumps(exported)  # JSON-ready
    stats = store.stats()
    assert (stats["sessions"], stats["tenants"], stats["turns"], stats["tokens"]) == (2, 2, 5, 5006)
    store.delete(a)
    assert store.load(a) == [] and store.load(b) == [[9]]
    store.close()


def test_unknown_session(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.db")
    ref = SessionRef("ghost", tenant="t", agent="a")
    assert store.load(ref) == []
    assert store.list_sessions() == []  # load does not create sessions
    for call in (store.info, store.delete, store.export):
        with pytest.raises(UnknownSessionError, match="no session t/a/ghost in") as err:
            call(ref)
        assert isinstance(err.value, KeyError) and isinstance(err.value, AgentSpecError)


def test_new_process_sees_committed_turns(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with SessionStore(path) as store:
        store.append_turn(SessionRef("s"), [1, 2])
        store.append_turn(SessionRef("s"), [3])
    code = (
        "import json, sys; from agentspec.storage.sessions import SessionStore; "
        "from agentspec.types import SessionRef; "
        "print(json.dumps(SessionStore(sys.argv[1]).load(SessionRef('s'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [[1, 2], [3]]


@pytest.mark.parametrize("seed", [0, 1, 2, "in-transaction"])
def test_sigkill_mid_turn_keeps_only_complete_turns(tmp_path: Path, seed: int | str) -> None:
    rng = random.Random(seed)
    path, base, target = tmp_path / "s.db", 0 if isinstance(seed, str) else seed, rng.randint(2, 25)
    # "in-transaction" parks the child between turn `target`'s INSERTs and its COMMIT.
    proc = _child(path, "victim", base, 10_000, *([target] if isinstance(seed, str) else []))
    assert proc.stdout is not None
    printed = [int(proc.stdout.readline()) for _ in range(target)]
    if isinstance(seed, str):
        assert proc.stdout.readline().strip() == "mid"
    else:
        time.sleep(rng.uniform(0.0, 0.02))  # land the kill at a random point of a later turn
    proc.send_signal(signal.SIGKILL)
    printed += [int(line) for line in proc.stdout.read().split()]
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with SessionStore(path) as store:  # strict mode + quick_check: no corruption
        ref = SessionRef("victim")
        turns, info = store.load(ref), store.info(ref)
    # Every printed turn committed; at most one more committed before its print.
    assert printed == list(range(len(printed)))
    assert len(printed) <= len(turns) <= len(printed) + 1
    if isinstance(seed, str):
        assert len(turns) == target  # the half-written turn left no trace
    assert (info.turns, info.tokens) == (len(turns), sum(map(len, turns)))
    for i, t in enumerate(turns):
        assert t == turn(i, base), f"turn {i} differs"


@pytest.mark.parametrize("damage", ["garbage", "truncate"])
def test_corrupt_file_is_reported_then_recovered(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s.db"
    _filled(path)
    size = path.stat().st_size
    if damage == "garbage":
        path.write_bytes(random.Random(7).randbytes(size))
    else:
        os.truncate(path, size // 2)
    with pytest.raises(StoreCorruptError) as err:
        SessionStore(path)
    message = str(err.value)
    assert str(path) in message and "corrupt" in message and "recover" in message
    with caplog.at_level(logging.WARNING, logger="agentspec"):
        store = SessionStore.open_or_recover(path)
    assert store.recovered and store.recovered_to is not None
    assert store.recovered_to.exists() and ".corrupt-" in store.recovered_to.name
    assert any("started an empty store" in r.getMessage() for r in caplog.records)
    assert store.list_sessions() == [] and store.load(SessionRef("s0")) == []
    store.append_turn(SessionRef("s0"), [4, 5])  # the engine keeps going
    store.close()
    with SessionStore(path) as again:
        assert again.load(SessionRef("s0")) == [[4, 5]] and not again.recovered


def test_corrupt_row_strict_raises_recover_skips(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, ref = tmp_path / "s.db", SessionRef("s")
    with SessionStore(path) as store:
        for t in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
            store.append_turn(ref, t)
    with sqlite3.connect(path) as conn:  # flip the first token of turn 1, keep its crc
        conn.execute("UPDATE turns SET data = ? WHERE idx = 1", ((99).to_bytes(4, "little")
                     + (5).to_bytes(4, "little") + (6).to_bytes(4, "little"),))
    conn.close()
    with SessionStore(path) as store, pytest.raises(StoreCorruptError, match="turn 1"):
        store.load(ref)
    with caplog.at_level(logging.WARNING, logger="agentspec"):
        store = SessionStore.open_or_recover(path)
        assert store.load(ref) == [[1, 2, 3], [7, 8, 9]]
        assert store.export(ref)["skipped_turns"] == [1]
    assert not store.recovered  # a bad row does not discard the file
    assert any("fails its checksum" in r.getMessage() for r in caplog.records)
    store.close()


@pytest.mark.parametrize("shared", [True, False])
def test_concurrent_threads(tmp_path: Path, shared: bool) -> None:
    path = tmp_path / "s.db"
    common = SessionStore(path)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        store = common if shared else SessionStore(path)
        try:
            for i in range(50):
                store.append_turn(SessionRef(f"t{k}"), [k, i, *range(i % 7)])
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in range(4):
        assert common.load(SessionRef(f"t{k}")) == [[k, i, *range(i % 7)] for i in range(50)]
    common.close()


def test_concurrent_processes(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    SessionStore(path).close()  # create the file up front; creation races are tested too
    procs = [_child(path, f"p{k}", 1000 * k, 50) for k in range(2)]
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.split() == [str(i) for i in range(50)]
    with SessionStore(path) as store:
        for k in range(2):
            assert store.load(SessionRef(f"p{k}")) == [turn(i, 1000 * k) for i in range(50)]


def test_lru_eviction(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.db", StoreConfig(max_sessions=3))
    for name in ("a", "b", "c"):
        store.append_turn(SessionRef(name), [1])
        time.sleep(0.005)  # distinct last_used stamps
    store.load(SessionRef("a"))  # a load is a use: "b" is now the least recently used
    time.sleep(0.005)
    store.append_turn(SessionRef("d"), [2])
    assert [s.session_id for s in store.list_sessions()] == ["a", "c", "d"]
    store.append_turn(SessionRef("c"), [3])  # appending to an existing session evicts nothing
    assert len(store.list_sessions()) == 3
    assert store.load(SessionRef("b")) == []
    store.close()


def test_session_and_turn_limits(tmp_path: Path) -> None:
    cfg = StoreConfig(max_tokens_per_session=10, max_tokens_per_turn=8)
    store = SessionStore(tmp_path / "s.db", cfg)
    ref = SessionRef("s")
    store.append_turn(ref, list(range(6)))
    with pytest.raises(SessionTooLargeError, match=r"holds 6 tokens; appending 5.*=10") as err:
        store.append_turn(ref, list(range(5)))
    assert isinstance(err.value, ValueError)
    with pytest.raises(SessionTooLargeError, match="max_tokens_per_turn=8"):
        store.append_turn(SessionRef("new"), list(range(9)))
    cfg2 = StoreConfig(max_tokens_per_session=4)
    with SessionStore(tmp_path / "t.db", cfg2) as small:
        with pytest.raises(SessionTooLargeError):
            small.append_turn(SessionRef("new"), list(range(5)))
        assert small.list_sessions() == []  # the session row was rolled back too
    assert store.load(ref) == [list(range(6))]
    assert [s.session_id for s in store.list_sessions()] == ["s"]
    store.close()


def test_invalid_ids_and_tokens(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.db")
    with pytest.raises(ConfigError, match="invalid session id"):
        store.append_turn(SessionRef("bad id!"), [1])

    class DuckRef:  # refs are duck-typed; the store re-checks the ids it persists
        session_id, tenant, agent = "ok", "bad/tenant", "default"

    for call in (store.load, store.info, lambda r: store.append_turn(r, [1])):
        with pytest.raises(ConfigError, match="invalid tenant id"):
            call(DuckRef())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="invalid tenant id"):
        store.list_sessions(tenant="no spaces")
    for bad in ([1.5], [-1], [2**31], ["7"], [None]):
        with pytest.raises(ConfigError, match=r"token ids must be ints in \[0, 2\*\*31\)"):
            store.append_turn(SessionRef("s"), bad)  # type: ignore[arg-type]
    assert store.list_sessions() == []  # nothing was written by any of them
    with pytest.raises(ConfigError, match="max_sessions"):
        StoreConfig(max_sessions=0)
    with pytest.raises(ConfigError, match="synchronous"):
        StoreConfig(synchronous="NORMAL; DROP TABLE turns")
    store.close()


def test_foreign_database_and_closed_store(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (x)")
    conn.close()
    with pytest.raises(ConfigError, match="not an agentspec session store"):
        SessionStore.open_or_recover(path)  # never moves someone else's database aside
    assert path.exists()
    with pytest.raises(ConfigError, match="is a folder"):
        SessionStore(tmp_path)
    store = SessionStore(tmp_path / "s.db")
    store.close()
    with pytest.raises(AgentSpecError, match="closed"):
        store.load(SessionRef("s"))


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AGENTSPEC_HOME": str(tmp_path / "home")}  # never the real store
    return subprocess.run(
        [sys.executable, "-m", "agentspec.cli.sessions", *args],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
    )


def test_cli_list_show_export_delete(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with SessionStore(path) as store:
        store.append_turn(SessionRef("chat", tenant="acme", agent="coder"), [1, 2, 3])
        store.append_turn(SessionRef("chat", tenant="acme", agent="coder"), [4])
        store.append_turn(SessionRef("solo"), [5])
    db = str(path)
    out = _cli(tmp_path, "list", "--store", db)
    assert out.returncode == 0, out.stderr
    assert "acme/coder/chat" in out.stdout and "default/default/solo" in out.stdout
    out = _cli(tmp_path, "--store", db, "list", "--tenant", "acme", "--json")
    assert [s["session_id"] for s in json.loads(out.stdout)] == ["chat"]
    out = _cli(tmp_path, "--store", db, "show", "acme/coder/chat", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["tokens"] == 4
    out = _cli(tmp_path, "--store", db, "export", "acme/coder/chat")
    assert json.loads(out.stdout)["turns"] == [[1, 2, 3], [4]]
    target = tmp_path / "export.json"
    out = _cli(tmp_path, "--store", db, "export", "solo", "--out", str(target))
    assert out.returncode == 0 and json.loads(target.read_text())["turns"] == [[5]]
    out = _cli(tmp_path, "--store", db, "stats", "--json")
    assert json.loads(out.stdout)["sessions"] == 2
    out = _cli(tmp_path, "--store", db, "delete", "solo")
    assert out.returncode == 0 and "deleted default/default/solo" in out.stdout
    with SessionStore(path) as store:
        assert [s.session_id for s in store.list_sessions()] == ["chat"]


def test_cli_errors_exit_2_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    SessionStore(path).close()
    cases = {
        ("show", "acme/coder/nope"): "no session acme/coder/nope in",
        ("delete", "nope"): "no session default/default/nope in",
        ("export", "nope"): "no session default/default/nope in",
        ("show", "a/b"): "write TENANT/AGENT/SESSION",
        ("show", "bad id!"): "invalid session id",
    }
    for args, message in cases.items():
        out = _cli(tmp_path, "--store", str(path), *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    out = _cli(tmp_path, "--store", str(tmp_path / "typo.db"), "list")
    assert out.returncode == 2 and "no session store at" in out.stderr
    path.write_bytes(random.Random(3).randbytes(8192))
    out = _cli(tmp_path, "--store", str(path), "list")
    assert out.returncode == 2 and "is corrupt" in out.stderr and "--recover" in out.stderr
    out = _cli(tmp_path, "--store", str(path), "--recover", "stats", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["recovered"] is True
    assert "moved it to" in out.stderr


def test_the_whole_store_is_bounded_in_tokens_and_the_heaviest_tenant_pays(
    tmp_path: Path,
) -> None:
    """``max_total_tokens`` bounds the file's size; the tenant holding the most tokens loses
    its least recently used sessions, a light tenant keeps its history."""
    cfg = StoreConfig(max_total_tokens=1000)
    with SessionStore(tmp_path / "s.sqlite3", cfg) as store:
        light = SessionRef("l1", tenant="light")
        store.append_turn(light, list(range(100)))
        for i in range(12):
            store.append_turn(SessionRef(f"h{i}", tenant="heavy"), list(range(150)))
            assert store.stats()["tokens"] <= 1000
        assert store.load(light) == [list(range(100))]
        kept = {s.session_id for s in store.list_sessions("heavy")}
        assert kept == {f"h{i}" for i in range(6, 12)}  # the newest: 6 x 150 + 100 <= 1000
    with pytest.raises(ConfigError, match="max_total_tokens"):
        StoreConfig(max_total_tokens=0)


def test_store_files_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    """Every tenant's token ids are in the file: created 0600 in a 0700 folder whatever
    the umask (SQLite gives the WAL the file's mode); an existing 0644 file is tightened."""
    old = os.umask(0o022)
    try:
        path = tmp_path / "home" / "sub" / "s.sqlite3"
        with SessionStore(path) as store:
            store.append_turn(SessionRef("s"), [1, 2, 3])
            for f in (path, Path(f"{path}-wal")):
                assert f.stat().st_mode & 0o777 == 0o600, f
        for folder in (tmp_path / "home", tmp_path / "home" / "sub"):
            assert folder.stat().st_mode & 0o777 == 0o700
        os.chmod(path, 0o644)
        with SessionStore(path) as store:
            assert store.load(SessionRef("s")) == [[1, 2, 3]]
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)
