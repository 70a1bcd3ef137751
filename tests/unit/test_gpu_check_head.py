"""The GPU check's EAGLE head swap (workflows.bench.gpu_check.head): ``HEAD`` is served
where agentspec looks first while the steps run, and what was there before is always put
back: after a clean run, a failed step, an exception, Ctrl-C or a SIGTERM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gpu_check_fakes import FakeRunner, Step, cpu_settings, make_check

from workflows.bench.gpu_check.check import _terminate
from workflows.bench.gpu_check.head import BACKUP_SUFFIX, head_path, swap_head
from workflows.bench.gpu_check.interpreter import SetupError


@pytest.fixture
def head(tmp_path: Path) -> Path:
    path = tmp_path / "trained.safetensors"
    path.write_bytes(b"NEW HEAD")
    return path


def _dest(home: Path) -> Path:
    return head_path(home, "smollm2-135m-instruct")


def test_head_path_is_where_agentspec_looks_first(tmp_path: Path) -> None:
    assert head_path(tmp_path, "qwen") == tmp_path / "drafters" / "qwen-eagle.safetensors"


def test_a_new_file_is_removed_again(tmp_path: Path, head: Path) -> None:
    dest = _dest(tmp_path / "home")
    with swap_head(head, dest):
        assert dest.read_bytes() == b"NEW HEAD"
    assert not dest.exists()
    assert dest.parent.is_dir()


def test_a_replaced_file_is_put_back_unchanged(tmp_path: Path, head: Path) -> None:
    dest = _dest(tmp_path)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"OLD HEAD")
    os.utime(dest, (1_000_000, 1_000_000))
    with swap_head(head, dest):
        assert dest.read_bytes() == b"NEW HEAD"
        assert dest.with_name(dest.name + BACKUP_SUFFIX).read_bytes() == b"OLD HEAD"
    assert dest.read_bytes() == b"OLD HEAD"
    assert dest.stat().st_mtime == 1_000_000
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]


def test_an_identical_file_is_left_alone(tmp_path: Path, head: Path) -> None:
    dest = _dest(tmp_path)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"NEW HEAD")
    with swap_head(head, dest):
        assert not dest.with_name(dest.name + BACKUP_SUFFIX).exists()
    assert dest.read_bytes() == b"NEW HEAD"


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt(), SystemExit(143)])
def test_restored_when_the_block_raises(tmp_path: Path, head: Path,
                                       error: BaseException) -> None:
    dest = _dest(tmp_path)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"OLD HEAD")
    with pytest.raises(type(error)), swap_head(head, dest):
        raise error
    assert dest.read_bytes() == b"OLD HEAD"
    new = _dest(tmp_path / "fresh")
    with pytest.raises(type(error)), swap_head(head, new):
        raise error
    assert not new.exists()


def test_a_missing_head_changes_nothing(tmp_path: Path) -> None:
    dest = _dest(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a file"), \
            swap_head(tmp_path / "missing", dest):
        pass
    assert not dest.parent.exists()


def test_sigterm_unwinds_through_the_restore() -> None:
    with pytest.raises(SystemExit) as info:
        _terminate(15, None)
    assert info.value.code == 143


def _check_with_head(tmp_path: Path, head: Path, runner: FakeRunner) -> tuple[Path, list[bytes]]:
    """Run the check with ``HEAD`` over an existing head file; what each step saw there."""
    home = tmp_path / "home"
    dest = _dest(home)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"OLD HEAD")
    seen: list[bytes] = []
    runner.during = lambda step: seen.append(dest.read_bytes())
    settings = cpu_settings(tmp_path / "out", steps="bench-fp32 drive", head=str(head))
    check = make_check(settings, runner, home)
    try:
        check.execute()
    finally:
        assert dest.read_bytes() == b"OLD HEAD"
        assert not dest.with_name(dest.name + BACKUP_SUFFIX).exists()
    return dest, seen


def test_the_steps_see_the_head_and_a_failed_run_restores_it(tmp_path: Path,
                                                              head: Path) -> None:
    runner = FakeRunner(steps={"bench-fp32": Step(rc=1), "drive": Step(rc=124)})
    _, seen = _check_with_head(tmp_path, head, runner)
    assert seen == [b"NEW HEAD"] * 3  # bench-fp32, its retry, drive
    env = (tmp_path / "out" / "env.txt").read_text()
    assert f"head={head}\n" in env


@pytest.mark.parametrize("error", [RuntimeError("runner broke"), KeyboardInterrupt()])
def test_an_exception_in_a_step_restores_the_head(tmp_path: Path, head: Path,
                                                  error: BaseException) -> None:
    def explode() -> Step:
        raise error

    runner = FakeRunner(steps={"drive": explode})
    with pytest.raises(type(error)):
        _check_with_head(tmp_path, head, runner)
    assert runner.step_names() == ["bench-fp32", "drive"]


def test_a_head_that_is_no_file_stops_the_check(tmp_path: Path) -> None:
    settings = cpu_settings(tmp_path / "out", head=str(tmp_path / "nope.safetensors"))
    runner = FakeRunner()
    with pytest.raises(SetupError, match="is not a file"):
        make_check(settings, runner, tmp_path / "home").execute()
    assert runner.step_names() == []
