"""``import agentspec`` lets torch's idle OpenMP workers sleep (``OMP_WAIT_POLICY=PASSIVE``)
where torch is not loaded yet and the user has not chosen a policy; a user's setting wins,
and an import after torch's changes nothing (torch has read the variable by then)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SHOW = "import os; {first}; print(os.environ.get('OMP_WAIT_POLICY', 'unset'))"


@pytest.mark.parametrize(("first", "env", "want"), [
    ("import agentspec, torch", None, "PASSIVE"),
    ("import agentspec.targets.hf", None, "PASSIVE"),
    ("import agentspec, torch", "ACTIVE", "ACTIVE"),
    ("import torch, agentspec", None, "unset"),
])
def test_the_wait_policy(first: str, env: str | None, want: str) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env is not None:
        environ["OMP_WAIT_POLICY"] = env
    out = subprocess.run([sys.executable, "-c", SHOW.format(first=first)], env=environ,
                         capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == want


WARN = ("import logging; logging.basicConfig(); {first}; "
        "from agentspec.targets.base.cpu import warn_spinning_openmp as w; print(w(), w())")


@pytest.mark.parametrize(("first", "warns"), [
    ("import torch, agentspec", True),  # torch read the unset variable: its workers spin
    ("import agentspec, torch", False),
])
def test_a_target_says_once_when_openmp_spins(first: str, warns: bool) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", WARN.format(first=first)], env=environ,
                         capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == f"{warns} {warns}"  # cached: said once
    assert ("OMP_WAIT_POLICY=PASSIVE" in out.stderr) is warns
    assert out.stderr.count("idle OpenMP workers spin") == int(warns)
