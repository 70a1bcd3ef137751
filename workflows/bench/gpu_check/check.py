"""The check from start to end: setup, the planned steps with their retries, the summary.

:class:`GpuCheck` takes its runner, clock and environment as arguments, so tests run the
whole sequence with fakes; :func:`main` is ``python -m workflows.bench.gpu_check``. What it
leaves in ``OUT_DIR`` is what ``workflows.report.gpu_check`` reads: ``env.txt``,
``steps.tsv`` (one line a step: :data:`~workflows.report.gpu_check.STEP_FIELDS`), a log per
step and the steps' results.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType

from workflows.bench.gpu_check.commands import Commands, should_retry
from workflows.bench.gpu_check.head import head_path, swap_head
from workflows.bench.gpu_check.interpreter import (
    DEVICE_COMMANDS,
    STAGE,
    SetupError,
    Which,
    pick_python,
    probe,
    staged_env,
)
from workflows.bench.gpu_check.plan import Plan, make_plan
from workflows.bench.gpu_check.runner import Runner, SubprocessRunner, timed_out
from workflows.bench.gpu_check.settings import SettingError, Settings
from workflows.report.gpu_check import STEP_FIELDS

#: The checkout's root: the steps' commands name files relative to it.
ROOT = Path(__file__).resolve().parents[3]
#: Seconds the summary may take.
SUMMARY_LIMIT_S = 60


def say(message: str) -> None:
    """Print one progress line (flushed: the steps write to the same terminal)."""
    print(f"gpu_check: {message}", flush=True)


def clear_results(out_dir: Path, keep: bool) -> None:
    """Delete the last run's bookkeeping, and its results unless ``keep``.

    Args:
        out_dir: The results folder.
        keep: Keep the results (and logs) of steps this run does not repeat (``KEEP=1``).
    """
    doomed = [out_dir / n for n in ("steps.tsv", "env.txt", "summary.json")]
    if not keep:
        for pattern in ("bench-*.json", "bench-*.jsonl", "drive.json", "bench-*.log",
                        "drive*.log"):
            doomed += out_dir.glob(pattern)
    for path in doomed:
        path.unlink(missing_ok=True)


def last_line(log: Path) -> str:
    """The last non-empty line of ``log``'s last 2,000 bytes (a progress bar's ``\\r``
    updates count as lines), cut to 200 characters: the note of a step that failed."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - 2000))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [ln for ln in text.replace("\r", "\n").split("\n") if ln.strip()]
    return lines[-1][:200] if lines else ""


