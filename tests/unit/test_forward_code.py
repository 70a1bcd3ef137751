"""The forward-code digest that keys the cost and probe caches: it covers every module of
the forwards and kernels, it changes when any of them is edited, and a missing module is
an error, never a quieter key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agentspec.errors import ConfigError
from agentspec.targets.base import fingerprint

TARGETS = Path(fingerprint.__file__).resolve().parents[1]


def test_every_forward_and_kernel_module_is_keyed() -> None:
    names = {name for name, _ in fingerprint.code_files()}
    expected = {f"agentspec/targets/{p.relative_to(TARGETS).as_posix()}"
                for folder in ("forward", "kernels") for p in (TARGETS / folder).iterdir()
                if p.suffix in (".py", ".c", ".h")}
    expected |= {"agentspec/targets/cache/kv_cache.py", "agentspec/targets/base/step_mode.py"}
    assert "agentspec/targets/kernels/_int8_mm.c" in expected
    assert names == expected


def test_editing_any_forward_code_file_changes_the_key(tmp_path: Path) -> None:
    files = fingerprint.code_files()
    copies = []
    for name, path in files:
        copy = tmp_path / name
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
        copies.append((name, copy))
    key = fingerprint.code_digest(copies)
    assert key == fingerprint.forward_code()
    for name, copy in copies:
        original = copy.read_bytes()
        copy.write_bytes(original + b"\n")  # the smallest edit: one more newline
        assert fingerprint.code_digest(copies) != key, name
        copy.write_bytes(original)
    assert fingerprint.code_digest(copies) == key
    # A file moved to another name (the same bytes) is another key too.
    moved = [(f"{n}.moved", p) if i == 0 else (n, p) for i, (n, p) in enumerate(copies)]
    assert fingerprint.code_digest(moved) != key


def test_a_missing_forward_module_fails_loudly() -> None:
    with pytest.raises(ConfigError, match=r"agentspec\.targets\.forward\.no_such_module"):
        fingerprint.code_files(("agentspec.targets.forward.no_such_module",))
