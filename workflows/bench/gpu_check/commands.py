"""The steps' commands, the files each one owns, and when a failed one is retried.

A bench or drive step has a retry command: the same run with the methods that need no EAGLE
head (``FALLBACK_METHODS`` / ``FALLBACK_DRIVE_METHODS``), writing the same results file. The
profile step has none, nor has a step whose methods are the fallback already.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from workflows.bench.gpu_check.runner import timed_out
from workflows.bench.gpu_check.settings import Settings

#: What a drive prints when it ran to the end and its variants gave different tokens: a
#: finding to report, not a crash to retry.
DISAGREE = "variants disagree"


@dataclass(frozen=True)
class StepCommand:
    """One step's command line, and its retry's.

    Attributes:
        argv: The command.
        retry_argv: The retry's command; None when there is no retry.
        stale: Files to delete before the step runs (its earlier results and logs).
    """

    argv: tuple[str, ...]
    retry_argv: tuple[str, ...] | None
    stale: tuple[Path, ...]


@dataclass(frozen=True)
class Commands:
    """Builds the steps' commands for one check.

    Attributes:
        settings: The check's knobs.
        py: The steps' Python.
        device_flag: The sub-commands that take ``--device`` (the probe's finding).
    """

    settings: Settings
    py: str
    device_flag: tuple[str, ...] = ("bench", "drive")

    def _device(self, command: str) -> list[str]:
        return ["--device", self.settings.device] if command in self.device_flag else []

    def _model(self) -> list[str]:
        return ["--model", self.settings.model] if self.settings.model else []

    def _bench(self, name: str, methods: str) -> tuple[str, ...]:
        s = self.settings
        dtype, extra = (("float32", ()) if name == "bench-fp32"
                        else ("bfloat16", s.bf16_args))
        return (self.py, "-m", "agentspec.cli", "bench", "--quick", "--workloads",
                s.workloads, "--methods", methods, *self._device("bench"), "--dtype", dtype,
                *self._model(), "--no-progress", *extra, *s.extra_bench_args,
                "--out", str(s.out_dir / f"{name}.json"))

    def _drive(self, methods: str) -> tuple[str, ...]:
        s = self.settings
        return (self.py, "-m", "agentspec.cli", "drive", "--methods", methods, "--reuse", "on",
                "--turns", "10", "--max-prompt", "4096", "--max-tokens", "64",
                *self._device("drive"), *self._model(), *s.extra_drive_args,
                "--out", str(s.out_dir / "drive.json"))

    def for_step(self, name: str) -> StepCommand:
        """The command of step ``name``, its retry's, and the files it replaces.

        Args:
            name: ``bench-fp32``, ``bench-bf16-a``, ``bench-bf16-b``, ``drive`` or
                ``profile``.

        Returns:
            The step's command.

        Raises:
            ValueError: ``name`` is no step.
        """
        s, out = self.settings, self.settings.out_dir
        if name == "profile":
            argv = (self.py, "scripts/step_profile.py", "--device", s.device, "--tokens", "96",
                    "--out", str(out / "step_profile.json"))
            return StepCommand(argv, None, (out / "step_profile.json", out / "profile.log"))
        stale = tuple(out / f"{name}{ext}" for ext in (".json", ".turns.jsonl",
                                                       ".steps.jsonl", ".log", "-retry.log"))
        if name == "drive":
            used, fallback = s.drive_methods, s.fallback_drive_methods
            return StepCommand(self._drive(used),
                               None if used == fallback else self._drive(fallback), stale)
        if name == "bench-fp32":
            used = s.methods
        elif name.startswith("bench-bf16-"):
            used = s.bf16_methods
        else:
            raise ValueError(f"no step {name}")
        fallback = s.fallback_methods
        return StepCommand(self._bench(name, used),
                           None if used == fallback else self._bench(name, fallback), stale)


def should_retry(enabled: bool, rc: int, command: StepCommand, log: Path) -> bool:
    """Whether a step that ended with ``rc`` is run again with its fallback methods.

    Only a crash is: not a success, a skip (``rc`` < 0), a time-out (124, 137), or a drive
    that ran to the end and found variants that disagree (:data:`DISAGREE` in its log).

    Args:
        enabled: ``RETRY=1``.
        rc: The step's exit code; -1 when it was skipped.
        command: The step's commands (no retry command: no retry).
        log: The step's log.

    Returns:
        True to run ``command.retry_argv``.
    """
    if not enabled or rc <= 0 or timed_out(rc) or command.retry_argv is None:
        return False
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    return DISAGREE not in text
