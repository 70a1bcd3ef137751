"""Grouped-query attention without copying the KV cache, for multi-token forwards on CPU.

Models with grouped-query attention (SmolLM2: 9 query heads over 3 key/value heads;
Qwen2.5-0.5B: 14 over 2) share each cached key/value head between several query heads.
transformers' SDPA path lets PyTorch do that sharing (``enable_gqa``) only when no
attention mask is passed, or for a single query token. Every forward that speculative
decoding adds has a mask and several queries: verifying a draft (causal over the new
tokens, full over the cache), a draft tree (tree attention) and the part of a prompt fed
after reused prefix KV. There transformers first copies keys and values once per query
head (``repeat_kv``: ~3x the cache, per layer, per forward), and at long contexts that copy
can cost more than the attention itself (``docs/prefix-cache.md``).

:func:`install_gqa_attention` registers ``"agentspec_sdpa"``: the same SDPA kernel with
``enable_gqa`` for those forwards and transformers' own function for everything else. PyTorch's CPU
kernel computes each query head against its shared key/value head exactly as against the
copy, so logits are bit-identical (tested), and the lossless guarantee is unchanged. On
CUDA, SDPA with a mask and ``enable_gqa`` can fall back to a slower kernel, so the target
installs it on CPU only.

One-row forwards (plain decoding steps) and shape-stable decode forwards
(:mod:`agentspec.targets.forward.shapes`, while :data:`STABLE_STEP` is set) on the CPU take
:func:`stable_attention` instead: the native kernel
(:mod:`agentspec.targets.kernels.attention_kernel`), which computes each query row on one
thread, in fp32, with every sum in an order its code fixes. PyTorch's CPU SDPA kernel takes
another branch for one or two query rows than for more, so a row's bits would depend on how
many rows share its forward, and for one query row it splits the keys between threads, so
its bits depend on the thread count (which the live cost lowers on a loaded machine). The
kernel gives a row the same bits for any row count, any place among the rows, any thread
count and any number of masked keys after the row's own, on every CPU, by construction
(tested, and probed at load by
:func:`~agentspec.targets.probes.attention_rows.attention_invariant`), so a one-row plain
step needs no padding rows. Where the library is not loaded, torch's products stand in
(:func:`torch_stable_attention`: the query heads of a group stacked as the rows of one
product, the values multiplied in fp32 blocks of 512 keys), invariant only where the CPU's
libraries happen to be; the probe decides (docs/cpu_step.md).

A prompt's tail of :data:`SPLIT_ROWS` or more tokens fed after cached positions, in a
reduced precision, takes :func:`split_tail_attention`: the masked kernel above is the
largest part of such a forward at agent contexts, and two unmasked passes merged by their
log-sum-exp cost less. fp32 keeps transformers' kernel, so its prompts keep the
reference's bits.
"""

from __future__ import annotations

from typing import Any

import torch

from agentspec.targets.base.step_mode import STABLE_STEP
from agentspec.targets.kernels import attention_kernel

#: The name under which the attention function (and its mask builder) is registered.
ATTENTION_NAME = "agentspec_sdpa"


#: Keys per block of torch's value product in a shape-stable step
#: (:func:`torch_stable_attention`); the CPU's key alignment
#: (:data:`~agentspec.targets.forward.shapes.CPU_ALIGN`) is this, so an aligned span is whole
#: blocks.
VALUE_BLOCK = 512


