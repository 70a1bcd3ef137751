"""The fault suite: the server killed mid-stream, and stopped by SIGTERM, loses no turn.

A real server process (:mod:`fault_server`: the real app, a real SQLite session store, a
scripted model that streams slowly enough to be interrupted) serves several concurrent
streaming clients, each in its own session. A turn is *acknowledged* when its client read
the whole stream up to ``[DONE]``.

* SIGKILL while streams are in flight, twice, restarting on the same file each time: every
  acknowledged turn is in the store after the restart, in order. (A turn whose answer was
  cut off may or may not be stored, at most one per session: the one in flight.)
* SIGTERM after a run of turns that live only in the write-ahead log: the server exits 0,
  and a copy of ``sessions.sqlite3`` alone, without its ``-wal``, holds every acknowledged
  turn (read with Python's sqlite3 and, where installed, the ``sqlite3`` shell).
* SIGTERM while a stream is being sent: the stream runs to ``[DONE]`` (drained, not cut).

Waits poll with generous deadlines; nothing here asserts how long anything took.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SERVER = Path(__file__).resolve().parent / "fault_server.py"
CLIENTS = 4
# uvicorn re-raises the signal after its graceful shutdown, so a clean SIGTERM exit reads as
# -SIGTERM (or 0 with older versions); the store checks below prove the shutdown was clean.
CLEAN_TERM = (0, -signal.SIGTERM)


class Server:
    """The fault server as a child process; each start listens on a fresh loopback port."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        # The test binds the socket (no port race) and hands it over; once the child holds
        # it the test closes its copy, so after a kill new connections are refused at once.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)
            self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            self.proc = subprocess.Popen(
                [sys.executable, str(SERVER), str(self.store), str(sock.fileno())],
                pass_fds=[sock.fileno()], cwd=ROOT, env=env, text=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the fault server did not start"
            time.sleep(0.1)

    def signal(self, sig: int, wait: bool = True) -> int | None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.wait() if wait else None

    def wait(self) -> int:
        """Wait for the process to exit; its exit code."""
        assert self.proc is not None
        code = self.proc.wait(timeout=120)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None
        return code

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path / "sessions.sqlite3")
    try:
        yield srv
    finally:
        srv.close()


def _stream_turn(url: str, session: str, text: str) -> list[int] | None:
    """One streamed turn; its stored form (code points) if the client read it to [DONE]."""
    body = {"model": "fake-model", "stream": True, "max_tokens": 2048,
            "messages": [{"role": "user", "content": text}]}
    parts: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60,
                          headers={"X-Session-Id": session}) as resp:
            if resp.status_code != 200:
                return None
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    return [ord(c) for c in "".join(parts)]
                if line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        parts.append(chunk["choices"][0]["delta"].get("content") or "")
    except httpx.HTTPError:
        return None
    return None  # the stream ended without [DONE]: not acknowledged


def _clients(url: str, acked: dict[str, list[list[int]]], stop: threading.Event,
             tag: str) -> list[threading.Thread]:
    """CLIENTS threads streaming turns until ``stop``; acknowledged turns go to ``acked``."""

    def run(c: int) -> None:
        session, k = f"sess-{c}", 0
        while not stop.is_set():
            k += 1
            got = _stream_turn(url, session, f"{tag} client {c} turn {k} " + "x" * 150)
            if got is None:
                return  # the server went away mid-turn: this client's round is over
            acked[session].append(got)

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    return threads


def _stored(path: Path) -> dict[str, list[list[int]]]:
    """Every session's turns, read straight from the file with Python's sqlite3."""
    import struct

    out: dict[str, list[list[int]]] = {}
    conn = sqlite3.connect(path)
    with conn:
        rows = conn.execute("SELECT s.session_id, t.n, t.data FROM turns t JOIN sessions s "
                            "ON s.id = t.session ORDER BY s.session_id, t.idx").fetchall()
    conn.close()
    for sid, n, data in rows:
        out.setdefault(sid, []).append(list(struct.unpack(f"<{n}i", data)))
    return out


def _assert_acked_present(stored: dict[str, list[list[int]]],
                          acked: dict[str, list[list[int]]]) -> None:
    for session, turns in acked.items():
        have = stored.get(session, [])
        it = iter(have)
        assert all(any(t == h for h in it) for t in turns), (
            f"{session}: an acknowledged turn is missing ({len(turns)} acked, "
            f"{len(have)} stored)")
        # Beyond the acknowledged turns only the one cut off by the kill may be stored.
        assert len(have) - len(turns) <= 1, (session, len(have), len(turns))