class GpuCheck:
    """One run of the check.

    Args:
        settings: The knobs.
        runner: Starts every process.
        clock: Seconds, monotonic.
        env: The environment the check starts in (the steps get it plus the staged
            wheels' and agentspec's variables).
        which: Finds a command on ``PATH``.
        stage: Where staged wheels leave ``env.sh``.
    """

    def __init__(self, settings: Settings, runner: Runner,
                 clock: Callable[[], float] = time.monotonic,
                 env: Mapping[str, str] | None = None, which: Which = shutil.which,
                 stage: Path = STAGE) -> None:
        self.settings, self.run, self.clock, self.which = settings, runner, clock, which
        self.env = dict(os.environ if env is None else env)
        self.stage = stage
        self.t0 = clock()
        self.any_bad = False
        self.deadline_s = settings.deadline_s  # plus a venv build's time, once known

    def elapsed(self) -> int:
        """Whole seconds since the check started."""
        return int(self.clock() - self.t0)

    def record(self, name: str, status: str, rc: int | str, seconds: int, limit: int,
               note: str = "") -> None:
        """Append a step's line to ``steps.tsv``; any status but ``ok`` makes the exit 1."""
        row = dict(zip(STEP_FIELDS, (name, status, rc, seconds, limit,
                                     note.replace("\t", " ")), strict=True))
        with (self.settings.out_dir / "steps.tsv").open("a") as f:
            f.write("\t".join(str(row[k]) for k in STEP_FIELDS) + "\n")
        self.any_bad |= status != "ok"

    def run_step(self, name: str, limit: int, argv: Sequence[str]) -> int:
        """Run one step within ``limit`` seconds, logged to ``<name>.log``, and record it.

        Args:
            name: The step's name (``bench-fp32-retry`` for a retry).
            limit: Seconds it may run; below ``MIN_STEP_S`` it is skipped.
            argv: Its command.

        Returns:
            Its exit code (124 / 137: cut at the limit); -1 when it was skipped.
        """
        s = self.settings
        if limit < s.min_step_s:
            why = (f"only {limit} s left before the deadline (MIN_STEP_S={s.min_step_s})"
                   if limit > 0 else f"the deadline ({self.deadline_s} s) has passed")
            say(f"[{name}] skipped: {why}")
            self.record(name, "skipped", "", 0, limit, why)
            return -1
        command = " ".join(argv)
        say(f"[{name}] limit {limit} s: {command}")
        log = s.out_dir / f"{name}.log"
        log.write_text(f"# {command}\n")
        t0 = self.elapsed()
        rc = self.run(argv, limit_s=limit, log=log, env=self.env).rc
        took = self.elapsed() - t0
        status = "ok" if rc == 0 else "timeout" if timed_out(rc) else "failed"
        note = "" if status == "ok" else last_line(log)
        say(f"[{name}] {status} (exit {rc}) after {took} s")
        if note:
            print(f"    {note}", file=sys.stderr, flush=True)
        self.record(name, status, rc, took, limit, note)
        return rc

    def run_plan(self, plan: Plan, commands: Commands) -> None:
        """Run the planned steps in order, each within its limit, a crashed one retried
        once with its fallback methods in the time the later steps do not need."""
        for i, name in enumerate(plan.names):
            step = commands.for_step(name)
            for path in step.stale:
                path.unlink(missing_ok=True)
            rc = self.run_step(name, plan.limit_for(i, self.elapsed()), step.argv)
            log = self.settings.out_dir / f"{name}.log"
            if step.retry_argv is not None and should_retry(self.settings.retry, rc, step, log):
                self.run_step(f"{name}-retry", plan.slack_for(i, self.elapsed()),
                              step.retry_argv)

    def summary(self, py: str) -> None:
        """Print the summary table (``workflows.report.gpu_check``; it writes
        ``summary.json``); a summary that fails makes the exit 1."""
        say(f"steps done after {self.elapsed()} s; summary:")
        print(flush=True)
        argv = [py, "-m", "workflows.report.gpu_check", str(self.settings.out_dir)]
        if self.run(argv, limit_s=SUMMARY_LIMIT_S, env=self.env).rc != 0:
            print("gpu_check: the summary failed", file=sys.stderr, flush=True)
            self.any_bad = True

    def _gpu(self) -> str:
        if self.settings.device != "cuda":
            return ""
        if self.which("nvidia-smi") is None:
            raise SetupError("no NVIDIA driver (nvidia-smi not found); this check needs a "
                             "CUDA GPU (DEVICE=cpu runs the flow)")
        got = self.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                        "--format=csv,noheader"], limit_s=30, capture=True)
        gpu = (got.out.splitlines() or [""])[0].strip()
        if not gpu:
            raise SetupError("nvidia-smi lists no GPU")
        say(gpu)
        return gpu

    def _setup_env(self, py: str) -> None:
        staged = staged_env(self.run, py, self.env, self.which, self.stage)
        if staged is not None:
            self.env = staged
            say(f"sourced {self.stage / 'env.sh'} (PYTHONPATH={self.env.get('PYTHONPATH', '')})")
        self.env["AGENTSPEC_HOME"] = (self.env.get("AGENTSPEC_HOME")
                                      or str(Path.cwd() / ".cache" / "agentspec"))
        self.env.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")

    def execute(self) -> int:
        """The whole check.

        Returns:
            0 every step ok; 1 a step failed, ran out of time or was skipped, or the
            summary failed.

        Raises:
            SetupError: No GPU, no usable Python, no ``HEAD`` file or an unknown dtype.
        """
        s = self.settings
        try:
            s.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SetupError(f"cannot create {s.out_dir}") from e
        clear_results(s.out_dir, s.keep)
        gpu = self._gpu()
        picked = pick_python(self.run, s, self.clock, say, self.which)
        self._setup_env(picked.py)
        found = probe(self.run, picked.py, s.device, self.env)
        say(f"python {picked.py}: {found.stack}")
        env_txt = [f"device={s.device}", f"gpu={gpu or 'none'}", f"python={picked.py}",
                   f"stack={found.stack}", f"deadline_s={s.deadline_s}"]
        env_txt += [f"head={s.head}"] if s.head else []
        for command in DEVICE_COMMANDS:
            if command not in found.device_flag:
                say(f"note: agentspec {command} has no --device flag: it picks CUDA whenever "
                    "torch sees one")
                env_txt.append(f"note_{command}=no --device flag")
        (s.out_dir / "env.txt").write_text("".join(f"{ln}\n" for ln in env_txt))
        self.deadline_s = s.deadline_s + picked.build_s
        try:
            plan = make_plan(s.steps, s.dtypes, self.deadline_s, s.reserve_s, s.shares)
        except ValueError as e:
            raise SetupError(str(e)) from None
        with contextlib.ExitStack() as stack:
            if s.head:
                try:
                    dest = stack.enter_context(swap_head(
                        Path(s.head), head_path(Path(self.env["AGENTSPEC_HOME"]),
                                                s.head_model)))
                except OSError as e:
                    raise SetupError(str(e)) from e
                say(f"EAGLE head: {s.head} as {dest}")
            if not plan.steps:
                say(f"note: STEPS='{s.steps}' and DTYPES='{s.dtypes}' select no step")
            say(f"plan: {' '.join(plan.names) or 'nothing'} within "
                f"{self.deadline_s - self.elapsed()} s (deadline {self.deadline_s} s)")
            self.run_plan(plan, Commands(s, picked.py, found.device_flag))
            self.summary(picked.py)
        say(f"total {self.elapsed()} s; results in {s.out_dir}")
        return 1 if self.any_bad else 0


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through swap_head's restore


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m workflows.bench.gpu_check``: run the check from the checkout's root.

    Args:
        argv: ``-h`` / ``--help`` prints the knobs; nothing else is taken (the knobs are
            environment variables).

    Returns:
        The exit code: 0 all ok, 1 a step not ok, 2 no GPU, no usable Python or a bad knob.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"]):
        from workflows.bench import gpu_check

        print(gpu_check.__doc__)
        return 0
    if args:
        print(f"gpu_check: FAIL: no arguments are taken ({' '.join(args)}); the knobs are "
              "environment variables (--help lists them)", file=sys.stderr)
        return 2
    os.chdir(ROOT)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return GpuCheck(Settings.from_env(os.environ), SubprocessRunner()).execute()
    except (SetupError, SettingError) as e:
        print(f"gpu_check: FAIL: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("gpu_check: interrupted", file=sys.stderr, flush=True)
        return 130
