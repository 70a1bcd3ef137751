"""Int8 weight-only layers: what they compute, where they run, and that speculation over
them is token-identical to plain decoding of the same int8 model (shape-stable forwards,
probed on the int8 kernel like any other product)."""

from __future__ import annotations

import pytest
import torch

from agentspec.errors import ConfigError
from agentspec.targets.base.step_mode import STABLE_STEP
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.targets.kernels import int8
from agentspec.targets.kernels.int8 import Int8Linear, quantize_linears
from agentspec.targets.probes.policy import stable_policy
from agentspec.targets.probes.products import invariant_rows
from tests.conftest import tiny_llama
from tests.unit.test_shape_stable import _blocks_vs_one_by_one, _mismatches

pytestmark = pytest.mark.skipif(not int8.supported(), reason="torch lacks the int8 kernel")


def _int8_model(init: float = 0.02) -> torch.nn.Module:
    model = tiny_llama(layers=4, max_positions=1024, init=init)
    quantize_linears(model)
    return model.to(torch.bfloat16)


def test_int8_linear_is_the_rounded_product() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=True)
    q = Int8Linear(lin.weight, lin.bias)
    x = torch.randn(5, 3, 64)
    want = lin(x)  # [5, 3, 48] fp32
    got = q(x.bfloat16()).float()
    assert got.shape == want.shape and q.qweight.dtype == torch.int8
    # Per weight at most half a step (max|w_j| / 254) off; bf16 activations and output
    # add their own rounding: the sum stays within a few percent of the output's scale.
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    assert q.weight.shape == lin.weight.shape  # the dequantized view, for shape readers
    err = (q.weight.float() - lin.weight).abs().max(dim=1).values
    assert torch.all(err <= lin.weight.abs().max(dim=1).values / 254 + 1e-2)


def test_quantize_replaces_every_linear_and_unties() -> None:
    model = tiny_llama()
    model.config.tie_word_embeddings = True
    n = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert quantize_linears(model) == n
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    assert model.config.tie_word_embeddings is False


def test_quantize_refuses_a_model_off_the_cpu() -> None:
    model = tiny_llama().to("meta")
    with pytest.raises(ConfigError, match="CPU only"):
        quantize_linears(model)


def test_quantize_refuses_a_model_without_linear_layers() -> None:
    with pytest.raises(ConfigError, match=r"no torch\.nn\.Linear"):
        quantize_linears(torch.nn.Sequential(torch.nn.Embedding(4, 4)))


def test_config_rules() -> None:
    assert TargetConfig(dtype="int8").resolved_device() == "cpu"
    assert TargetConfig(dtype="int8").load_dtype == "float32"
    assert TargetConfig(dtype="bfloat16").load_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="CPU only"):
        TargetConfig(dtype="int8", device="cuda").resolved_device()
    with pytest.raises(ConfigError, match="'int4'"):
        TargetConfig(dtype="int4")
    assert stable_policy(TargetConfig(dtype="int8"), "cpu") is not None  # on by default


def test_int8_kernel_is_probed_and_rows_are_stable() -> None:
    model = _int8_model()
    assert invariant_rows(model) is not None  # the probe reaches the int8 layers
    target = HFTarget(model, None, "flat-int8", "int8", "cpu", None,
                      stable_policy(TargetConfig(dtype="int8"), "cpu", model))
    assert target.shape_stable
    for k in (2, 5, 9, 20):
        assert _blocks_vs_one_by_one(target, k), k


def test_int8_speculation_identical_to_plain_int8() -> None:
    model = _int8_model()
    target = HFTarget(model, None, "flat-int8", "int8", "cpu", None,
                      stable_policy(TargetConfig(dtype="int8"), "cpu", model))
    assert _mismatches(target) == 0


