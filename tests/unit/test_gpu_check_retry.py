"""The GPU check's retries (workflows.bench.gpu_check.commands.should_retry and the check's
sequence): a crashed bench or drive runs once more with the methods that need no EAGLE head,
in the time the later steps do not need; a time-out, a skip, a drive whose variants
disagree, ``RETRY=0`` or methods that are the fallback already are not retried."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_check_fakes import FakeRunner, Step, cpu_settings, make_check, read_tsv

from workflows.bench.gpu_check.commands import Commands, should_retry


def _methods(argv: list[str]) -> str:
    return argv[argv.index("--methods") + 1]


def test_a_crashed_bench_is_retried_with_the_fallback_methods(tmp_path: Path) -> None:
    out = tmp_path / "out"
    runner = FakeRunner(steps={"bench-fp32": Step(rc=1, seconds=12, log="RuntimeError: boom\n")})
    check = make_check(cpu_settings(out, steps="bench-fp32 drive"), runner, tmp_path)
    assert check.execute() == 1  # the failed first try is recorded
    calls = runner.step_calls()
    assert [c.log.name for c in calls if c.log] == ["bench-fp32.log", "bench-fp32-retry.log",
                                                    "drive.log"]
    first, retry = calls[0].argv, calls[1].argv
    assert _methods(first) == "greedy,prompt_lookup,suffix,hybrid,asd_b1"
    assert _methods(retry) == "greedy,prompt_lookup,suffix"
    # The same run otherwise, writing the same results file.
    i = first.index("--methods")
    assert first[:i] == retry[:i] and first[i + 2:] == retry[i + 2:]
    # The retry's limit: 480 - 12 - 15 (reserve) - 96 (drive's cap).
    assert calls[1].limit_s == 357
    rows = read_tsv(out)
    assert rows[0] == ["bench-fp32", "failed", "1", "12", "369", "RuntimeError: boom"]
    assert rows[1][:2] == ["bench-fp32-retry", "ok"]


def test_a_crashed_drive_is_retried_unless_its_variants_disagree(tmp_path: Path) -> None:
    runner = FakeRunner(steps={"drive": Step(rc=1)})
    make_check(cpu_settings(tmp_path / "a", steps="drive"), runner, tmp_path).execute()
    assert runner.step_names() == ["drive", "drive-retry"]
    assert _methods(runner.step_calls()[1].argv) == "plain,suffix,ceiling"

    runner = FakeRunner(steps={"drive": Step(rc=1, log="error: variants disagree on turn 3\n")})
    make_check(cpu_settings(tmp_path / "b", steps="drive"), runner, tmp_path).execute()
    assert runner.step_names() == ["drive"]


@pytest.mark.parametrize("rc", [124, 137])
def test_a_step_cut_at_its_limit_is_not_retried(tmp_path: Path, rc: int) -> None:
    out = tmp_path / "out"
    runner = FakeRunner(steps={"bench-fp32": Step(rc=rc)})
    assert make_check(cpu_settings(out, steps="bench-fp32"), runner, tmp_path).execute() == 1
    assert runner.step_names() == ["bench-fp32"]
    assert read_tsv(out)[0][1:3] == ["timeout", str(rc)]


def test_no_retry_when_disabled_or_already_the_fallback(tmp_path: Path) -> None:
    runner = FakeRunner(steps={"bench-fp32": Step(rc=1)})
    make_check(cpu_settings(tmp_path / "a", steps="bench-fp32", retry=False), runner,
               tmp_path).execute()
    assert runner.step_names() == ["bench-fp32"]

    runner = FakeRunner(steps={"bench-fp32": Step(rc=1)})
    settings = cpu_settings(tmp_path / "b", steps="bench-fp32", methods="greedy,suffix",
                            fallback_methods="greedy,suffix")
    make_check(settings, runner, tmp_path).execute()
    assert runner.step_names() == ["bench-fp32"]


def test_a_retry_without_spare_time_is_skipped(tmp_path: Path) -> None:
    # DEADLINE_S 100: fp32 may run 45 s; it crashes after 29: 100-29-15-(20+20) = 16 s spare.
    out = tmp_path / "out"
    runner = FakeRunner(steps={"bench-fp32": Step(rc=1, seconds=29)})
    settings = cpu_settings(out, deadline_s=100, steps="bench")
    assert make_check(settings, runner, tmp_path).execute() == 1
    rows = {r[0]: r for r in read_tsv(out)}
    assert rows["bench-fp32-retry"][1:5] == ["skipped", "", "0", "16"]
    assert runner.step_names() == ["bench-fp32", "bench-bf16-a", "bench-bf16-b"]


def test_should_retry_only_a_crash(tmp_path: Path) -> None:
    step = Commands(cpu_settings(tmp_path), "py").for_step("bench-fp32")
    log = tmp_path / "bench-fp32.log"
    log.write_text("Traceback ...\nRuntimeError\n")
    assert should_retry(True, 1, step, log)
    assert should_retry(True, 139, step, log)  # a segfault is a crash
    assert not should_retry(True, 0, step, log)
    assert not should_retry(True, -1, step, log)  # skipped
    assert not should_retry(True, 124, step, log)
    assert not should_retry(False, 1, step, log)
    assert should_retry(True, 1, step, tmp_path / "missing.log")  # no log: still a crash
    profile = Commands(cpu_settings(tmp_path), "py").for_step("profile")
    assert profile.retry_argv is None and not should_retry(True, 1, profile, log)
