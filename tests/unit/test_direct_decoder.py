"""The direct decode step gives transformers' bits, is checked on its first step, and steps
aside where it cannot.

Each model here runs the same shape-stable decode twice, once through
:class:`~agentspec.targets.forward.decoder.DirectDecoder` and once with it removed (transformers'
forward), and every logit, key and value must be the same bits: a Llama (SmolLM2's
architecture) and a Qwen2 (biased q/k/v projections, Qwen2.5-Coder's), in bf16, int8 and
w8a8. A decoder that computes something else, or raises, is dropped at its first step
with the reference's answer returned.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch

from agentspec.targets.forward import attention
from agentspec.targets.forward import decoder as decoder_mod
from agentspec.targets.forward.decoder import DirectDecoder
from agentspec.targets.forward.shapes import StablePolicy
from agentspec.targets.hf import HFTarget
from agentspec.targets.kernels import int8
from agentspec.targets.kernels.precision import QUANTIZED
from tests.conftest import TINY_VOCAB, keep_process_threads, tiny_llama

POLICY = StablePolicy(min_rows=1, align=512)


def tiny_qwen2() -> torch.nn.Module:
    """A random-weight Qwen2 (biased q/k/v, 4 query heads over 2 key/value heads), seeded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # visible biases: a decoder that skipped them would differ
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                         layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _model(arch: str, dtype: str) -> torch.nn.Module:
    model = tiny_llama(layers=3, max_positions=1024) if arch == "llama" else tiny_qwen2()
    if dtype in QUANTIZED:
        int8.quantize_linears(model, activations=QUANTIZED[dtype])
    return model.to(torch.bfloat16)


def _target(model: torch.nn.Module, dtype: str) -> HFTarget:
    # Two targets are compared bit for bit: both keep the process's thread count.
    return keep_process_threads(HFTarget(model, None, "tiny", dtype, "cpu", None, POLICY))