def decode_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` inside a decode step (``STABLE_STEP`` set), as a verify forward runs it."""
    token = STABLE_STEP.set(True)
    try:
        out: torch.Tensor = layer(x)
        return out
    finally:
        STABLE_STEP.reset(token)


def test_prefill_rows_take_the_dequantized_weights_and_decode_rows_never_do() -> None:
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 32, bias=False)
    q = Int8Linear(lin.weight, None)
    x = torch.randn(int8.PREFILL_ROWS, 64).bfloat16()  # [64, 64]
    kernel = torch._weight_int8pack_mm(x, q.qweight, q.scales)
    dequant = torch.nn.functional.linear(x, q.weight)
    assert torch.equal(q(x), dequant)  # a prefill chunk
    assert torch.equal(decode_forward(q, x), kernel)  # a decode forward of as many rows
    assert torch.equal(q(x[:5]), kernel[:5])  # few rows: the kernel, whatever the forward
    assert (dequant.float() - kernel.float()).abs().max() <= 0.02 * kernel.float().abs().max()


@pytest.mark.parametrize("kernel", [True, False])
def test_auto_dtype_is_w8a16_on_every_cpu_whatever_the_library(
        monkeypatch: pytest.MonkeyPatch, kernel: bool) -> None:
    """``auto`` is w8a16 on a CPU whose torch has the int8 x int8 product, AVX-512 or not,
    whether the native library loaded or not (it changes speed, never an answer; a choice
    that followed it would change answers with the installation)."""
    from agentspec.targets.kernels import native, w8a8

    monkeypatch.setattr(native, "available", lambda: kernel)
    want = "w8a16" if w8a8.supported() else "float32"
    assert TargetConfig(dtype="auto", device="cpu").dtype == want
    monkeypatch.setattr(w8a8, "supported", lambda: False)
    assert TargetConfig(dtype="auto", device="cpu").dtype == "float32"
    if torch.cuda.is_available():
        assert TargetConfig(dtype="auto", device="cuda").dtype == "float32"


def test_bf16_native_is_measured_and_sets_the_activation_dtype(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from agentspec.targets.base import cpu
    from agentspec.targets.kernels import precision

    assert isinstance(cpu.bf16_native(), bool)
    expect = torch.bfloat16 if cpu.bf16_native() else torch.float32
    assert precision.activation_dtype() == expect
    monkeypatch.setattr(precision, "bf16_native", lambda: False)
    assert precision.activation_dtype() == torch.float32


def test_cli_takes_int8_and_auto() -> None:
    from agentspec.cli.console import build_parser

    parser = build_parser()
    assert parser.parse_args(["demo"]).dtype == "auto"  # the fastest exact, by default
    assert parser.parse_args(["bench"]).dtype == "auto"  # everywhere (the default changed)
    assert parser.parse_args(["bench", "--dtype", "float32"]).dtype == "float32"  # by name
    assert parser.parse_args(["bench", "--dtype", "int8"]).dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--dtype", "int4"])


def test_dequantized_weights_are_the_rounded_exact_products() -> None:
    """The bf16 product the prefill path multiplies rounds each exact ``q · s`` once, as
    an fp32 product rounded to bf16 does."""
    torch.manual_seed(2)
    q = Int8Linear(torch.randn(300, 200) * 0.05, None)
    exact = (q.qweight.double() * q.scales.double()[:, None]).to(torch.bfloat16)
    assert torch.equal(q.weight, exact)


def test_concatenated_layers_give_each_part_its_own_bits() -> None:
    """The direct decode step multiplies q, k and v as one product: each part's columns
    must be the bits its own layer gives, over every decode row count."""
    torch.manual_seed(5)
    parts = [Int8Linear(torch.randn(n, 64), torch.randn(n)) for n in (64, 32, 32)]
    both = Int8Linear.concat(parts)
    assert (both.in_features, both.out_features) == (64, 128)
    token = STABLE_STEP.set(True)
    try:
        for rows in (1, 2, 3, 5, 8, 17):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            assert torch.equal(both(x), torch.cat([p(x) for p in parts], dim=-1)), rows
    finally:
        STABLE_STEP.reset(token)
    with pytest.raises(ConfigError, match="input width"):
        Int8Linear.concat([parts[0], Int8Linear(torch.randn(8, 32), None)])
    with pytest.raises(ConfigError, match="bias"):
        Int8Linear.concat([parts[0], Int8Linear(torch.randn(8, 64), None)])