def test_sigkill_during_concurrent_streams_keeps_every_acknowledged_turn(
        server: Server) -> None:
    acked: dict[str, list[list[int]]] = {f"sess-{c}": [] for c in range(CLIENTS)}
    for round_ in range(2):
        server.start()
        stop = threading.Event()
        before = sum(map(len, acked.values()))
        threads = _clients(server.url, acked, stop, f"round {round_}")
        deadline = time.monotonic() + 120
        # Kill once every client has finished a turn this round and streams are in flight.
        while sum(map(len, acked.values())) < before + 2 * CLIENTS:
            assert time.monotonic() < deadline, "the clients made no progress"
            time.sleep(0.05)
        stop.set()  # no new turns; the ones in flight are cut by the kill
        assert server.signal(signal.SIGKILL) == -signal.SIGKILL
        for t in threads:
            t.join(timeout=60)
        _assert_acked_present(_stored(server.store), acked)
    server.start()  # the store opens cleanly after the last kill and keeps serving
    assert _stream_turn(server.url, "sess-0", "after the kills") is not None
    assert server.signal(signal.SIGTERM) in CLEAN_TERM
    assert sum(map(len, acked.values())) >= 4 * CLIENTS


def test_sigterm_leaves_every_acknowledged_turn_in_the_main_file(
        server: Server, tmp_path: Path) -> None:
    server.start()
    acked: dict[str, list[list[int]]] = {f"sess-{c}": [] for c in range(CLIENTS)}
    stop = threading.Event()
    threads = _clients(server.url, acked, stop, "term")
    deadline = time.monotonic() + 120
    while sum(map(len, acked.values())) < 3 * CLIENTS:
        assert time.monotonic() < deadline, "the clients made no progress"
        time.sleep(0.05)
    # The WAL-only state: the main file alone does not hold these turns yet.
    early = tmp_path / "early" / "sessions.sqlite3"
    early.parent.mkdir()
    shutil.copy(server.store, early)
    with sqlite3.connect(early) as conn:  # the schema itself may still be in the WAL only
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()
    early_turns = sum(map(len, _stored(early).values())) if "turns" in tables else 0
    assert early_turns < sum(map(len, acked.values()))
    # SIGTERM with streams in flight: uvicorn drains them, then the app closes the store.
    stop.set()
    assert server.signal(signal.SIGTERM) in CLEAN_TERM
    for t in threads:
        t.join(timeout=60)
    alone = tmp_path / "alone" / "sessions.sqlite3"
    alone.parent.mkdir()
    shutil.copy(server.store, alone)  # the main file only: no -wal, no -shm beside it
    stored = _stored(alone)
    _assert_acked_present(stored, acked)
    # Drained, not cut: every stream in flight at SIGTERM was answered and stored.
    assert sum(map(len, stored.values())) == sum(map(len, acked.values()))
    if shutil.which("sqlite3"):  # the operator's view, where the shell is installed
        out = subprocess.run(["sqlite3", str(alone), "SELECT COUNT(*) FROM turns"],
                             capture_output=True, text=True, check=True)
        assert int(out.stdout) == sum(map(len, acked.values()))


def test_sigterm_drains_a_stream_already_being_sent(server: Server) -> None:
    # sse-starlette cuts open streams when uvicorn begins to exit unless told otherwise; the
    # turns test above cannot tell (a cut turn is neither acknowledged nor stored).
    server.start()
    text = "drain " + "x" * 1500  # ~500 deltas of 4 ms: the stream outlives the signal
    body = {"model": "fake-model", "stream": True, "max_tokens": 2048,
            "messages": [{"role": "user", "content": text}]}
    events: list[str] = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60,
                      headers={"X-Session-Id": "drain"}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            events.append(line)
            if '"content":"' in line and '"role"' not in line:
                break  # the answer is being sent
        server.signal(signal.SIGTERM, wait=False)
        events.extend(lines)
    assert server.wait() in CLEAN_TERM
    data = [e[6:] for e in events if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    content = "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                      for d in data[:-1] if json.loads(d)["choices"])
    assert content == f"You said: {text}"
    assert _stored(server.store)["drain"] == [[ord(c) for c in content]]
