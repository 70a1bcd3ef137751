"""InstructEdit-style code edits (EditEval): one request per row, graded by its tests.

Each request gives the model an instruction and a piece of code and asks for the full edited
code in a ```python block. :meth:`EditSession.turn_metrics` extracts that code and runs the
row's ``check()`` function against it in an isolated subprocess.

How a row is tested (as in InstructCoder's ``edit_eval``): the row's ``context`` is a program
template in which every ``{{Code}}`` is replaced by the edited code (some templates also bind
it to a string ``edited_code`` so a test can assert on the source text); an empty context
means the program is just the code. The row's ``test`` (a ``def check(): ...``) is appended,
followed by a call ``check()``. The program passes when it exits with status 0 within the
timeout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentspec.errors import BenchmarkError
from workflows.workloads.base import WorkloadRequest
from workflows.workloads.datasets import EditTask, load_editeval
from workflows.workloads.datasets import data_dir as resolve_data_dir
from workflows.workloads.delegate52 import estimate_tokens

CODE_PLACEHOLDER = "{{Code}}"
DEFAULT_TIMEOUT_S = 5.0
_MEMORY_LIMIT = 1 << 30  # 1 GiB: a runaway edit must not take the benchmark machine down

# The memory limit is set by a tiny bootstrap inside the child rather than by preexec_fn,
# which is unsafe in a parent with threads (torch has several).
_BOOT = """\
try:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
except (ImportError, ValueError, OSError):
    pass
