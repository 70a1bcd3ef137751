"""Int8 weights and int8 activations on the CPU: integer sums, so a verify of many rows
costs little more than one row, and every row's bits are the same at any row count.

:mod:`.int8` keeps bf16 activations: its kernel converts each weight to float for each
row, so its cost grows almost linearly with the rows (docs/cpu_step.md has the figures).
Here each activation row is quantized too, symmetrically per row (per token), and the
product runs on the CPU's int8 dot-product units (``torch._int_mm``: int8 × int8 summed in
int32):

    a[r]    = max_k |x[r, k]| / 127          q_x[r, k] = round(x[r, k] / a[r])
    y[r, j] = bf16( (Σ_k q_x[r, k] · q_w[j, k]) · s[j] · a[r] + b[j] )

The weights ``q_w``, ``s`` are :mod:`.int8`'s (per output row, from the fp32 weights).

**Why exact by construction.** An integer sum has one value whatever order a kernel adds
it in, so the product of a row does not depend on the row count, the row's place, the
kernel the library picks for that shape or the thread count; the row's scale comes from a
maximum (exact in any order) and the rest is element-wise. Speculation is therefore
token-identical to plain decoding of the same model with no padding of decode forwards,
and prefill chunks take the same kernel (faster than bf16's GEMM over many rows), so the
prompt's KV is what one-row steps would write.

**What it gives up.** Quantizing activations loses more than quantizing weights alone:
answers drift further from fp32's than int8's do (docs/cpu_step.md measures by how much).
It is an opt-in precision (``dtype="w8a8"``), never ``auto``'s choice.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SharedInput", "W8A8Linear", "quantize_rows", "quantize_weight", "supported"]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8 quantization of a linear layer's ``weight``
    ``[out, in]``, from its fp32 values whatever it is stored in (int8's and w8a8's
    weights alike).

    Returns:
        ``(q, s)``: ``q`` ``[out, in]`` int8 in ``[-127, 127]`` (contiguous) and ``s``
        ``[out]`` fp32 with ``weight ≈ q · s``.
    """
    w = weight.detach().float()  # [out, in]
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization of activations ``rows`` ``[m, k]``.

    Returns:
        ``(q, a)``: ``q`` ``[m, k]`` int8 in ``[-127, 127]`` and ``a`` ``[m, 1]`` fp32 with
        ``rows ≈ q · a``. Each row's values depend on that row alone.
    """
    r = rows.float()  # [m, k]
    a = r.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30) / 127.0  # [m, 1]
    # |r / a| <= 127 up to one rounding, which round() brings back to 127: no clamp needed.
    return torch.round(r / a).to(torch.int8), a


class SharedInput:
    """The input a group of sibling layers reads, quantized once for all of them.

    Attention's q, k and v projections (and an MLP's gate and up) read the same tensor one
    after the other; quantizing it once saves a pass over it per sibling. The entry holds
    the tensor itself, so "the same object" cannot be a new tensor at a reused address,
    and lets it go once every member has read it (nothing outlives the group's calls).
    Decoder code reads its hidden states without writing them between the sibling calls,
    as every Hugging Face decoder does.

    Args:
        members: How many layers read each input.
    """

    __slots__ = ("_a", "_members", "_q", "_reads", "_x")

    def __init__(self, members: int = 1) -> None:
        self._members = members
        self._x: torch.Tensor | None = None
        self._reads = 0
        self._q = torch.empty(0, dtype=torch.int8)
        self._a = torch.empty(0)

    def quantize(self, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`quantize_rows` of ``x`` ``[..., width]`` viewed as rows, reused when
        ``x`` is the tensor the group quantized last and not every member has read it."""
        if x is not self._x:
            self._q, self._a = quantize_rows(x.reshape(-1, width))
            self._x, self._reads = x, 0
        q, a = self._q, self._a
        self._reads += 1
        if self._reads >= self._members:  # the group is done with it
            self._x = None
            self._q, self._a = torch.empty(0, dtype=torch.int8), torch.empty(0)
        return q, a


class W8A8Linear(torch.nn.Module):
    """A drop-in ``nn.Linear``: int8 weights (one scale per output row) times per-row int8
    activations, summed in int32.

    Attributes:
        in_features: Input width.
        out_features: Output width.
        shared: The input cache this layer shares with its siblings (see
            :class:`SharedInput`); its own when it has none.
    """

    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] fp32
    bias: torch.Tensor | None  # [out] fp32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 shared: SharedInput | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        q, scale = quantize_weight(weight)
        self.register_buffer("qweight", q)  # [out, in] int8
        self.register_buffer("scales", scale)  # [out] fp32: applied to the exact int32 sums
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.shared = shared if shared is not None else SharedInput()

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # ``model.to(bfloat16)`` casts the rest of the model; the fp32 scales and bias
        # multiply exact integer sums and stay fp32 (int8 weights are never cast).
        scales, bias = self.scales, self.bias
        out = super()._apply(fn, recurse)
        if self.scales.dtype != torch.float32:
            self.scales = scales.to(self.scales.device)
            if bias is not None:
                self.bias = bias.to(self.scales.device)
        return out

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weights (bf16, ``[out, in]``), for code that reads a linear's
        ``weight``; the forward never uses them."""
        return (self.qweight.float() * self.scales[:, None]).to(torch.bfloat16)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ Wᵀ`` for ``rows`` ``[m, in]``: ``[m, out]`` in ``rows``' dtype (no
        bias), quantizing the rows on the way: the kernel a forward runs."""
        q, a = quantize_rows(rows)
        return self._finish(q, a, rows.dtype)

    def _finish(self, q: torch.Tensor, a: torch.Tensor, dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        acc = torch._int_mm(q, self.qweight.t())  # [m, out] int32, exact
        y = acc * self.scales  # [m, out] fp32
        y.mul_(a)
        if bias is not None:
            y.add_(bias)
        return y.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ Wᵀ + b`` for ``x`` ``[..., in]``: ``[..., out]`` in ``x``'s dtype."""
        q, a = self.shared.quantize(x, self.in_features)
        y = self._finish(q, a, x.dtype, self.bias)  # [rows, out]
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weights=int8, activations=int8")


def supported() -> bool:
    """Whether this torch build has the CPU int8 × int8 product."""
    return hasattr(torch, "_int_mm")

