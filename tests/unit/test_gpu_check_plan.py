"""The GPU check's step plan and deadline arithmetic (workflows.bench.gpu_check.plan), and
what runs and what is skipped when time is short, on a fake clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpu_check_fakes import FakeRunner, Step, cpu_settings, make_check, read_tsv

from workflows.bench.gpu_check import check as check_module
from workflows.bench.gpu_check.interpreter import Picked
from workflows.bench.gpu_check.plan import Plan, PlannedStep, make_plan, wanted
from workflows.bench.gpu_check.settings import SettingError, Settings, Shares

ALL = "bench drive profile"


def test_steps_are_selected_by_name_or_group() -> None:
    assert wanted("bench-bf16-a", "bench")
    assert wanted("bench-bf16-a", "drive bench-bf16-a")
    assert not wanted("bench-bf16-a", "bench-fp32 drive")
    assert wanted("drive", ALL) and wanted("profile", ALL)
    assert not wanted("profile", "bench drive")
    assert not wanted("drive", "")


def test_default_plan_order_and_caps() -> None:
    plan = make_plan(ALL, "float32 bfloat16", 480, 15, Shares())
    assert plan.names == ["bench-fp32", "bench-bf16-a", "bench-bf16-b", "drive", "profile"]
    assert [s.cap_s for s in plan.steps] == [144, 96, 96, 96, 48]  # 30, 20, 20, 20, 10 %


def test_plan_follows_dtypes_order_aliases_and_steps() -> None:
    plan = make_plan("bench", "bf16 fp32", 100, 15, Shares(fp32=50, bf16=25))
    assert plan.names == ["bench-bf16-a", "bench-bf16-b", "bench-fp32"]
    assert [s.cap_s for s in plan.steps] == [25, 25, 50]
    assert make_plan("drive", "float32", 480, 15, Shares()).names == ["drive"]
    assert make_plan("bench-bf16-b", "float32", 480, 15, Shares()).steps == ()
    assert make_plan("bench", "", 480, 15, Shares()).steps == ()


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown dtype in DTYPES: float16"):
        make_plan(ALL, "float32 float16", 480, 15, Shares())


def _plan(*caps: int, deadline: int = 100, reserve: int = 10) -> Plan:
    steps = tuple(PlannedStep(f"s{i}", c) for i, c in enumerate(caps))
    return Plan(steps=steps, deadline_s=deadline, reserve_s=reserve)


def test_a_step_gets_its_cap_and_the_slack_earlier_steps_left() -> None:
    plan = _plan(30, 20, 20)
    # On time: left 90, later caps 40: the first step may run 50 (its 30 plus 20 spare).
    assert plan.limit_for(0, 0) == 50
    # The first step took 10 s: the second gets 100-10-10-20 = 60.
    assert plan.limit_for(1, 10) == 60
    # The last step takes everything left but the reserve.
    assert plan.limit_for(2, 40) == 50


def test_a_late_step_keeps_its_cap_while_that_much_is_left() -> None:
    plan = _plan(30, 20, 20)
    # Behind: left 40, later caps 20: the share rule (20) gives way to the cap (20 -> 20).
    assert plan.limit_for(1, 50) == 20
    # Further behind: left 15 < cap 20: what is left.
    assert plan.limit_for(1, 75) == 15
    # Past the deadline: nothing (or less).
    assert plan.limit_for(2, 100) == -10


def test_the_slack_is_what_the_later_steps_do_not_need() -> None:
    plan = _plan(30, 20, 20)
    assert plan.slack_for(0, 20) == 100 - 20 - 10 - 40
    assert plan.slack_for(2, 60) == 30
    assert plan.slack_for(0, 60) == -10  # late: a retry gets nothing


def test_settings_read_the_knobs() -> None:
    s = Settings.from_env({"DEADLINE_S": "240", "METHODS": "greedy,suffix", "PCT_DRIVE": "5",
                           "BF16_ARGS": "", "EXTRA_BENCH_ARGS": "--limit 1  --turns 1",
                           "RETRY": "0", "KEEP": "1", "STEPS": ""})
    assert (s.deadline_s, s.shares.drive, s.shares.fp32) == (240, 5, 30)
    assert s.bf16_methods == "greedy,suffix"  # BF16_METHODS defaults to METHODS
    assert s.bf16_args == () and s.extra_bench_args == ("--limit", "1", "--turns", "1")
    assert (s.retry, s.keep, s.steps) == (False, True, "bench drive profile")
    assert Settings.from_env({}).bf16_args == ("--limit", "1")  # only unset defaults it
    with pytest.raises(SettingError, match="MIN_STEP_S='soon'"):
        Settings.from_env({"MIN_STEP_S": "soon"})


def test_short_time_runs_what_fits_and_skips_the_rest(tmp_path: Path) -> None:
    # DEADLINE_S 100: caps fp32 30, bf16 20 + 20, drive 20, profile 10; reserve 15.
    out = tmp_path / "out"
    runner = FakeRunner(steps={"bench-fp32": Step(seconds=30), "bench-bf16-a": Step(seconds=20),
                               "bench-bf16-b": Step(seconds=20)})
    rc = make_check(cpu_settings(out, deadline_s=100), runner, tmp_path).execute()
    assert rc == 1
    assert [c.limit_s for c in runner.step_calls()] == [30, 20, 20]
    assert runner.step_names() == ["bench-fp32", "bench-bf16-a", "bench-bf16-b"]
    rows = read_tsv(out)
    assert [r[:2] for r in rows] == [["bench-fp32", "ok"], ["bench-bf16-a", "ok"],
                                     ["bench-bf16-b", "ok"], ["drive", "skipped"],
                                     ["profile", "skipped"]]
    drive = rows[3]
    assert drive[2:5] == ["", "0", "15"]
    assert drive[5] == "only 15 s left before the deadline (MIN_STEP_S=20)"
    assert runner.calls[-1].argv[1:3] == ["-m", "workflows.report.gpu_check"]  # summary runs


def test_after_the_deadline_every_later_step_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "out"
    runner = FakeRunner(steps={"bench-fp32": Step(seconds=400)})
    check = make_check(cpu_settings(out, deadline_s=100, steps="bench"), runner, tmp_path)
    assert check.execute() == 1
    assert runner.step_names() == ["bench-fp32"]
    notes = {r[0]: r[5] for r in read_tsv(out)}
    assert notes["bench-bf16-a"] == notes["bench-bf16-b"] == "the deadline (100 s) has passed"


def test_a_fast_step_leaves_its_time_to_the_next(tmp_path: Path) -> None:
    out = tmp_path / "out"
    runner = FakeRunner(steps={"bench-fp32": Step(seconds=4)})
    check = make_check(cpu_settings(out, steps="bench-fp32 drive"), runner, tmp_path)
    assert check.execute() == 0
    # 480 s: caps fp32 144, drive 96; reserve 15. fp32: 480-15-96 = 369; drive: 480-4-15.
    assert [c.limit_s for c in runner.step_calls()] == [369, 461]
    assert (out / "steps.tsv").read_text().splitlines()[1] == "drive\tok\t0\t10\t461\t"


def test_a_venv_build_moves_the_deadline(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(check_module, "pick_python", lambda *a, **k: Picked("py", 100))
    out = tmp_path / "out"
    runner = FakeRunner()
    check = make_check(cpu_settings(out, steps="profile"), runner, tmp_path)
    assert check.execute() == 0
    assert runner.step_calls()[0].limit_s == 480 + 100 - 15
    assert "deadline_s=480\n" in (out / "env.txt").read_text()  # as asked
