"""The C kernel of w8a8's and w8a16's activation digits: the same bits as the torch
operators it replaces (quantization and recombination, fp32 and bf16, every high digit's
integer), a whole model's logits identical with and without it, and the torch operators
taking over when it is switched off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agentspec.targets.kernels import fused_digits, native, w8a8
from agentspec.targets.kernels.int8 import quantize_linears
from agentspec.targets.kernels.w8a8 import W8A8Linear, quantize_ops
from tests.conftest import tiny_llama

pytestmark = pytest.mark.skipif(not w8a8.supported(), reason="torch lacks torch._int_mm")


def test_the_kernel_is_built_at_install() -> None:
    """``pip install`` (``make venv``) builds the kernel as an extension beside its module
    and it loads: no compiler is looked for at run time."""
    path = native.library_path()
    assert path is not None and path.parent == Path(native.__file__).parent
    assert fused_digits.available() and native.available()


def test_a_profile_shows_the_kernel() -> None:
    """Each C call is one named event in ``torch.profiler`` (ctypes calls are otherwise
    invisible to it)."""
    rows = torch.randn(2, 64)
    with torch.profiler.profile() as prof:
        assert fused_digits.quantize(rows, 2) is not None
    names = {e.name for e in prof.events()}
    assert "agentspec::quantize_digits" in names

SHAPES = [(1, 896), (2, 4864), (7, 33), (16, 896), (64, 100), (3, 1)]


def _rows(m: int, k: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    rows = torch.randn(m, k) * scale * torch.rand(m, 1) * 10  # rows of unlike scales
    rows[0, : min(3, k)] = 0.0
    if m > 2:
        rows[1] = 0.0  # an all-zero row
    return rows.to(dtype)


@pytest.fixture
def torch_ops() -> Iterator[None]:
    """The kernel switched off for the test's duration (as where no compiler is found)."""
    lib, tried = native._lib, native._tried
    native._lib, native._tried = None, True
    try:
        yield
    finally:
        native._lib, native._tried = lib, tried


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("digits", [1, 2])
def test_quantize_and_combine_give_the_torch_operators_bits(dtype: torch.dtype,
                                                            digits: int) -> None:
    torch.manual_seed(digits)
    for m, k in SHAPES:
        layer = W8A8Linear(torch.randn(257, k), torch.randn(257), digits=digits)
        for scale in (1e-3, 1.0, 37.0, 1e4):
            rows = _rows(m, k, scale, dtype)
            fused = fused_digits.quantize(rows, digits)
            assert fused is not None
            q, u = quantize_ops(rows, digits)
            assert torch.equal(fused[0], q) and torch.equal(fused[1], u), (m, k, scale)
            acc = torch._int_mm(q, layer.qweight.t())  # [digits·m, 257]
            for bias in (None, layer.bias):
                got = fused_digits.combine(acc, layer.scales, u, bias, dtype)
                assert got is not None and got.dtype == dtype
                assert torch.equal(got, layer.combine_ops(acc, u, dtype, bias)), (m, k)


def test_every_high_digit_matches() -> None:
    # Each fixed-point integer |n| <= 32,258 appears once: the high digit's rounded
    # division (and the low digit's remainder) agree for all of them, ties included.
    n = torch.arange(-32258, 32259, dtype=torch.float32)[None, :]
    fused = fused_digits.quantize(n, 2)
    assert fused is not None
    q, u = quantize_ops(n, 2)
    assert torch.equal(fused[0], q) and torch.equal(fused[1], u)
    assert int(q.abs().max()) <= 127


def test_the_peak_is_found_wherever_it_sits() -> None:
    # The kernel keeps the row's maximum in 16 lanes and a tail: a peak in any lane or in
    # the tail, negative or positive, sets the scale; a NaN anywhere makes it NaN.
    torch.manual_seed(3)
    k = 16 * 3 + 5
    for at in range(k):
        for sign in (1.0, -1.0):
            rows = torch.rand(2, k) - 0.5
            rows[0, at] = 40.0 * sign
            fused = fused_digits.quantize(rows, 2)
            assert fused is not None
            q, u = quantize_ops(rows, 2)
            assert torch.equal(fused[0], q) and torch.equal(fused[1], u), (at, sign)
    rows = torch.rand(2, k)
    rows[0, 20] = float("nan")
    fused = fused_digits.quantize(rows, 1)
    assert fused is not None
    u = quantize_ops(rows, 1)[1]
    assert bool(fused[1][0].isnan()) and bool(u[0].isnan()) and torch.equal(fused[1][1], u[1])


