"""Decode attention on the native kernel (``_attention.c``): a query row's bits fixed by
construction, whatever the forward's row count, the row's place, the thread count, the
CPU or the number of masked keys after the row's own.

Why: :func:`~agentspec.targets.forward.attention.stable_attention` computed decode
attention with torch's matrix products, and their libraries pick a kernel, and with it the
order of a sum, by shape, thread count and CPU: on some CPUs a row of a verify rounded
otherwise than the one-row step (docs/cpu_step.md, "Decode attention in C"). The kernel
computes every output row on one thread, each sum in an order written in the code (see
its header), in fp32 from bf16 or fp32 inputs.

Unlike the other native kernels, this one has no torch reference with its bits (torch
has no fixed-order attention): where the library is not loaded the caller computes with
torch's products, whose invariance the load-time probe
(:func:`~agentspec.targets.probes.attention_rows.attention_invariant`) checks. Either way
plain and speculative decoding in one process take the same path.
"""

from __future__ import annotations

from array import array

import torch

from agentspec.targets.kernels import native

__all__ = ["MAX_DIM", "decode_attention"]

#: Largest head size the kernel takes (larger heads keep torch's products).
MAX_DIM = 256

# The kernel's mask kinds (0: none); any other mask dtype is widened to fp32 first.
_MASK_KINDS = {torch.bool: 1, torch.float32: 2, torch.bfloat16: 3}


def _mask_operand(mask: torch.Tensor | None, shape: tuple[int, int, int, int]
                  ) -> tuple[torch.Tensor | None, int, tuple[int, ...]] | None:
    """The mask as the kernel reads it: the tensor (last dimension contiguous, at least
    ``n`` columns of which the first ``n`` count), its kind and its batch, head and row
    strides broadcast to ``shape`` ``[B, H, q, n]`` (0 along a broadcast dimension); None
    where it does not broadcast. Strides are computed here rather than by ``expand``
    (microseconds per layer and step)."""
    if mask is None:
        return None, 0, (0, 0, 0)
    if mask.dim() > 4 or mask.shape[-1] < shape[3]:
        return None
    if mask.dtype not in _MASK_KINDS:
        mask = mask.float()
    if mask.stride(-1) != 1:
        mask = mask[..., : shape[3]].contiguous()
    lead = 4 - mask.dim()
    sizes = (1,) * lead + tuple(mask.shape[:-1])
    steps = (0,) * lead + tuple(mask.stride()[:-1])
    strides = []
    for size, step, want in zip(sizes, steps, shape[:3], strict=True):
        if size != 1 and size != want:
            return None
        strides.append(0 if size == 1 else step)
    return mask, _MASK_KINDS[mask.dtype], tuple(strides)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """``softmax(q kᵀ · scale + mask) v`` on the native kernel: query ``[B, H, q, d]``,
    key and value ``[B, kv_heads, n, d]`` (query head ``h`` attends key/value head
    ``h // (H / kv_heads)``), a mask broadcastable to ``[B, H, q, n]`` after its first
    ``n`` key columns (boolean, True where a query attends, or additive), all on the CPU in
    one dtype, fp32 or bf16; returns ``[B, q, H, d]`` in that dtype, or ``None`` where the
    library is not loaded or the inputs are not ones it takes (the caller computes with
    torch then)."""
    lib = native.library()
    dtype = query.dtype
    if (lib is None or dtype not in (torch.float32, torch.bfloat16)
            or key.dtype != dtype or value.dtype != dtype
            or query.device.type != "cpu" or key.device.type != "cpu"
            or value.device.type != "cpu" or query.dim() != 4 or key.dim() != 4
            or (torch.is_grad_enabled()
                and (query.requires_grad or key.requires_grad or value.requires_grad))):
        return None
    b, h, q, d = query.shape
    kv, n = key.shape[1], key.shape[2]
    if (d > MAX_DIM or n < 1 or kv < 1 or h % kv or key.shape != (b, kv, n, d)
            or value.shape != (b, kv, n, d)):
        return None
    operand = _mask_operand(mask, (b, h, q, n))
    if operand is None:
        return None
    m, kind, mask_strides = operand
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    out = torch.empty(b, q, h, d, dtype=dtype)  # [B, q, H, d]
    if out.numel() == 0:
        return out
    call = array("q", (query.data_ptr(), key.data_ptr(), value.data_ptr(),
                       0 if m is None else m.data_ptr(), out.data_ptr(),
                       dtype == torch.bfloat16, kind, b, h, kv, q, n, d,
                       *query.stride()[:3], *key.stride()[:3], *value.stride()[:3],
                       *mask_strides))
    args = (call.buffer_info()[0], scale, torch.get_num_threads())
    rc = native.call("agentspec::attention", lib.agentspec_attention, *args)
    if rc == 1:
        raise MemoryError("decode attention: no memory for the kernel's scratch")
    return out if rc == 0 else None