def _steps(target: HFTarget, seed: int = 0) -> tuple[list[torch.Tensor], list[Any]]:
    """A prompt, then 1-, 3- and 7-row stable forwards and a crop, as decoding runs them:
    every forward's logits and the cache's filled keys and values at the end."""
    rng = random.Random(seed)
    target.prefill([rng.randrange(2, TINY_VOCAB) for _ in range(40)])
    out = []
    for rows in (1, 3, 7, 1, 2):
        out.append(target.score([rng.randrange(2, TINY_VOCAB) for _ in range(rows)]))
        if rows == 7:
            target.kv.crop(4)  # a rejected tail
    kv = [(k.clone(), v.clone()) for k, v in target.kv.layers()]
    return out, kv


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "w8a8", "w8a16"])
def test_direct_steps_are_transformers_bits(arch: str, dtype: str) -> None:
    if dtype != "bfloat16" and not int8.supported():
        pytest.skip("this torch build has no int8 weight-only kernel")
    model = _model(arch, dtype)
    direct, reference = _target(model, dtype), _target(model, dtype)
    reference.kv.decoder = None
    assert direct.kv.decoder is not None
    got, got_kv = _steps(direct)
    want, want_kv = _steps(reference)
    dec = direct.kv.decoder
    assert dec.checked and dec.failed is None and dec.steps == 5  # the first also checked
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for (ka, va), (kb, vb) in zip(got_kv, want_kv, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    # The features drafters read (the final norm's output) come from the direct step too.
    assert direct.kv.features is not None and torch.equal(
        direct.kv.last_features(), reference.kv.last_features())


def test_a_decoder_that_differs_is_dropped_at_its_first_step(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    model = _model("llama", "bfloat16")
    reference = _target(model, "bfloat16")
    reference.kv.decoder = None
    want, want_kv = _steps(reference)
    wrong = _target(model, "bfloat16")
    real = decoder_mod._rms_norm
    monkeypatch.setattr(decoder_mod, "_rms_norm",
                        lambda norm, x: real(norm, x) * 1.01)  # another model
    with caplog.at_level(logging.WARNING, logger="agentspec.targets.forward.decoder"):
        got, got_kv = _steps(wrong)
    dec = wrong.kv.decoder
    assert dec is not None and not dec.usable and "differ" in (dec.failed or "")
    assert dec.steps == 1  # never used again
    assert "direct decode step dropped" in caplog.text
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for (ka, va), (kb, vb) in zip(got_kv, want_kv, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_a_decoder_that_raises_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("qwen2", "bfloat16")
    reference = _target(model, "bfloat16")
    reference.kv.decoder = None
    want, _ = _steps(reference)
    broken = _target(model, "bfloat16")

    def boom(*_args: Any) -> torch.Tensor:
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(decoder_mod, "_rotate", boom)
    got, _ = _steps(broken)
    assert broken.kv.decoder is not None and "no such kernel" in (broken.kv.decoder.failed or "")
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("differs", [False, True])
def test_the_checked_first_step_is_not_timed(monkeypatch: pytest.MonkeyPatch,
                                              differs: bool) -> None:
    """The first step runs twice (the decoder's, then transformers' to compare): its time
    is no forward's, so the live cost tracker does not record it; the steps after it are
    recorded, whether the check passed or dropped the decoder."""
    model = _model("llama", "bfloat16")
    target = _target(model, "bfloat16")
    if differs:
        real = decoder_mod._rms_norm
        monkeypatch.setattr(decoder_mod, "_rms_norm", lambda norm, x: real(norm, x) * 1.01)
    live = target.live_cost
    seen: list[int] = []
    monkeypatch.setattr(live, "observe", lambda k, *_args: seen.append(k))
    target.prefill(list(range(2, 42)))
    target.score([5])
    dec = target.kv.decoder
    assert dec is not None and (dec.usable != differs) and seen == []
    target.score([6, 7])
    target.score([8])
    assert seen == [2, 1]


def test_only_the_family_on_the_cpu_gets_one() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    llama = tiny_llama()
    assert DirectDecoder.build(llama, "cpu") is None  # transformers' own attention
    attention.install_gqa_attention(llama, always=True)
    assert DirectDecoder.build(llama, "cpu") is not None
    assert DirectDecoder.build(llama, "cuda") is None  # graphs do this job there
    mistral = MistralForCausalLM(MistralConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16))
    attention.install_gqa_attention(mistral, always=True)
    assert DirectDecoder.build(mistral, "cpu") is None
    qwen = tiny_qwen2()
    attention.install_gqa_attention(qwen, always=True)
    assert DirectDecoder.build(qwen, "cpu") is not None
    qwen.config.layer_types = ["sliding_attention", *qwen.config.layer_types[1:]]
    assert DirectDecoder.build(qwen, "cpu") is None
    # A target without a shape-stable policy (fp32 on the CPU) never builds one.
    assert HFTarget(llama, None, "tiny", "float32", "cpu").kv.decoder is None


@pytest.mark.parametrize("dtype", ["int8", "w8a16"])
def test_stacked_products_hold_the_weights_once(dtype: str) -> None:
    if not int8.supported():
        pytest.skip("this torch build has no int8 weight-only kernel")
    model = _model("qwen2", dtype)
    first, second = DirectDecoder(model), DirectDecoder(model)
    for i, layer in enumerate(model.model.layers):
        stacked = first.gate_up[i]
        assert stacked is not None and second.gate_up[i] is stacked  # made once per model
        assert first.qkv[i] is second.qkv[i] is not None
        gate, up = layer.mlp.gate_proj, layer.mlp.up_proj
        # The parts' weights are row slices of the stacked product's (no second copy).
        base = stacked.qweight.untyped_storage().data_ptr()
        assert gate.qweight.untyped_storage().data_ptr() == base
        assert up.qweight.untyped_storage().data_ptr() == base
        assert torch.equal(torch.cat((gate.qweight, up.qweight)), stacked.qweight)
        assert gate.qweight.is_contiguous() and up.qweight.is_contiguous()
    # What the model serializes is still one tensor per part.
    assert not any(".gate_up" in name or "fused" in name for name in model.state_dict())
