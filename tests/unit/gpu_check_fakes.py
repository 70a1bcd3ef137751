"""Stand-ins for the GPU check's runner and clock (``workflows.bench.gpu_check``), so its
unit tests run the whole sequence without a GPU, a Python with torch or any real process.

:class:`FakeRunner` answers every command from a script keyed by the step's name (its log's
stem: ``bench-fp32``, ``drive-retry``, ...) and moves :class:`FakeClock` on by the seconds
the step is said to take; the probe, ``nvidia-smi`` and the summary get fixed answers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from workflows.bench.gpu_check.check import GpuCheck
from workflows.bench.gpu_check.runner import Outcome
from workflows.bench.gpu_check.settings import Settings

PROBE_OUT = "stack=torch 2.11.0 (CUDA 13.0), transformers 5.17\ndevice_flag=bench,drive\n"


@dataclass
class FakeClock:
    """A monotonic clock that only the fake runner moves."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Step:
    """A scripted step: exit code, seconds taken, text written to its log."""

    rc: int = 0
    seconds: float = 10.0
    log: str = ""


@dataclass
class Call:
    """One command the check ran."""

    argv: list[str]
    limit_s: float | None
    log: Path | None
    env: Mapping[str, str] | None


@dataclass
class FakeRunner:
    """A :class:`~workflows.bench.gpu_check.runner.Runner` that runs nothing.

    Attributes:
        clock: Moved on by each step's seconds.
        steps: Scripted answers by step name; a step not named succeeds in 10 s.
        probe: The probe's standard output (rc 0), or None for a probe that fails.
        summary_rc: The summary's exit code.
        during: Called with each step's name while it "runs" (to look at files then).
        calls: Every command, in order.
    """

    clock: FakeClock = field(default_factory=FakeClock)
    steps: dict[str, Step | Callable[[], Step]] = field(default_factory=dict)
    probe: str | None = PROBE_OUT
    summary_rc: int = 0
    gpu_rc: int = 1
    during: Callable[[str], None] | None = None
    calls: list[Call] = field(default_factory=list)

    def __call__(self, argv: Sequence[str], *, limit_s: float | None = None,
                 log: Path | None = None, capture: bool = False, stdin: str | None = None,
                 env: Mapping[str, str] | None = None) -> Outcome:
        self.calls.append(Call(list(argv), limit_s, log, env))
        if log is None:
            if argv[1:2] == ["-"]:
                return Outcome(0 if self.probe is not None else 1, self.probe or "")
            if "workflows.report.gpu_check" in argv:
                return Outcome(self.summary_rc)
            if argv[0] == "nvidia-smi":
                return Outcome(0, "NVIDIA H200, 143771 MiB, 580.1\n")
            return Outcome(self.gpu_rc)  # a GPU probe of an interpreter, the index probe
        answer = self.steps.get(log.stem, Step())
        step = answer() if callable(answer) else answer
        if self.during is not None:
            self.during(log.stem)
        with log.open("a") as f:
            f.write(step.log)
        self.clock.now += step.seconds
        return Outcome(step.rc)

    def step_calls(self) -> list[Call]:
        """The steps' commands (those logged to a file), in order."""
        return [c for c in self.calls if c.log is not None]

    def step_names(self) -> list[str]:
        """The steps that ran, in order."""
        return [c.log.stem for c in self.step_calls() if c.log is not None]


def cpu_settings(out_dir: Path, **changes: Any) -> Settings:
    """Settings for a CPU run with ``PY=py`` writing to ``out_dir``, with ``changes``."""
    base = Settings.from_env({"OUT_DIR": str(out_dir), "DEVICE": "cpu", "PY": "py"})
    return replace(base, **changes)


def make_check(settings: Settings, runner: FakeRunner, home: Path) -> GpuCheck:
    """A check on fakes: every command is "on PATH", no staged wheels, ``home`` as
    ``$AGENTSPEC_HOME``."""
    return GpuCheck(settings, runner, clock=runner.clock,
                    env={"AGENTSPEC_HOME": str(home), "PATH": "/usr/bin"},
                    which=lambda cmd: f"/usr/bin/{cmd}", stage=home / "no-stage")


def read_tsv(out_dir: Path) -> list[list[str]]:
    """``steps.tsv``'s rows as cells."""
    return [ln.split("\t") for ln in (out_dir / "steps.tsv").read_text().splitlines()]
