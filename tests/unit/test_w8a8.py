"""w8a8 and w8a16: int8 weights times per-row activations quantized to one or two int8
digits, summed in int32. What the product computes (exactly: against integer sums done in
int64), that a row's bits never depend on the row count or the thread count, that sibling
layers quantize their shared input once, and that speculation over it is token-identical to
plain decoding of the same model."""

from __future__ import annotations

import pytest
import torch

from agentspec.errors import ConfigError
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.targets.kernels import fused_digits, w8a8
from agentspec.targets.kernels.int8 import quantize_linears
from agentspec.targets.kernels.w8a8 import SharedInput, W8A8Linear, quantize_rows
from agentspec.targets.probes.policy import stable_policy
from agentspec.targets.probes.products import invariant_rows, thread_invariant
from tests.conftest import tiny_llama
from tests.unit.test_shape_stable import _blocks_vs_one_by_one, _mismatches

pytestmark = pytest.mark.skipif(not w8a8.supported(), reason="torch lacks torch._int_mm")


DTYPE = {1: "w8a8", 2: "w8a16"}


def _w8a8_model(init: float = 0.02, digits: int = 1) -> torch.nn.Module:
    model = tiny_llama(layers=4, max_positions=1024, init=init)
    quantize_linears(model, activations=digits)
    return model.to(torch.bfloat16)


def _target(model: torch.nn.Module, digits: int = 1) -> HFTarget:
    dtype = DTYPE[digits]
    return HFTarget(model, None, f"flat-{dtype}", dtype, "cpu", None,
                    stable_policy(TargetConfig(dtype=dtype), "cpu", model))


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


def test_two_digits_write_each_value_to_within_1_508th_of_its_rows_step() -> None:
    torch.manual_seed(0)
    rows = torch.randn(6, 40) * torch.tensor([1e-3, 1.0, 7.0, 100.0, 0.5, 2.0])[:, None]
    rows[4] = 0.0
    rows[5, 3] = 500.0  # an outlier sets its row's scale
    x = rows.bfloat16()
    q, u = quantize_rows(x, digits=2)
    assert q.shape == (12, 40) and q.dtype == torch.int8 and u.shape == (6, 1)
    high, low = q[:6].long(), q[6:].long()
    assert int(q.abs().max()) <= 127
    one, a = quantize_rows(x)
    assert torch.allclose(u * 254, a)  # a unit of the high digit is w8a8's step
    assert (high - one.long()).abs().max() <= 1  # ... and the high digit about its value
    value = (high * 254 + low).double() * u.double()  # [6, 40]
    assert torch.all((value - x.double()).abs() <= u.double() / 2 * (1 + 1e-5))
    assert int((high * 254 + low).abs().max()) == 127 * 254  # the row's peak, exactly
    assert torch.equal(q[[4, 10]], torch.zeros(2, 40, dtype=torch.int8))
    with pytest.raises(ConfigError, match="digits"):
        quantize_rows(x, digits=3)


def test_two_digit_product_is_the_exact_combined_sum_scaled() -> None:
    torch.manual_seed(1)
    lin = torch.nn.Linear(300, 70, bias=True)
    layer = W8A8Linear(lin.weight, lin.bias, digits=2)
    x = torch.randn(9, 300).bfloat16()
    q, u = quantize_rows(x, digits=2)
    sums = q.long() @ layer.qweight.long().t()  # [18, 70] int64: exact
    combined = sums[:9].float() * 254 + sums[9:].float()  # [9, 70]: the kernel's roundings
    want = ((combined * layer.scales) * u + layer.bias).to(torch.bfloat16)
    assert torch.equal(layer(x), want)
    # The activations' error is ~254x smaller than w8a8's: against the same int8 weights
    # over exact activations, the two-digit product is off by little more than its bf16
    # output rounding, w8a8's by far more.
    one = W8A8Linear(lin.weight, lin.bias)
    int8_weights = layer.qweight.double() * layer.scales.double()[:, None]  # [70, 300]
    exact_acts = torch.nn.functional.linear(x.double(), int8_weights,
                                            lin.bias.double())  # [9, 70]
    rounding = (exact_acts.to(torch.bfloat16).double() - exact_acts).norm()
    assert (layer(x).double() - exact_acts).norm() <= 1.5 * rounding
    assert (one(x).double() - exact_acts).norm() > 3 * rounding
    with pytest.raises(ConfigError, match="digits"):
        W8A8Linear(lin.weight, None, SharedInput(digits=1), digits=2)


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


@pytest.mark.parametrize("digits", [1, 2])
def test_a_rows_bits_do_not_depend_on_row_count_or_threads(digits: int) -> None:
    torch.manual_seed(2)
    layer = W8A8Linear(torch.randn(257, 96) * 0.05, None, digits=digits)
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
    monkeypatch.setattr(w8a8, "quantize_rows",
                        lambda r, d=1: calls.append(r.shape) or real(r, d))
    # More rows than the one-call kernel takes (fewer never reach the shared quantization:
    # each layer's call quantizes its own rows in C, test_fused_digits.py)
    x = torch.randn(1, fused_digits.LINEAR_MAX_ROWS + 2, 64)
    ys = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    assert len(calls) == 1  # one quantization for three products
    assert attn.q_proj.shared._x is None  # released once all three read it
    for lin, y in zip((attn.q_proj, attn.k_proj, attn.v_proj), ys, strict=True):
        assert lin.bias is None  # tiny_llama's projections have none
        assert torch.equal(y, lin.product(x.reshape(-1, 64)).reshape(y.shape))
    calls.clear()
    attn.q_proj(x), attn.q_proj(x.clone())  # another tensor: quantized again
    assert len(calls) == 2


