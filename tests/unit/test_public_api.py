"""The top-level package: every public name resolves to the object its module defines,
``__all__`` lists exactly the exported names, and ``import agentspec`` loads nothing heavy."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import agentspec


def test_all_matches_the_export_map() -> None:
    assert sorted(agentspec.__all__) == sorted(agentspec._EXPORTS)
    assert len(set(agentspec.__all__)) == len(agentspec.__all__)


@pytest.mark.parametrize("name", sorted(agentspec._EXPORTS))
def test_every_public_name_is_its_modules_object(name: str) -> None:
    module = importlib.import_module(agentspec._EXPORTS[name])
    assert getattr(agentspec, name) is getattr(module, name)
    assert name in dir(agentspec)


def test_an_unknown_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        agentspec.no_such_name  # noqa: B018


def test_import_agentspec_is_lazy() -> None:
    """``import agentspec`` must not pull in torch or any submodule (a lazy package)."""
    code = (
        "import sys, agentspec\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('agentspec.') or m == 'torch')\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
    # and a public name loads its module on first read
    code = "import sys, agentspec\nagentspec.AgentSpec\nprint('agentspec.spec' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "True"
