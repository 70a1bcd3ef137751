"""The int8 snapshot of a model whose weights are slow to read (the 1.5B): a model built from
it is bit for bit the model quantizing its fp32 weights at load gives, in each int8
precision; it is written once per weights and kernels' code, rewritten when damaged, and a
new one replaces the old. Tiny random models only."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from agentspec.errors import ModelLoadError
from agentspec.models import SHIPPED_MODELS, ModelFiles, ShippedModel
from agentspec.targets import snapshot
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.targets.kernels import int8, w8a8
from agentspec.targets.kernels.precision import rest_dtype
from tests.conftest import tiny_llama


def tiny_qwen2() -> Any:
    """A random Qwen2 (biases on q, k, v; the output layer tied to the embedding)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


MODELS = {"llama": lambda: tiny_llama(), "qwen2": tiny_qwen2}


def _at_load(fp32: Any, digits: int) -> Any:
    """What HFTarget.load does without a snapshot (the rest in bf16 where this CPU has it
    natively, else fp32, as HFTarget.load keeps it)."""
    model = copy.deepcopy(fp32)
    int8.quantize_linears(model, activations=digits)
    return model.to(rest_dtype(digits))


def _from_snapshot(fp32: Any, digits: int, tmp_path: Path) -> Any:
    folder = tmp_path / "folder"
    fp32.config.save_pretrained(folder)
    snapshot.write(fp32, tmp_path / "s.safetensors")
    return snapshot.read(tmp_path / "s.safetensors", folder, digits).to(rest_dtype(digits))


def _load(name: str, digits: int) -> tuple[Any, Any, ModelFiles]:
    """A snapshot's model as HFTarget.load keeps it."""
    loaded = snapshot.load_quantized(name, digits)
    assert loaded is not None
    model, tok, files = loaded
    return model.to(rest_dtype(digits)), tok, files


def _logits(model: torch.nn.Module) -> list[torch.Tensor]:
    """Forwards of 300 rows (over w8a16's and int8's prefill switch: the dequantized
    GEMM), 5 rows and 1 row (the integer kernels)."""
    torch.manual_seed(5)
    ids = torch.randint(0, 96, (1, 300))
    with torch.inference_mode():
        return [model(ids[:, :n]).logits for n in (300, 5, 1)]


@pytest.mark.parametrize("digits", [0, 1, 2])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_a_snapshot_gives_the_bits_of_quantizing_at_load(
        tmp_path: Path, arch: str, digits: int) -> None:
    fp32: Any = MODELS[arch]()
    ref, snap = _at_load(fp32, digits), _from_snapshot(fp32, digits, tmp_path)
    assert not snap.training and not snap.config.tie_word_embeddings
    kinds = {n: type(m) for n, m in ref.named_modules()}
    assert {n: type(m) for n, m in snap.named_modules()} == kinds
    assert (w8a8.W8A8Linear if digits else int8.Int8Linear) in kinds.values()
    for (n, a), (m, b) in zip(ref.named_buffers(), snap.named_buffers(), strict=True):
        assert n == m and a.dtype == b.dtype and torch.equal(a, b), n
    for (n, a), (m, b) in zip(ref.named_parameters(), snap.named_parameters(), strict=True):
        assert n == m and a.dtype == b.dtype and torch.equal(a, b), n
    if digits:  # q, k and v quantize their input once, as at load
        attn = snap.model.layers[0].self_attn
        assert attn.q_proj.shared is attn.k_proj.shared is attn.v_proj.shared
        assert attn.q_proj.shared.digits == digits
    for a, b in zip(_logits(ref), _logits(snap), strict=True):
        assert torch.equal(a, b)


def test_a_snapshot_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    fp32: Any = tiny_llama()
    tensors = snapshot.tensors(fp32)
    skeleton = copy.deepcopy(fp32)
    del tensors["model.layers.1.mlp.down_proj.qweight"]
    with pytest.raises(ModelLoadError, match=r"does not fit .*model\.layers\.1\.mlp\.down_proj"):
        snapshot.build(skeleton, tensors, 2)
    tensors = snapshot.tensors(fp32)
    del tensors["model.norm.weight"]
    with torch.device("meta"):
        skeleton = type(fp32)(fp32.config)
    with pytest.raises(ModelLoadError, match=r"lacks 'model\.norm\.weight'"):
        snapshot.build(skeleton, tensors, 2)


