"""Running a command under a time limit: the one place the check starts processes.

The check takes a :class:`Runner`, so tests drive it with a fake that records the commands
and answers with scripted exit codes; :class:`SubprocessRunner` is the real one. It behaves
as GNU ``timeout --kill-after=5`` did in the shell script: the command runs in its own
process group; at the limit the group gets SIGTERM and, 5 s later, SIGKILL; the exit code
is then 124 (ended after SIGTERM) or 137 (killed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

#: Exit codes of a command cut at its time limit (SIGTERM'd, or SIGKILL'd after the grace).
TIMEOUT_CODES = (124, 137)
#: Exit codes for a command that could not be started (not found, not executable).
NOT_FOUND, NOT_EXECUTABLE = 127, 126


def timed_out(rc: int) -> bool:
    """Whether exit code ``rc`` says the command was cut at its time limit."""
    return rc in TIMEOUT_CODES


@dataclass(frozen=True)
class Outcome:
    """How a command ended.

    Attributes:
        rc: Its exit code (124 / 137: cut at the limit; 127: not found).
        out: Its standard output when captured, else empty.
    """

    rc: int
    out: str = ""


class Runner(Protocol):
    """Runs one command; the check's only way to start a process."""

    def __call__(self, argv: Sequence[str], *, limit_s: float | None = None,
                 log: Path | None = None, capture: bool = False, stdin: str | None = None,
                 env: Mapping[str, str] | None = None) -> Outcome:
        """Run ``argv`` and wait for it.

        Args:
            argv: The command and its arguments.
            limit_s: Seconds it may run; None: no limit.
            log: A file its standard output and error are appended to.
            capture: Return its standard output (when ``log`` is None); its standard error
                goes to the check's.
            stdin: Text fed to its standard input; None: an empty input.
            env: Its environment; None: the check's.

        Returns:
            Its exit code, and its output when captured.
        """
        ...


class SubprocessRunner:
    """The real :class:`Runner`: ``subprocess`` with a process-group time limit.

    Args:
        kill_after_s: Seconds between SIGTERM and SIGKILL at the limit.
    """

    def __init__(self, kill_after_s: float = 5.0) -> None:
        self.kill_after_s = kill_after_s

    def __call__(self, argv: Sequence[str], *, limit_s: float | None = None,
                 log: Path | None = None, capture: bool = False, stdin: str | None = None,
                 env: Mapping[str, str] | None = None) -> Outcome:
        """Run ``argv``; see :meth:`Runner.__call__`."""
        sink: IO[bytes] | None = log.open("ab") if log is not None else None
        out: Any = sink if sink is not None else (subprocess.PIPE if capture else None)
        try:
            try:
                proc = subprocess.Popen(
                    list(argv), stdout=out, stderr=subprocess.STDOUT if sink else None,
                    stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                    env=dict(env) if env is not None else None, start_new_session=True)
            except FileNotFoundError:
                return Outcome(NOT_FOUND)
            except PermissionError:
                return Outcome(NOT_EXECUTABLE)
            data = stdin.encode() if stdin is not None else None
            rc, got = self._wait(proc, data, limit_s)
        finally:
            if sink is not None:
                sink.close()
        return Outcome(rc, (got or b"").decode(errors="replace"))

    def _wait(self, proc: subprocess.Popen[bytes], data: bytes | None,
              limit_s: float | None) -> tuple[int, bytes | None]:
        """Wait for ``proc`` within ``limit_s``; end its group at the limit or on an
        interrupt of the check itself (Ctrl-C, SIGTERM), which is raised on."""
        try:
            try:
                got, _ = proc.communicate(data, timeout=limit_s)
                return proc.returncode, got
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGTERM)
            try:
                got, _ = proc.communicate(timeout=self.kill_after_s)
                return TIMEOUT_CODES[0], got
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                got, _ = proc.communicate()
                return TIMEOUT_CODES[1], got
        except BaseException:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
            raise


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