@pytest.mark.parametrize("digits", [1, 2])
def test_concat_gives_each_part_its_own_bits(digits: int) -> None:
    torch.manual_seed(3)
    shared = SharedInput(members=3, digits=digits)
    parts = [W8A8Linear(torch.randn(out, 64) * 0.05, torch.randn(out), shared, digits)
             for out in (64, 16, 16)]
    both = W8A8Linear.concat(parts)
    x = torch.randn(1, 5, 64).bfloat16()
    assert torch.equal(both(x), torch.cat([p(x) for p in parts], dim=-1))
    assert both.shared is not shared and both.shared.digits == digits
    with pytest.raises(ConfigError, match="digits"):
        W8A8Linear.concat([parts[0], W8A8Linear(torch.randn(8, 64), None,
                                                digits=3 - digits)])


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


def test_w8a16_prefill_chunks_switch_to_a_float_gemm_at_their_row_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt chunks under W8A16_PREFILL_ROWS rows take the integer product (their bits
    the same with any thread count), longer ones a float GEMM over the dequantized weights:
    bf16's where bf16 is native, fp32's where it is emulated (many times slower than
    either); decode forwards of any length the integer product; prefill_switch names that
    row count for a model with w8a16 layers only."""
    from tests.unit.test_int8 import decode_forward

    torch.manual_seed(4)
    layer = W8A8Linear(torch.randn(24, 32), torch.randn(24), digits=2)
    n = w8a8.W8A16_PREFILL_ROWS
    x = torch.randn(n, 32).bfloat16()
    integer = layer._finish(*quantize_rows(x, 2), x.dtype, layer.bias)  # [n, 24]
    bf16 = torch.nn.functional.linear(x, layer.weight, layer.bias.bfloat16())
    fp32 = torch.nn.functional.linear(x.float(), layer.qweight.float() * layer.scales[:, None],
                                      layer.bias).to(x.dtype)
    assert not torch.equal(integer, bf16) and not torch.equal(integer, fp32)  # else this
    assert not torch.equal(bf16, fp32)  # test could not tell them apart
    for native, long in ((True, bf16), (False, fp32)):
        monkeypatch.setattr(w8a8, "bf16_native", lambda native=native: native)
        assert torch.equal(layer(x[: n - 1]), integer[: n - 1])  # a short chunk
        assert torch.equal(layer(x), long)  # a long one
        assert torch.equal(decode_forward(layer, x), integer)  # a decode forward that long
    assert w8a8.prefill_switch(_w8a8_model(digits=2)) == n
    assert w8a8.prefill_switch(_w8a8_model(digits=1)) is None
    int8_only = tiny_llama(layers=1)
    quantize_linears(int8_only)
    assert w8a8.prefill_switch(int8_only) is None


def test_two_digit_siblings_share_a_two_digit_input() -> None:
    model = tiny_llama(layers=1)
    quantize_linears(model, activations=2)
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.shared is mlp.up_proj.shared
    assert mlp.gate_proj.shared.digits == mlp.down_proj.shared.digits == 2
    with pytest.raises(ConfigError, match="0, 1 or 2"):
        quantize_linears(tiny_llama(layers=1), activations=3)


@pytest.mark.parametrize("dtype", ["w8a8", "w8a16"])
def test_config_rules(dtype: str) -> None:
    assert TargetConfig(dtype=dtype).resolved_device() == "cpu"
    assert TargetConfig(dtype=dtype).load_dtype == "float32"
    with pytest.raises(ConfigError, match="CPU only"):
        TargetConfig(dtype=dtype, device="cuda").resolved_device()
    assert stable_policy(TargetConfig(dtype=dtype), "cpu") is not None


@pytest.mark.parametrize("digits", [1, 2])
def test_probes_find_it_invariant_from_one_row(digits: int) -> None:
    model = _w8a8_model(digits=digits)
    assert invariant_rows(model) == 1
    assert thread_invariant(model)


@pytest.mark.parametrize("digits", [1, 2])
def test_verify_blocks_give_the_one_by_one_bits(digits: int) -> None:
    target = _target(_w8a8_model(digits=digits), digits)
    assert target.shape_stable
    for k in (2, 5, 9, 20):
        assert _blocks_vs_one_by_one(target, k), k


@pytest.mark.parametrize("digits", [1, 2])
def test_speculation_identical_to_plain_decoding_in_its_precision(digits: int) -> None:
    assert _mismatches(_target(_w8a8_model(digits=digits), digits)) == 0


@pytest.mark.parametrize("dtype", ["w8a8", "w8a16"])
def test_cli_takes_it(dtype: str) -> None:
    from agentspec.cli.console import build_parser

    assert build_parser().parse_args(["bench", "--dtype", dtype]).dtype == dtype