def stable_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     block: int | None = VALUE_BLOCK) -> torch.Tensor:
    """Row-invariant attention: query ``[B, H, q, d]``, key and value ``[B, kv_heads, n,
    d]``, a mask ``[B, 1, q, n]`` (additive, or boolean with True where a query attends);
    returns ``[B, q, H, d]``.

    On the CPU, where the native library is loaded, it is the C kernel
    (:func:`~agentspec.targets.kernels.attention_kernel.decode_attention`): fp32 inside,
    every output row computed by one thread with its sums in an order fixed by the code,
    so a row's bits do not depend on the row count, its place, the thread count, the key
    span's masked tail or the CPU's products, by construction. Elsewhere,
    :func:`torch_stable_attention` (``block`` is its)."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = attention_kernel.decode_attention(query, key, value, attention_mask, scale)
    if out is not None:
        return out
    return torch_stable_attention(query, key, value, attention_mask, scale, block)


def torch_stable_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None,
                           block: int | None = VALUE_BLOCK) -> torch.Tensor:
    """:func:`stable_attention` in torch's products, where the C kernel does not run (the
    library not loaded, another device or dtype).

    The ``g = H / kv_heads`` query heads sharing a key/value head are stacked as the rows
    of one product against it (no copy of the cache per query head); the softmax and the
    product of its weights with the values run in fp32, the latter in ``block``-key
    blocks added in order (``None``: one product).

    Why: the value product sums over the keys, and a library picks its kernel, and how
    it splits that sum, by shape. In bf16, a product of some row counts ``g * q`` rounded a
    row otherwise than a one-row step's; in fp32 over the whole key length, some key
    lengths did (the masked keys past a query add exact zeros, but the split moves). Either
    let a verify's row differ from the plain step's and a greedy answer change under
    speculation (docs/cpu_step.md has the cases). In fp32 blocks of a fixed key count, each
    product has one shape whatever the key length, and the blocks past a query's keys add
    exact zeros. Even so the products' kernels are the library's: on some CPUs (an AMD EPYC
    with AVX-512, one with AVX2 only) a row's bits still changed with the row count.
    :func:`~agentspec.targets.probes.attention_rows.attention_invariant` checks row counts,
    thread counts and key lengths at load, and a target whose check fails runs every decode
    forward in one shape."""
    b, h, q, d = query.shape
    kv, n = key.shape[1], key.shape[-2]
    g = h // kv
    scale = d ** -0.5 if scaling is None else scaling
    rows = query.reshape(b, kv, g * q, d)  # [B, kv, g*q, d]: a group's heads as rows
    scores = torch.matmul(rows, key.transpose(-1, -2)).view(b, h, q, n).float() * scale
    if attention_mask is not None:
        mask = attention_mask[..., :n]
        if mask.dtype == torch.bool:  # transformers' SDPA masks: True = attend
            scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        else:  # additive
            scores = scores + mask.float()  # [B, H, q, n]
    probs = torch.softmax(scores, dim=-1).view(b * kv, g * q, n)  # fp32
    values = value.float().reshape(b * kv, n, d)  # [B*kv, n, d]
    if block is None:
        out = torch.bmm(probs, values)  # [B*kv, g*q, d] fp32
    else:
        out = torch.zeros(b * kv, g * q, d, dtype=probs.dtype, device=probs.device)
        for c in range(0, n, block):  # out += probs[:, :, c:c+block] @ values[:, c:c+block]
            out.baddbmm_(probs[:, :, c : c + block], values[:, c : c + block])
    return out.to(value.dtype).view(b, h, q, d).transpose(1, 2).contiguous()


def gqa_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query ``[B, H, q, d]``, key and value
    ``[B, kv_heads, n, d]``, an additive or boolean mask ``[B, 1, q, n]``; returns
    ``([B, q, H, d], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    special = kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
    if (STABLE_STEP.get() or query.shape[2] == 1) and not special and dropout == 0.0:
        # One query row (a plain step): PyTorch's CPU SDPA splits the keys by thread for a
        # single query, so its bits depend on the thread count, which the live cost lowers
        # on a loaded machine; these products do not.
        block = VALUE_BLOCK if STABLE_STEP.get() else None  # a plain fp32 step: one product
        return stable_attention(query, key, value, attention_mask, scaling, block), None
    if query.dtype != torch.float32 and not special and dropout == 0.0:
        # A prompt's tail after cached positions (bf16, the int8 precisions; fp32 keeps
        # transformers' kernel, the reference's bits): two unmasked passes.
        out = split_tail_attention(query, key, value, attention_mask, scaling)
        if out is not None:
            return out, None
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    plain = (attention_mask is None or query.shape[2] == 1 or groups == 1
             or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        enable_gqa=True)  # [B, H, q, d]
    return out.transpose(1, 2).contiguous(), None


def install_gqa_attention(model: Any, always: bool = False) -> bool:
    """Switch ``model`` from transformers' SDPA attention to :func:`gqa_sdpa_forward`.

    Only models that use ``"sdpa"`` and have grouped key/value heads change (with
    ``always``, models without grouped heads too: one-row and shape-stable steps take
    :func:`stable_attention`); others (eager, flash) keep what they have.

    Returns:
        Whether the model now uses ``"agentspec_sdpa"``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads or (heads == kv_heads and not always):
        return False
    AttentionInterface.register(ATTENTION_NAME, gqa_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)
    return True


