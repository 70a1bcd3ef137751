"""w8a8: int8 weights times per-row int8 activations, summed in int32. What the product
computes (exactly: against integer sums done in int64), that a row's bits never depend on
the row count or the thread count, that sibling layers quantize their shared input once,
and that speculation over it is token-identical to plain decoding of the same model."""

from __future__ import annotations

import pytest
import torch

from agentspec.errors import ConfigError
from agentspec.targets import w8a8
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.targets.int8 import quantize_linears
from agentspec.targets.stable import invariant_rows, thread_invariant
from agentspec.targets.w8a8 import SharedInput, W8A8Linear, quantize_rows
from tests.conftest import tiny_llama
from tests.unit.test_shape_stable import _blocks_vs_one_by_one, _mismatches

pytestmark = pytest.mark.skipif(not w8a8.supported(), reason="torch lacks torch._int_mm")


def _w8a8_model(init: float = 0.02) -> torch.nn.Module:
    model = tiny_llama(layers=4, max_positions=1024, init=init)
    quantize_linears(model, activations=True)
    return model.to(torch.bfloat16)


def _target(model: torch.nn.Module) -> HFTarget:
    return HFTarget(model, None, "flat-w8a8", "w8a8", "cpu", None,
                    TargetConfig(dtype="w8a8").stable_policy("cpu", model))


def test_rows_are_quantized_symmetrically_per_row() -> None:
    torch.manual_seed(0)
    rows = torch.randn(6, 40) * torch.tensor([1e-3, 1.0, 7.0, 100.0, 0.5, 2.0])[:, None]
    rows[4] = 0.0  # an all-zero row quantizes to zeros, not NaN
    q, a = quantize_rows(rows.bfloat16())
    assert q.dtype == torch.int8 and a.shape == (6, 1)
    assert int(q.abs().max()) == 127
    assert torch.equal(q[4], torch.zeros(40, dtype=torch.int8))
    # Each value is off by at most half a step of its own row.
    assert torch.all((q.float() * a - rows.bfloat16().float()).abs() <= a / 2 + 1e-6)


def test_the_product_is_the_exact_integer_sum_scaled() -> None:
    torch.manual_seed(1)
    lin = torch.nn.Linear(300, 70, bias=True)
    layer = W8A8Linear(lin.weight, lin.bias)
    x = torch.randn(9, 300).bfloat16()
    q, a = quantize_rows(x)
    exact = (q.long() @ layer.qweight.long().t())  # [9, 70] int64: no rounding at all
    want = ((exact.float() * layer.scales) * a + layer.bias).to(torch.bfloat16)
    assert torch.equal(layer(x), want)
    # ... and close to the fp32 layer it replaces (weights and activations each within
    # half a step of their row's grid).
    ref = lin(x.float())
    assert (layer(x).float() - ref).abs().max() <= 0.03 * ref.abs().max()
    assert layer.weight.shape == lin.weight.shape  # the dequantized view, for shape readers


def test_a_rows_bits_do_not_depend_on_row_count_or_threads() -> None:
    torch.manual_seed(2)
    layer = W8A8Linear(torch.randn(257, 96) * 0.05, None)
    row = torch.randn(1, 96).bfloat16() * 3
    outs = []
    for m in (1, 2, 7, 33, 130):
        rows = torch.randn(m, 96).bfloat16()
        rows[m // 2] = row[0]
        outs.append(layer.product(rows)[m // 2])
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    threads = torch.get_num_threads()
    rows = torch.randn(33, 96).bfloat16()
    many = layer.product(rows)
    torch.set_num_threads(1)
    try:
        assert torch.equal(layer.product(rows), many)
    finally:
        torch.set_num_threads(threads)


def test_siblings_quantize_their_input_once_and_hold_nothing_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama(layers=1)
    quantize_linears(model, activations=True)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.shared is attn.k_proj.shared is attn.v_proj.shared
    assert attn.o_proj.shared is not attn.q_proj.shared
    assert mlp.gate_proj.shared is mlp.up_proj.shared is not mlp.down_proj.shared
    calls = []
    real = w8a8.quantize_rows
    monkeypatch.setattr(w8a8, "quantize_rows", lambda r: calls.append(r.shape) or real(r))
    x = torch.randn(1, 3, 64)
    ys = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    assert len(calls) == 1  # one quantization for three products
    assert attn.q_proj.shared._x is None  # released once all three read it
    for lin, y in zip((attn.q_proj, attn.k_proj, attn.v_proj), ys, strict=True):
        assert lin.bias is None  # tiny_llama's projections have none
        assert torch.equal(y, lin.product(x.reshape(-1, 64)).reshape(y.shape))
    calls.clear()
    attn.q_proj(x), attn.q_proj(x.clone())  # another tensor: quantized again
    assert len(calls) == 2


def test_shared_input_recomputes_for_a_new_tensor() -> None:
    shared = SharedInput(members=2)
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    qx, _ = shared.quantize(x, 8)
    qy, _ = shared.quantize(y, 8)  # not x: its own rows
    assert torch.equal(qy, quantize_rows(y)[0]) and not torch.equal(qx, qy)


def test_quantize_keeps_scales_fp32_through_a_cast() -> None:
    model = tiny_llama()
    model.config.tie_word_embeddings = True
    n = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert quantize_linears(model, activations=True) == n
    model.to(torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == n and model.config.tie_word_embeddings is False
    assert all(m.scales.dtype == torch.float32 and m.qweight.dtype == torch.int8
               for m in layers)
    assert model.model.norm.weight.dtype == torch.bfloat16  # the rest is cast


def test_config_rules() -> None:
    assert TargetConfig(dtype="w8a8").resolved_device() == "cpu"
    assert TargetConfig(dtype="w8a8").load_dtype == "float32"
    with pytest.raises(ConfigError, match="CPU only"):
        TargetConfig(dtype="w8a8", device="cuda").resolved_device()
    assert TargetConfig(dtype="w8a8").stable_policy("cpu") is not None


def test_probes_find_w8a8_invariant_from_one_row() -> None:
    model = _w8a8_model()
    assert invariant_rows(model) == 1
    assert thread_invariant(model)


def test_verify_blocks_give_the_one_by_one_bits() -> None:
    target = _target(_w8a8_model())
    assert target.shape_stable
    for k in (2, 5, 9, 20):
        assert _blocks_vs_one_by_one(target, k), k


def test_w8a8_speculation_identical_to_plain_w8a8() -> None:
    assert _mismatches(_target(_w8a8_model())) == 0


def test_cli_takes_w8a8() -> None:
    from agentspec.cli.console import build_parser

    assert build_parser().parse_args(["bench", "--dtype", "w8a8"]).dtype == "w8a8"
