"""A prompt's tail after cached positions attends in two unmasked passes merged by their
log-sum-exp: the same attention as the masked kernel (to rounding), the same bits with
any thread count, and only for the mask it was written for."""

from __future__ import annotations

import copy

import pytest
import torch

from agentspec.targets.forward import attention
from agentspec.targets.forward.attention import SPLIT_ROWS, split_tail_attention
from agentspec.targets.hf import HFTarget
from tests.conftest import TINY_VOCAB


def _qkv(t: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 6, t, 16, generator=gen).to(dtype)  # [1, H, t, d]: 3 per kv head
    k = torch.randn(1, 2, n, 16, generator=gen).to(dtype)  # [1, kv, n, d]
    v = torch.randn(1, 2, n, 16, generator=gen).to(dtype)
    return q, k, v


def _tail_mask(t: int, n: int) -> torch.Tensor:
    return torch.ones(t, n, dtype=torch.bool).tril(n - t)[None, None]  # [1, 1, t, n]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)  # [1, t, H, d]


@pytest.mark.parametrize("t,n", [(SPLIT_ROWS, SPLIT_ROWS + 1), (40, 300), (97, 611)])
def test_split_attention_is_the_masked_attention(t: int, n: int) -> None:
    """fp32 in: within fp32 rounding of the masked softmax over every key; bf16 in: within
    one bf16 rounding of it."""
    mask = _tail_mask(t, n)
    q, k, v = _qkv(t, n, torch.float32)
    got = split_tail_attention(q, k, v, mask)
    assert got is not None and got.shape == (1, t, 6, 16)
    torch.testing.assert_close(got.double(), _reference(q, k, v, mask), atol=2e-6, rtol=1e-5)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    got_b = split_tail_attention(qb, kb, vb, mask)
    assert got_b is not None and got_b.dtype == torch.bfloat16
    ref_b = _reference(qb, kb, vb, mask)
    assert ((got_b.double() - ref_b).abs() <= ref_b.abs() * 2 ** -8 + 1e-6).all()


def test_split_attention_bits_do_not_depend_on_the_thread_count() -> None:
    threads = torch.get_num_threads()
    if threads == 1:
        pytest.skip("one thread: nothing to compare (CI machines have 2)")
    q, k, v = _qkv(70, 900, torch.bfloat16, seed=3)
    mask = _tail_mask(70, 900)
    outs = []
    try:
        for count in (threads, 1):
            torch.set_num_threads(count)
            outs.append(split_tail_attention(q, k, v, mask))
    finally:
        torch.set_num_threads(threads)
    assert outs[0] is not None and torch.equal(outs[0], outs[1])


def test_other_masks_and_shapes_keep_the_masked_kernel() -> None:
    """Anything but the tail's own mask (a tree, padding, a sliding window), a short tail,
    a cold prompt or a batch: None, and the caller keeps SDPA."""
    t, n = 40, 200
    q, k, v = _qkv(t, n, torch.bfloat16)
    mask = _tail_mask(t, n)
    assert split_tail_attention(q, k, v, mask) is not None
    holed = mask.clone()
    holed[0, 0, 5, 3] = False  # a padded or windowed key
    assert split_tail_attention(q, k, v, holed) is None
    tree = mask.clone()
    tree[0, 0, 10, n - t + 4] = False  # a tree draft: a row not seeing an earlier node
    assert split_tail_attention(q, k, v, tree) is None
    same = mask.clone()
    assert split_tail_attention(q, k, v, same) is not None  # the same mask passes ...
    same[0, 0, 3, 7] = False  # ... and fails once written in place (checked every call)
    assert split_tail_attention(q, k, v, same) is None
    assert split_tail_attention(q, k, v, None) is None
    assert split_tail_attention(q, k, v, mask.float()) is None  # additive masks: not handled
    short = SPLIT_ROWS - 1
    assert split_tail_attention(q[:, :, :short], k[:, :, : n - t + short],
                                v[:, :, : n - t + short],
                                _tail_mask(short, n - t + short)) is None
    assert split_tail_attention(q, k[:, :, :t], v[:, :, :t], _tail_mask(t, t)) is None
    batch = torch.cat([q, q])
    assert split_tail_attention(batch, torch.cat([k, k]), torch.cat([v, v]),
                                torch.cat([mask, mask])) is None


def test_a_bf16_tail_prefill_takes_the_split_and_matches_a_cold_prefill(
        tiny_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the target: a bf16 tail of 48 tokens after reused KV runs the split (counted)
    and its last logits match one cold forward over the whole prompt to bf16 rounding; an
    fp32 target never takes it."""
    calls: list[bool] = []
    real = attention.split_tail_attention

    def counted(*args: object, **kwargs: object) -> torch.Tensor | None:
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(out is not None)
        return out

    monkeypatch.setattr(attention, "split_tail_attention", counted)
    prompt = [(7 * i) % (TINY_VOCAB - 2) + 2 for i in range(160)]
    logits = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = copy.deepcopy(tiny_model).to(dtype)
        name = "bfloat16" if dtype == torch.bfloat16 else "float32"
        target = HFTarget(model, None, "tiny-llama", name, "cpu")
        cold = target.prefill(prompt).float()
        target.prefill(prompt[:112])
        calls.clear()
        tail = target.scoring.feed(prompt[112:], last_only=True)[-1].float()
        logits[name] = (cold, tail, any(calls))
    cold, tail, split = logits["bfloat16"]
    assert split
    torch.testing.assert_close(tail, cold, atol=0.05, rtol=0.02)
    assert not logits["float32"][2]