def test_a_transposed_input_is_read_as_its_values() -> None:
    rows = torch.randn(40, 6).t()  # not contiguous
    fused = fused_digits.quantize(rows, 2)
    assert fused is not None and torch.equal(fused[0], quantize_ops(rows, 2)[0])


@pytest.mark.parametrize("digits", [1, 2])
def test_a_forward_of_no_rows_gives_no_rows(digits: int) -> None:
    layer = W8A8Linear(torch.randn(8, 16), torch.randn(8), digits=digits)
    assert layer(torch.randn(0, 16)).shape == (0, 8)
    assert layer(torch.randn(2, 0, 16)).shape == (2, 0, 8)


def test_other_dtypes_are_left_to_torch() -> None:
    rows = torch.randn(2, 8, dtype=torch.float64)
    assert fused_digits.quantize(rows, 2) is None
    acc = torch.zeros(4, 3, dtype=torch.int32)
    assert fused_digits.combine(acc, torch.ones(3), torch.ones(2, 1), None,
                                torch.float16) is None


@pytest.mark.parametrize("digits", [1, 2])
def test_a_models_logits_are_the_same_with_the_kernel_or_without(digits: int,
                                                                 request: pytest.FixtureRequest
                                                                 ) -> None:
    model = tiny_llama(layers=2, max_positions=256)
    quantize_linears(model, activations=digits)
    ids = torch.randint(0, 96, (1, 37), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        fused = model(ids).logits
        request.getfixturevalue("torch_ops")
        assert fused_digits.quantize(torch.ones(1, 4), digits) is None  # switched off
        ops = model(ids).logits
    assert torch.equal(fused, ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("digits", [1, 2])
def test_a_whole_layer_in_one_call_gives_the_three_calls_bits(dtype: torch.dtype,
                                                               digits: int) -> None:
    """``fused_digits.linear`` (digits, int8 product and recombination in one C call,
    each output recombined by the thread that summed it) against the torch operators'
    quantization, an int32 matmul and ``combine_ops``: every bit, with and without a bias,
    at every row count it takes; above :data:`~.fused_digits.LINEAR_MAX_ROWS` digit rows it
    declines."""
    torch.manual_seed(11 + digits)
    for k, n in ((896, 1152), (100, 257), (67, 13), (1, 5)):
        layer = W8A8Linear(torch.randn(n, k), torch.randn(n), digits=digits)
        for m in (1, 2, 3, 5, 8, 17, 33, fused_digits.LINEAR_MAX_ROWS // digits):
            rows = _rows(m, k, 3.0, dtype)
            q, u = quantize_ops(rows, digits)
            acc = q.int() @ layer.qweight.int().t()  # [digits·m, n] exact
            for bias in (None, layer.bias):
                got = fused_digits.linear(rows, layer.qweight, layer.scales, bias, digits)
                assert got is not None and got.dtype == dtype
                assert torch.equal(got, layer.combine_ops(acc, u, dtype, bias)), (k, n, m)
        too_many = torch.randn(fused_digits.LINEAR_MAX_ROWS // digits + 1, k)
        assert fused_digits.linear(too_many, layer.qweight, layer.scales, None, digits) is None


def test_a_decode_forward_runs_each_layer_as_one_call() -> None:
    """A few-rows forward of a w8a16 layer takes the one-call kernel (the profile shows it,
    not the three calls), and gives what the three calls give."""
    layer = W8A8Linear(torch.randn(96, 64), torch.randn(96), digits=2)
    rows = torch.randn(3, 64)
    with torch.profiler.profile() as prof:
        got = layer(rows)
    names = {e.name for e in prof.events()}
    assert "agentspec::int8_linear" in names and "agentspec::quantize_digits" not in names
    q, u = quantize_ops(rows, 2)
    assert torch.equal(got, layer.combine_ops(q.int() @ layer.qweight.int().t(), u,
                                              torch.float32, layer.bias))
