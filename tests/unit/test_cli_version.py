"""``agentspec --version`` prints the installed package's version."""

from __future__ import annotations

import pytest

from agentspec.cli.console import build_parser


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("agentspec ") and len(out.split()) == 2 and out.split()[1] != ""