#: Fewest query rows for which a prompt's forward after cached positions splits its
#: attention (:func:`split_tail_attention`); verifies and short tails keep one kernel.
SPLIT_ROWS = 32


def _tail_mask(mask: torch.Tensor | None, t: int, n: int) -> bool:
    """Whether ``mask`` (boolean, ``[1, 1, t, n]``) lets each of the last ``t`` rows see
    every cached position and the tail causally: the only mask the split computes."""
    if mask is None or mask.dtype != torch.bool or tuple(mask.shape) != (1, 1, t, n):
        return False
    rows = mask[0, 0]  # [t, n]
    # Every cached key seen (min over bytes: bool all() over a strided view is ~15x
    # slower here), then the tail's own causal triangle.
    if not bool(rows[:, : n - t].view(torch.uint8).min() == 1):
        return False
    return torch.equal(rows[:, n - t :], torch.ones(t, t, dtype=torch.bool).tril_())


def split_tail_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None,
                         scaling: float | None = None) -> torch.Tensor | None:
    """Attention of a prompt's tail fed after cached positions, in two unmasked parts:
    query ``[1, H, t, d]`` (bf16), key and value ``[1, kv_heads, n, d]`` whose last ``t``
    positions are the tail's own; returns ``[1, t, H, d]``, or None where the mask is not
    the tail's (every cached position plus the causal tail) or the shapes do not fit.

    Why. With a mask PyTorch's CPU flash kernel reads it for every block and handles each
    query head apart; without one it runs its fastest loop. So the ``g`` query heads of a
    group are stacked as the rows of one unmasked pass over the cached positions, and the
    tail attends to itself with the kernel's own causal mask. Each pass returns its
    log-sum-exp ``ℓ``, and the two merge exactly as softmax over the union does:
    ``o = (o₁·e^{ℓ₁} + o₂·e^{ℓ₂}) / (e^{ℓ₁} + e^{ℓ₂})``. Both passes and the merge run in
    fp32 (the kernel costs the same as in bf16 here) and the output is rounded once.
    """
    b, h, t, d = query.shape
    kv, n = key.shape[1], key.shape[-2]
    if (b != 1 or t < SPLIT_ROWS or n <= t or h % kv or query.device.type != "cpu"
            or not _tail_mask(attention_mask, t, n)):
        return None
    g, cached = h // kv, n - t
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    q = query.float()
    k, v = key.float(), value.float()  # [1, kv, n, d]
    past, past_lse = flash(q.reshape(1, kv, g * t, d), k[:, :, :cached], v[:, :, :cached],
                           scale=scaling)[:2]  # [1, kv, g*t, d], [1, kv, g*t]
    past, past_lse = past.reshape(1, h, t, d), past_lse.reshape(1, h, t)
    own, own_lse = flash(q, k[:, :, cached:].repeat_interleave(g, 1),
                         v[:, :, cached:].repeat_interleave(g, 1), is_causal=True,
                         scale=scaling)[:2]  # [1, h, t, d], [1, h, t]
    top = torch.maximum(past_lse, own_lse)
    w_past = torch.exp(past_lse - top)[..., None]  # [1, h, t, 1]
    w_own = torch.exp(own_lse - top)[..., None]
    out = (past * w_past + own * w_own) / (w_past + w_own)  # [1, h, t, d] fp32
    return out.to(query.dtype).transpose(1, 2).contiguous()
