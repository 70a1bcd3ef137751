"""The GPU check's sequence on fakes (workflows.bench.gpu_check.check): setup, the steps'
commands in order, what it writes for the summary, the exit code, and the setup's choices
(which Python, the staged wheels' environment) and failures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from gpu_check_fakes import FakeClock, FakeRunner, Step, cpu_settings, make_check, read_tsv

from workflows.bench.gpu_check.check import clear_results, last_line, main
from workflows.bench.gpu_check.interpreter import SetupError, pick_python, staged_env
from workflows.bench.gpu_check.runner import Outcome, SubprocessRunner
from workflows.report.gpu_check import read_steps


def test_a_clean_run_in_order(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "out"
    runner = FakeRunner()
    assert make_check(cpu_settings(out), runner, tmp_path / "home").execute() == 0
    assert runner.step_names() == ["bench-fp32", "bench-bf16-a", "bench-bf16-b", "drive",
                                   "profile"]
    fp32, bf16_a, _, drive, profile = (c.argv for c in runner.step_calls())
    assert fp32 == ["py", "-m", "agentspec.cli", "bench", "--quick", "--workloads",
                    "delegate52,tool_agent,chat", "--methods",
                    "greedy,prompt_lookup,suffix,hybrid,asd_b1", "--device", "cpu", "--dtype",
                    "float32", "--no-progress", "--out", f"{out}/bench-fp32.json"]
    assert bf16_a[bf16_a.index("--dtype"):] == ["--dtype", "bfloat16", "--no-progress",
                                                "--limit", "1", "--out",
                                                f"{out}/bench-bf16-a.json"]
    assert drive == ["py", "-m", "agentspec.cli", "drive", "--methods",
                     "plain,suffix,hybrid,ceiling", "--reuse", "on", "--turns", "10",
                     "--max-prompt", "4096", "--max-tokens", "64", "--device", "cpu", "--out",
                     f"{out}/drive.json"]
    assert profile == ["py", "scripts/step_profile.py", "--device", "cpu", "--tokens", "96",
                       "--out", f"{out}/step_profile.json"]
    summary = runner.calls[-1]
    assert (summary.argv, summary.limit_s) == (
        ["py", "-m", "workflows.report.gpu_check", str(out)], 60)
    env = runner.step_calls()[0].env or {}
    assert env["AGENTSPEC_HOME"] == str(tmp_path / "home")
    assert (env["TOKENIZERS_PARALLELISM"], env["PYTHONUNBUFFERED"]) == ("false", "1")
    # What the summary reads: steps.tsv as the report parses it, env.txt, the logs.
    steps = read_steps(out)
    assert (steps[0]["step"], steps[0]["status"], steps[0]["rc"], steps[0]["seconds"]) == (
        "bench-fp32", "ok", 0, 10)
    assert (out / "env.txt").read_text() == (
        "device=cpu\ngpu=none\npython=py\nstack=torch 2.11.0 (CUDA 13.0), transformers 5.17\n"
        "deadline_s=480\n")
    assert (out / "drive.log").read_text().startswith("# py -m agentspec.cli drive ")
    text = capsys.readouterr().out
    assert ("gpu_check: plan: bench-fp32 bench-bf16-a bench-bf16-b drive profile within 480 s "
            "(deadline 480 s)") in text
    assert "gpu_check: [drive] ok (exit 0) after 10 s" in text


def test_flags_the_cli_lacks_are_left_out_and_noted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    runner = FakeRunner(probe="stack=torch\ndevice_flag=bench\n")
    settings = cpu_settings(out, steps="drive", model="qwen", extra_drive_args=("--limit", "1"))
    make_check(settings, runner, tmp_path).execute()
    drive = runner.step_calls()[0].argv
    assert "--device" not in drive
    assert drive[-6:] == ["--model", "qwen", "--limit", "1", "--out", f"{out}/drive.json"]
    assert "note_drive=no --device flag\n" in (out / "env.txt").read_text()


def test_a_failed_step_or_summary_makes_the_exit_1(tmp_path: Path, capsys: Any) -> None:
    runner = FakeRunner(steps={"profile": Step(rc=2, log="loading\rloading 100%\r\n\n")})
    assert make_check(cpu_settings(tmp_path / "a", steps="profile"), runner,
                      tmp_path).execute() == 1
    assert read_tsv(tmp_path / "a")[0] == ["profile", "failed", "2", "10", "465",
                                           "loading 100%"]
    assert "    loading 100%" in capsys.readouterr().err
    runner = FakeRunner(summary_rc=1)
    assert make_check(cpu_settings(tmp_path / "b", steps="profile"), runner,
                      tmp_path).execute() == 1
    assert "the summary failed" in capsys.readouterr().err


def test_no_step_selected_still_summarises(tmp_path: Path, capsys: Any) -> None:
    runner = FakeRunner()
    assert make_check(cpu_settings(tmp_path, steps="nothing"), runner, tmp_path).execute() == 0
    assert runner.step_names() == []
    assert "select no step" in capsys.readouterr().out
    assert "workflows.report.gpu_check" in runner.calls[-1].argv


def test_old_results_go_unless_kept(tmp_path: Path) -> None:
    names = ["steps.tsv", "env.txt", "summary.json", "bench-fp32.json", "bench-x.turns.jsonl",
             "drive.json", "drive-retry.log", "bench-fp32.log", "step_profile.json"]
    for n in names:
        (tmp_path / n).write_text("old")
    clear_results(tmp_path, keep=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[3:])
    clear_results(tmp_path, keep=False)
    assert [p.name for p in tmp_path.iterdir()] == ["step_profile.json"]


def test_last_line_reads_the_tail_of_a_log(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("x" * 5000 + "\nfirst\n" + "y" * 300 + "\r\n  \n")
    assert last_line(log) == "y" * 200
    assert last_line(tmp_path / "missing.log") == ""


def test_setup_failures_stop_before_any_step(tmp_path: Path) -> None:
    runner = FakeRunner()
    gpu = make_check(cpu_settings(tmp_path, device="cuda"), runner, tmp_path)
    gpu.which = lambda cmd: None if cmd == "nvidia-smi" else cmd
    with pytest.raises(SetupError, match="no NVIDIA driver"):
        gpu.execute()
    with pytest.raises(SetupError, match="py cannot run agentspec here"):
        make_check(cpu_settings(tmp_path), FakeRunner(probe=None), tmp_path).execute()
    with pytest.raises(SetupError, match="unknown dtype in DTYPES: half"):
        make_check(cpu_settings(tmp_path, dtypes="half"), runner, tmp_path).execute()
    assert runner.step_names() == []


def test_main_takes_help_and_no_arguments(capsys: Any) -> None:
    assert main(["--help"]) == 0
    assert "DEADLINE_S" in capsys.readouterr().out
    assert main(["--deadline", "5"]) == 2


class _SetupRunner:
    """Answers the GPU probes by interpreter (any, after a build, when ``built_gpu``) and
    counts 90 s for each venv build step."""

    def __init__(self, gpu: set[str], index: bool, clock: FakeClock, built_gpu: bool) -> None:
        self.gpu, self.index, self.clock, self.built_gpu = gpu, index, clock, built_gpu
        self.built: list[list[str]] = []

    def __call__(self, argv: Sequence[str], **kw: Any) -> Outcome:
        if argv[1:2] == ["-c"] and "torch.cuda" in argv[2]:
            return Outcome(0 if argv[0] in self.gpu or (self.built and self.built_gpu) else 1)
        if argv[1:2] == ["-c"]:  # the index probe
            return Outcome(0 if self.index else 1)
        self.built.append(list(argv))
        self.clock.now += 90
        return Outcome(0)


def _pick(gpu: set[str], index: bool, built_gpu: bool = True,
          **changes: Any) -> tuple[str, int, _SetupRunner]:
    clock = FakeClock()
    run = _SetupRunner(gpu, index, clock, built_gpu)
    settings = cpu_settings(Path("out"), **{"device": "cuda", "py": "", **changes})
    picked = pick_python(run, settings, clock, lambda m: None, which=lambda c: c)
    return picked.py, picked.build_s, run


def test_the_steps_python_is_found_in_order() -> None:
    assert _pick({".venv-gpu/bin/python", "python3"}, True)[:2] == (".venv-gpu/bin/python", 0)
    assert _pick({"python3"}, True)[:2] == ("python3", 0)
    py, build_s, run = _pick(set(), True, venv="/v", torch_index_url="https://cu/whl")
    assert (py, build_s) == ("/v/bin/python", 450)  # five build steps of 90 s
    assert run.built[0][-3:] == ["-m", "venv", "/v"]
    assert run.built[2][-3:] == ["--index-url", "https://cu/whl", "torch"]
    with pytest.raises(SetupError, match="no package index"):
        _pick(set(), False)
    with pytest.raises(SetupError, match="cannot use the GPU"):
        _pick(set(), True, built_gpu=False)
    assert _pick(set(), False, py="/opt/py")[:2] == ("/opt/py", 0)  # PY wins, unprobed


def test_the_staged_environment_is_taken_for_a_python_outside_a_venv(tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "env.sh").write_text(f'export PYTHONPATH="$PWD:{stage}/site" GPU_CHECK_T=1\n')
    base: Mapping[str, str] = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ""}
    run = SubprocessRunner()
    env = staged_env(run, "/usr/bin/python3", base, which=lambda c: c, stage=stage)
    assert env is not None and env["GPU_CHECK_T"] == "1"
    assert env["PYTHONPATH"].endswith(f":{stage}/site")
    # Not again once it is in use, and not for a venv's Python.
    assert staged_env(run, "py", env, which=lambda c: c, stage=stage) is None
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("")
    assert staged_env(run, "py", base, which=lambda c: str(venv / "bin" / "python"),
                      stage=stage) is None
    assert staged_env(run, "py", base, which=lambda c: c, stage=tmp_path / "none") is None
