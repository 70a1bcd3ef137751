"""The GPU check's real runner (workflows.bench.gpu_check.runner.SubprocessRunner) on small
shell commands: exit codes, captured output, logs, and ``timeout --kill-after``'s codes at
the limit (124 after SIGTERM, 137 when it had to SIGKILL), for the whole process group."""

from __future__ import annotations

import time
from pathlib import Path

from workflows.bench.gpu_check.runner import SubprocessRunner, timed_out


def test_exit_code_capture_and_stdin() -> None:
    run = SubprocessRunner()
    assert run(["sh", "-c", "exit 3"]).rc == 3
    got = run(["sh", "-c", "echo out; echo err >&2"], capture=True)
    assert (got.rc, got.out) == (0, "out\n")
    assert run(["sh", "-c", "cat"], capture=True, stdin="fed\n").out == "fed\n"
    assert run(["sh", "-c", "echo $GPU_CHECK_X"], capture=True,
               env={"GPU_CHECK_X": "y", "PATH": "/usr/bin:/bin"}).out == "y\n"


def test_a_log_gets_both_streams_appended(tmp_path: Path) -> None:
    log = tmp_path / "step.log"
    log.write_text("# the command\n")
    got = SubprocessRunner()(["sh", "-c", "echo out; echo err >&2; exit 1"], log=log)
    assert got.rc == 1 and got.out == ""
    assert log.read_text() == "# the command\nout\nerr\n"


def test_a_missing_command_is_127() -> None:
    assert SubprocessRunner()(["/nonexistent/gpu-check-python"]).rc == 127


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_the_limit_ends_the_process_group_with_124(tmp_path: Path) -> None:
    # A child that starts a grandchild: both are gone after the limit.
    pid_file = tmp_path / "pid"
    t0 = time.monotonic()
    got = SubprocessRunner()(["sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait"],
                             limit_s=0.5)
    assert got.rc == 124 and timed_out(got.rc)
    assert time.monotonic() - t0 < 3
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 2
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_a_command_that_ignores_sigterm_is_killed_with_137() -> None:
    run = SubprocessRunner(kill_after_s=0.3)
    t0 = time.monotonic()
    got = run(["sh", "-c", "trap '' TERM; sleep 5"], limit_s=0.3)
    assert got.rc == 137 and timed_out(got.rc)
    assert time.monotonic() - t0 < 3