@pytest.fixture
def fake_1_5b(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A shipped model without an fp32 folder whose fp32 load (the GGUF's, a minute for the
    real one) is counted."""
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path / "home"))
    model = ShippedModel("fake-1.5b", "", "", "fake.gguf", (("fakechunk", "p.bin"),),
                         ("fake==1",), "MIT", 1, "0" * 64, fp32_folder=False)
    monkeypatch.setitem(SHIPPED_MODELS, model.name, model)
    fp32 = tiny_qwen2()
    state: dict[str, Any] = {"model": model, "fp32": fp32, "loads": 0}

    def load(name: str, dtype: str, device: str) -> tuple[Any, Any, ModelFiles]:
        assert (name, dtype, device) == (model.name, "float32", "cpu")
        state["loads"] += 1
        if not model.converted:
            fp32.config.save_pretrained(model.folder)
            (model.folder / "agentspec-conversion.json").write_text("{}")
        return copy.deepcopy(fp32), "tok", ModelFiles(model.folder, model.name, model)

    monkeypatch.setattr(snapshot, "load_model_and_tokenizer", load)
    monkeypatch.setattr(snapshot, "load_tokenizer", lambda files: "tok")
    return state


def test_written_once_then_read(fake_1_5b: dict[str, Any]) -> None:
    model: ShippedModel = fake_1_5b["model"]
    fp32 = fake_1_5b["fp32"]
    _, tok, files = _load(model.name, 2)
    assert fake_1_5b["loads"] == 1 and tok == "tok" and files.gguf is model
    (path,) = model.snapshot_dir.glob("*.safetensors")
    assert path == snapshot.snapshot_path(model, files)
    again, _, _ = _load(model.name, 2)
    int8_model, _, _ = _load(model.name, 0)  # one snapshot serves each
    assert fake_1_5b["loads"] == 1
    for a, b in zip(_logits(_at_load(fp32, 2)), _logits(again), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_logits(_at_load(fp32, 0)), _logits(int8_model), strict=True):
        assert torch.equal(a, b)
    assert snapshot.load_quantized("not-shipped", 2) is None  # quantized at load as before


def test_a_damaged_snapshot_is_written_again(fake_1_5b: dict[str, Any]) -> None:
    model: ShippedModel = fake_1_5b["model"]
    _load(model.name, 2)
    (path,) = model.snapshot_dir.glob("*.safetensors")
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    lm, _, _ = _load(model.name, 2)
    assert fake_1_5b["loads"] == 2 and path.stat().st_size > 1000
    for a, b in zip(_logits(_at_load(fake_1_5b["fp32"], 2)), _logits(lm), strict=True):
        assert torch.equal(a, b)


def test_new_kernels_code_writes_a_new_snapshot_in_place_of_the_old(
        fake_1_5b: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    model: ShippedModel = fake_1_5b["model"]
    _load(model.name, 2)
    (old,) = model.snapshot_dir.glob("*.safetensors")
    monkeypatch.setattr(snapshot, "code_key", lambda: "0123456789ab")
    _load(model.name, 2)
    (new,) = model.snapshot_dir.glob("*.safetensors")
    assert new != old and new.name.endswith("-0123456789ab.safetensors")
    assert fake_1_5b["loads"] == 2
    assert not [p for p in model.snapshot_dir.iterdir() if p != new]  # no temporary left


def test_the_target_loads_its_int8_precisions_from_the_snapshot(
        fake_1_5b: dict[str, Any]) -> None:
    model: ShippedModel = fake_1_5b["model"]
    target = HFTarget.load(TargetConfig(model=model.name, dtype="w8a16", device="cpu",
                                        measure_costs=False))
    assert fake_1_5b["loads"] == 1 and any(model.snapshot_dir.glob("*.safetensors"))
    assert any(isinstance(m, w8a8.W8A8Linear) for m in target.model.modules())
    assert torch.isfinite(target.prefill([3, 4, 5])).all()