import runpy
runpy.run_path({script!r}, run_name="__main__")
"""

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL)

PROMPT = (
    "{instruction}\n\n```python\n{code}\n```\n\n"
    "Apply the instruction to the code above. Output the full edited code in a ```python block."
)


@dataclass(frozen=True)
class TestOutcome:
    """Result of running one row's tests.

    Attributes:
        passed: The program exited with status 0 in time.
        error: Why it failed (last line of stderr, ``"timeout"``, ...) or ``None``.
        seconds: Wall-clock time of the subprocess.
    """

    __test__ = False  # not a pytest test class, despite the name

    passed: bool
    error: str | None
    seconds: float


def extract_code(output: str) -> str | None:
    """The code a model answer holds.

    Prefers the first ```python block, then the first fenced block of any language, then
    (for models that forget fences) the whole answer. A block cut off by the token limit
    counts up to the end of the text.

    Args:
        output: The model's answer.

    Returns:
        The code, or ``None`` when the answer is blank.
    """
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE_RE.finditer(output)]
    for lang, body in blocks:
        if lang in ("python", "py", "python3"):
            return body
    if blocks:
        return blocks[0][1]
    stripped = output.strip()
    return stripped or None


def build_program(task: EditTask, code: str) -> str:
    """The test program for ``code``: context template, the row's test, then ``check()``.

    Args:
        task: The row (its ``context`` and ``test``).
        code: The edited code to test.

    Returns:
        Python source that exits with status 0 exactly when the tests pass.
    """
    body = task.context.replace(CODE_PLACEHOLDER, code) if task.context.strip() else code
    return f"{body}\n\n\n{task.test}\n\n\ncheck()\n"


def run_test(task: EditTask, code: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> TestOutcome:
    """Run a row's tests against ``code`` in an isolated subprocess.

    The program runs with ``python -I`` (no user site, no ``PYTHON*`` variables, script dir
    not on ``sys.path``) in a fresh temporary folder, with a minimal environment, a memory
    limit where the platform allows one, and its own process group so a timeout kills
    everything it started.

    Args:
        task: The row whose ``test`` to run.
        code: The edited code.
        timeout_s: Wall-clock limit in seconds.

    Returns:
        The outcome; never raises for failures of the code under test.
    """
    program = build_program(task, code)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="agentspec-editeval-") as tmp:
        script = Path(tmp) / "candidate.py"
        script.write_text(program, encoding="utf-8")
        boot = Path(tmp) / "boot.py"
        boot.write_text(_BOOT.format(limit=_MEMORY_LIMIT, script=str(script)), encoding="utf-8")
        env = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        proc = subprocess.Popen(
            [sys.executable, "-I", str(boot)],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return TestOutcome(False, f"timeout after {timeout_s:g} s", time.perf_counter() - start)
    seconds = time.perf_counter() - start
    if proc.returncode == 0:
        return TestOutcome(True, None, seconds)
    lines = [ln for ln in stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
    error = lines[-1].strip()[:300] if lines else f"exit status {proc.returncode}"
    return TestOutcome(False, error, seconds)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


class EditSession:
    """One EditEval row as a one-turn session.

    Args:
        task: The row.
        max_tokens: Generation budget of the request.
        timeout_s: Test timeout in seconds.
    """

    def __init__(self, task: EditTask, max_tokens: int, timeout_s: float) -> None:
        self.task = task
        # Session ids allow [A-Za-z0-9_.:@-]; task ids look like "EditEval/12".
        self.session_id = "editeval-" + re.sub(r"[^A-Za-z0-9_.:@-]+", "-", task.task_id)
        self._max_tokens = max_tokens
        self._timeout_s = timeout_s
        self._done = False
        self.turns = 1  # requests this session will make

    def next_request(self, last_output: str | None) -> WorkloadRequest | None:
        """The single request of the session (``None`` afterwards)."""
        if self._done:
            return None
        self._done = True
        prompt = PROMPT.format(instruction=self.task.instruction.strip(), code=self.task.input)
        return WorkloadRequest(
            messages=[{"role": "user", "content": prompt}],
            max_tokens=self._max_tokens,
            meta={"task_id": self.task.task_id},
        )

    def turn_metrics(self, request: WorkloadRequest, output: str) -> dict[str, Any]:
        """Extract the code and run the row's tests on it.

        Returns:
            ``{"tests_passed": bool, "error": str | None, "code_found": bool,
            "test_seconds": float}``.
        """
        code = extract_code(output)
        if code is None:
            return {"tests_passed": False, "error": "no code in output", "code_found": False,
                    "test_seconds": 0.0}
        outcome = run_test(self.task, code, self._timeout_s)
        return {"tests_passed": outcome.passed, "error": outcome.error, "code_found": True,
                "test_seconds": round(outcome.seconds, 3)}


class InstructEditWorkload:
    """EditEval instruction-driven code edits: one single-turn session per row.

    Args:
        data_dir: Data folder (``None``: ``$AGENTSPEC_DATA`` or the packaged fixture).
        max_tokens: Upper bound of a request's budget (``None``: no bound); see
            :meth:`budget`.
        timeout_s: Wall-clock limit of one test run.
    """

    name = "editeval"

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        max_tokens: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.tasks = load_editeval(resolve_data_dir(data_dir))
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s

    def budget(self, task: EditTask) -> int:
        """Generation budget for one row: twice the input's tokens plus 64, at least 192.

        Tokens are estimated with :func:`workflows.workloads.delegate52.estimate_tokens`. The floor
        leaves room for edits that grow the code ("finish the function": the fixture's
        references reach ~210 tokens) and for the fences.
        """
        need = max(192, 2 * estimate_tokens(task.input) + 64)
        return need if self.max_tokens is None else min(need, self.max_tokens)

    def sessions(self, limit: int | None, turns: int) -> Iterator[EditSession]:
        """Fresh one-turn sessions, one per row (at most ``limit``; ``turns`` is ignored).

        Raises:
            BenchmarkError: ``turns`` < 1 or ``limit`` < 0.
        """
        if turns < 1 or (limit is not None and limit < 0):
            raise BenchmarkError(f"need turns >= 1 and limit >= 0, got {turns=} {limit=}")
        tasks = self.tasks if limit is None else self.tasks[:limit]
        for task in tasks:
            yield EditSession(task, self.budget(task), self.timeout_s)
