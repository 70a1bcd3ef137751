"""The default precision is ``auto`` wherever a model is loaded (the machine's fastest exact
choice: w8a16 on a CPU with torch's int8 product, float32 elsewhere), float32 stays the
reference by name, and what is reported is the precision chosen, never ``"auto"``. No model
is loaded here."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from agentspec.errors import ConfigError
from agentspec.targets.kernels.precision import DTYPES, auto_dtype
from agentspec.targets.target_config import TargetConfig

CPU_ONLY = not torch.cuda.is_available()


def test_target_config_defaults_to_auto_resolved_at_once() -> None:
    field = TargetConfig.__dataclass_fields__["dtype"]
    assert field.default == "auto"
    chosen = TargetConfig().dtype
    assert chosen == auto_dtype(CPU_ONLY) and chosen in DTYPES  # never "auto" once built
    assert TargetConfig(device="cpu").dtype == auto_dtype(True)
    assert TargetConfig(device="cuda").dtype == auto_dtype(False) == "float32"  # GPU: fp32
    assert TargetConfig(dtype="float32").dtype == "float32"  # the reference, by name
    assert TargetConfig(dtype="float32").load_dtype == "float32"
    with pytest.raises(ConfigError, match="'auto'"):
        TargetConfig(dtype="float16")


def test_loaders_default_to_auto() -> None:
    from adapters.langchain import ChatAgentSpec
    from adapters.langchain.runtimes import shared_runtime
    from agentspec.runtime import Runtime
    from workflows.bench import driven
    from workflows.bench.harness import BenchConfig

    assert inspect.signature(Runtime.load).parameters["dtype"].default == "auto"
    assert inspect.signature(shared_runtime).parameters["dtype"].default == "auto"
    assert inspect.signature(driven.run).parameters["dtype"].default == "auto"
    assert BenchConfig().dtype == "auto"
    assert ChatAgentSpec(store=False).dtype == "auto"
    assert ChatAgentSpec.model_fields["dtype"].default == "auto"
    assert ChatAgentSpec(store=False, dtype="float32").dtype == "float32"


@pytest.mark.parametrize("command", ["demo", "bench", "drive", "serve"])
def test_cli_dtype_defaults_to_auto(command: str) -> None:
    from agentspec.cli.console import build_parser

    parser = build_parser()
    assert parser.parse_args([command]).dtype == "auto"
    assert parser.parse_args([command, "--dtype", "float32"]).dtype == "float32"
    sub = next(a for a in parser._subparsers._group_actions  # type: ignore[union-attr]
               if a.dest == "command").choices[command]
    (action,) = [a for a in sub._actions if a.dest == "dtype"]
    assert action.help is not None and "default auto" in action.help
    assert "float32 (the reference)" in action.help


def test_commands_without_dtype_load_in_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """``generate`` (no ``--dtype``) loads its model with the default, ``auto``, resolved."""
    from agentspec.cli.console import main
    from agentspec.targets import hf

    seen: list[Any] = []

    def fake_load(config: TargetConfig | None = None) -> Any:
        seen.append(config)
        raise ConfigError("stop here")

    monkeypatch.setattr(hf.HFTarget, "load", staticmethod(fake_load))
    assert main(["generate", "hi", "--device", "cpu"]) == 2
    (config,) = seen
    assert config is not None and config.dtype == auto_dtype(True)


def test_bench_loads_the_resolved_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark loads (and so reports as ``config.dtype``, the target's) the choice."""
    from workflows.bench import harness

    seen: list[Any] = []

    def fake_load(config: TargetConfig) -> Any:
        seen.append(config)
        raise ConfigError("stop here")

    monkeypatch.setattr(harness.HFTarget, "load", staticmethod(fake_load))
    with pytest.raises(ConfigError, match="stop here"):
        harness.run_bench(harness.BenchConfig(device="cpu", progress=False))
    assert [c.dtype for c in seen] == [auto_dtype(True)]
