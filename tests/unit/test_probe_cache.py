"""Load-time probe results kept between loads (agentspec.targets.probes.probe_cache): stored once,
read back without probing, keyed so another model, precision or set of weights probes
again, and never an error or a wrong value from a bad file."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch

from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.targets.probes import products
from agentspec.targets.probes.probe_cache import ProbeCache, is_bool, is_rows, probe_key, probed


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    return tmp_path


def test_a_result_is_probed_once_and_read_back(home: Path) -> None:
    calls: list[str] = []

    def probe(value: int | None) -> int | None:
        calls.append("rows")
        return value

    cache = ProbeCache("m-int8")
    assert cache.value("invariant_rows", lambda: probe(2), is_rows) == 2
    assert ProbeCache("m-int8").value("invariant_rows", lambda: probe(5), is_rows) == 2
    assert calls == ["rows"]
    # Another probe of the same key joins the file; the first one's result is kept.
    assert cache.value("thread_invariant", lambda: False, is_bool) is False
    data = json.loads(cache.path.read_text())
    assert data["results"] == {"invariant_rows": 2, "thread_invariant": False}
    # "No row count works" is a result too, read back as None.
    none = ProbeCache("other")
    none.value("invariant_rows", lambda: probe(None), is_rows)
    again = ProbeCache("other")
    assert again.value("invariant_rows", lambda: probe(7), is_rows) is None and again.hits == 1
    assert calls == ["rows", "rows"]
    assert probed(None, "x", lambda: 3, is_rows) == 3  # nothing kept: probed here


@pytest.mark.parametrize("text", ["{not json", "[]", '{"results": []}',
                                  '{"results": {"invariant_rows": "one"}}',
                                  '{"results": {"invariant_rows": true}}',
                                  '{"results": {"invariant_rows": 0}}'])
def test_a_corrupt_or_mistyped_file_is_probed_again(home: Path, text: str) -> None:
    cache = ProbeCache("m")
    cache.path.parent.mkdir(parents=True)
    cache.path.write_text(text)
    assert cache.value("invariant_rows", lambda: 1, is_rows) == 1
    assert cache.hits == 0
    assert json.loads(cache.path.read_text())["results"]["invariant_rows"] == 1


def test_an_unwritable_home_costs_a_probe_not_an_error(
        home: Path, caplog: pytest.LogCaptureFixture) -> None:
    (home / "probes").write_text("a file where the folder should be")
    cache = ProbeCache("m")
    with caplog.at_level(logging.WARNING):
        assert cache.value("thread_invariant", lambda: True, is_bool) is True
        assert cache.value("thread_invariant", lambda: False, is_bool) is False  # not kept
    assert "could not store probe results" in caplog.text


def test_the_key_follows_the_buffers_the_parameters_do_not_cover(
        tiny_model: torch.nn.Module) -> None:
    """int8 layers keep their weights as buffers: two quantized models that differ only
    there must not share probe results (the cost key samples parameters only)."""
    from agentspec.targets.kernels.int8 import quantize_linears

    a = copy.deepcopy(tiny_model)
    quantize_linears(a)
    b = copy.deepcopy(a)
    assert probe_key("k", a) == probe_key("k", b)
    with torch.no_grad():
        q = next(buf for name, buf in b.named_buffers() if name.endswith("qweight"))
        q.view(-1)[0] = q.view(-1)[0] ^ 1  # one int8 weight changed
    assert probe_key("k", a) != probe_key("k", b)
    assert probe_key("k", a) != probe_key("other-dtype", a)


def test_a_second_load_reads_the_probes_instead_of_running_them(
        tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``HFTarget.load`` (what the runtime, the server and the LangChain model
    call): the first int8 load runs each probe once and the second none, with the same
    policy and prefill setting; other weights at the same path probe again."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentspec.models import ModelFiles
    from agentspec.targets import hf

    def save(seed: int) -> None:
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          max_position_embeddings=128, tie_word_embeddings=False)
        LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")

    def fake_load(model: str, dtype: str, device: str) -> tuple[object, None, ModelFiles]:
        path = tmp_path / model
        return LlamaForCausalLM.from_pretrained(path).eval(), None, ModelFiles(path, path.name)

    calls: list[str] = []
    for module, name in ((products, "invariant_rows"), (products, "thread_invariant"),
                         (hf, "prompt_thread_rows")):
        real = getattr(module, name)

        def counted(*args: object, _real: object = real, _name: str = name) -> object:
            calls.append(_name)
            return _real(*args)  # type: ignore[operator]

        monkeypatch.setattr(module, name, counted)
    monkeypatch.setattr(hf, "load_model_and_tokenizer", fake_load)

    def load() -> HFTarget:
        return HFTarget.load(TargetConfig(model="m", dtype="int8", device="cpu",
                                          measure_costs=False))

    save(1)
    first = load()
    assert sorted(calls) == ["invariant_rows", "prompt_thread_rows", "thread_invariant"]
    second = load()
    assert len(calls) == 3  # nothing probed again
    assert second.kv.stable == first.kv.stable
    assert second.meter.prefill_rows == first.meter.prefill_rows
    save(2)  # new weights at the same path
    load()
    assert len(calls) == 6


def test_cost_and_probe_files_follow_the_forwards_code(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Curves timed, or kernels probed, on other forwards' code are not read as this
    code's: the digest of the forwards' sources is part of both keys (here one forward
    module's source edited)."""
    from agentspec.targets.base import fingerprint
    from agentspec.targets.cost.cost_meter import cost_key
    from tests.conftest import tiny_llama

    model = tiny_llama()
    ours = fingerprint.forward_code()
    key = cost_key("tiny", model, "int8", "cpu")
    probes = probe_key(key, model)
    assert key.endswith(ours[:8]) and probe_key(key, model) == probes
    files = fingerprint.code_files()
    name, path = next(f for f in files if f[0].endswith("forward/kv.py"))
    edited = tmp_path / "kv.py"
    edited.write_bytes(path.read_bytes() + b"\n# edited\n")
    try:
        fingerprint.forward_code.cache_clear()
        monkeypatch.setattr(fingerprint, "code_files", lambda: [
            (n, edited if n == name else p) for n, p in files])
        other = fingerprint.forward_code()
        assert other != ours
        assert cost_key("tiny", model, "int8", "cpu") != key
        assert probe_key(key, model) != probes  # the same cost key, other code
    finally:
        fingerprint.forward_code.cache_clear()
