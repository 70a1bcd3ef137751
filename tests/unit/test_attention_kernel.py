"""Decode attention's C kernel (``_attention.c``): SDPA's values to rounding (boolean,
additive and no masks, grouped heads, batches, odd head sizes and key counts), and a query
row's bits fixed by construction: the same for any row count 1-33, any place among the
rows, 1, 2 or 3 threads and any number of masked keys after its own, in bf16 and fp32;
the torch products where the library is not loaded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from agentspec.targets.forward import attention
from agentspec.targets.forward.shapes import step_inputs
from agentspec.targets.kernels import native
from agentspec.targets.kernels.attention_kernel import MAX_DIM, decode_attention
from agentspec.targets.probes.attention_rows import attention_rows_invariant

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def thread_counts() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _inputs(b: int, h: int, kv: int, q: int, n: int, d: int, dtype: torch.dtype,
            seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    query = (torch.randn(b, h, q, d, generator=gen) * 2).to(dtype)  # peaky enough to matter
    key = (torch.randn(b, kv, n, d, generator=gen) * 2).to(dtype)
    value = torch.randn(b, kv, n, d, generator=gen).to(dtype)
    return query, key, value


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA in fp64 over the same (rounded) inputs: ``[B, q, H, d]``."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    return torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double(), value.double(), attn_mask=mask,
        enable_gqa=True).transpose(1, 2)


def test_the_kernel_is_built() -> None:
    assert native.available()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["none", "bool", "additive", "additive-bf16", "per-head"])
@pytest.mark.parametrize(("b", "h", "kv", "q", "n", "d"), [
    (1, 14, 2, 1, 700, 64),  # Qwen2.5-0.5B's heads, a plain step
    (1, 9, 3, 5, 300, 64),  # SmolLM2's, a verify
    (2, 6, 3, 4, 37, 16),
    (1, 4, 4, 3, 45, 80),  # no grouping; a head size of 5 vectors
    (1, 2, 1, 2, 19, 13),  # a head size and key count off the 16-lane vectors
])
def test_kernel_computes_sdpa(dtype: torch.dtype, kind: str, b: int, h: int, kv: int,
                              q: int, n: int, d: int) -> None:
    query, key, value = _inputs(b, h, kv, q, n, d, dtype, seed=n + d)
    gen = torch.Generator().manual_seed(q)
    heads = h if kind == "per-head" else 1
    keep = torch.rand(b, heads, q, n, generator=gen) > 0.3
    keep[..., 0] = True  # every query sees a key
    mask: torch.Tensor | None = None
    if kind in ("bool", "per-head"):
        mask = keep
    elif kind == "additive":
        mask = torch.zeros(b, 1, q, n).masked_fill(~keep, torch.finfo(torch.float32).min)
    elif kind == "additive-bf16":
        mask = torch.zeros(b, 1, q, n, dtype=torch.bfloat16).masked_fill(
            ~keep, torch.finfo(torch.bfloat16).min)
    got = decode_attention(query, key, value, mask, d ** -0.5)
    assert got is not None and got.dtype == dtype and got.shape == (b, q, h, d)
    assert got.is_contiguous()
    want = _sdpa(query, key, value, mask)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    else:  # one bf16 rounding of the fp32 result
        assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-5).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_stable_attention_takes_the_kernel_on_views_and_broadcast_masks(
        dtype: torch.dtype) -> None:
    """The direct step's operands: queries a strided view of the projection, keys a prefix
    of a longer cache buffer, a 2-d mask with more columns than keys."""
    heads, kv, rows, d, n = 14, 2, 3, 64, 200
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(1, rows, heads + 2 * kv, d, generator=gen).to(dtype).transpose(1, 2)
    query = qkv[:, :heads]  # [1, heads, rows, d], not contiguous
    buffer = torch.randn(2, 1, kv, 512, d, generator=gen).to(dtype)
    key, value = buffer[0, :, :, :n], buffer[1, :, :, :n]
    mask = step_inputs(torch.tensor(n - rows), rows, 512, dtype)[1][0, 0]  # [rows, 512]
    got = attention.stable_attention(query, key, value, mask, d ** -0.5)
    want = decode_attention(query.contiguous(), key.contiguous(), value.contiguous(),
                            mask[:, :n].contiguous(), d ** -0.5)
    assert want is not None and torch.equal(got, want)


def test_a_key_alone_gives_its_value_exactly() -> None:
    """Every other key masked: weight exactly 1 on the one and exact zeros elsewhere."""
    query, key, value = _inputs(1, 6, 2, 2, 100, 64, torch.float32, seed=5)
    keep = torch.zeros(1, 1, 2, 100, dtype=torch.bool)
    keep[0, 0, 0, 37] = keep[0, 0, 1, 99] = True
    got = decode_attention(query, key, value, keep, 0.125)
    assert got is not None
    assert torch.equal(got[0, 0], value[0, torch.arange(6) // 3, 37])
    assert torch.equal(got[0, 1], value[0, torch.arange(6) // 3, 99])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv"), [(14, 2), (9, 3)])
def test_a_rows_bits_do_not_depend_on_rows_place_threads_or_masked_keys(
        dtype: torch.dtype, heads: int, kv: int, thread_counts: None) -> None:
    """33 consecutive query rows near the end of 1,024 keys, each attended alone on one
    thread, then windows of 2-33 of them (first, middle and last place) on 1, 2 or 3
    threads, over the rows' own keys or over 301 more masked ones (a key count off the
    16-key blocks), in the shipped models' head shapes: every row keeps its bits. (torch's
    products failed this in SmolLM2's shape on an AMD EPYC: rows of most row counts
    rounded otherwise.)"""
    d, n, block = 64, 1024, 33
    long = n + 301
    query, key, value = _inputs(1, heads, kv, block, long, d, dtype, seed=7)
    mask = step_inputs(torch.tensor(n - block - 5), block, long, dtype)[1]  # [1, 1, 33, long]
    torch.set_num_threads(1)
    alone = torch.cat([attention.stable_attention(
        query[:, :, i : i + 1], key[:, :, :n], value[:, :, :n], mask[:, :, i : i + 1, :n],
        d ** -0.5) for i in range(block)], dim=1)  # [1, 33, heads, d]
    for rows in range(2, block + 1):
        torch.set_num_threads(1 + rows % 3)
        span = long if rows % 2 else n
        for at in sorted({0, (block - rows) // 2, block - rows}):
            got = attention.stable_attention(
                query[:, :, at : at + rows], key[:, :, :span], value[:, :, :span],
                mask[:, :, at : at + rows, :span], d ** -0.5)
            assert torch.equal(got, alone[:, at : at + rows]), (rows, at, span)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_load_time_probe_finds_the_kernel_invariant(dtype: torch.dtype) -> None:
    for heads, kv in ((14, 2), (9, 3)):
        assert attention_rows_invariant(heads, kv, 64, dtype, keys=(512, 1024), trials=1)


def test_inputs_it_does_not_take_return_none() -> None:
    query, key, value = _inputs(1, 4, 2, 1, 10, 16, torch.float32, seed=0)
    assert decode_attention(query.half(), key.half(), value.half(), None, 0.25) is None
    assert decode_attention(query, key.bfloat16(), value, None, 0.25) is None
    wide = _inputs(1, 4, 2, 1, 10, MAX_DIM + 16, torch.float32, seed=0)
    assert decode_attention(*wide, None, 0.25) is None
    assert decode_attention(query, key, value, torch.ones(3, 1, 1, 10, dtype=torch.bool),
                            0.25) is None  # a mask that does not broadcast
    assert decode_attention(query, key[:, :, :0], value[:, :, :0], None, 0.25) is None
    with torch.enable_grad():
        assert decode_attention(query.requires_grad_(), key, value, None, 0.25) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_the_library_stable_attention_runs_torchs_products(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    query, key, value = _inputs(1, 6, 2, 3, 40, 16, dtype, seed=9)
    mask = step_inputs(torch.tensor(37), 3, 40, dtype)[1]
    with_kernel = attention.stable_attention(query, key, value, mask)
    monkeypatch.setattr(native, "library", lambda: None)
    got = attention.stable_attention(query, key, value, mask)
    assert torch.equal(got, attention.torch_stable_attention(query, key, value, mask))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), with_kernel.float(), atol=tol, rtol=tol)
