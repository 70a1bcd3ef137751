"""The int8 activation digits of ``w8a8`` and ``w8a16`` in one pass each, as a small C
kernel built at install: the same bits as the torch operators they replace, fewer
dispatches per step.

Why. Quantizing a row into digits (:func:`~agentspec.targets.kernels.w8a8.quantize_rows`) and
recombining the integer sums into outputs are element-wise: in torch each is ~10 and ~6
operators, and over the one row of a decode step every operator costs its dispatch, not its
arithmetic. A one-row step of Qwen2.5-Coder-0.5B runs ~1,300 such operators more under
``w8a16`` than under ``int8`` (docs/cpu_step.md counts them). Here each is one call into C.

Same bits. The C code does the torch formulas' IEEE operations in the same order, in fp32:
a maximum, one division per scale, one division and one round-half-to-even per value and
digit, then multiplications and additions each rounded on its own. It is built with
``-ffp-contract=off`` (no fused multiply-add, which rounds once where torch rounds twice)
and without fast-math, so vectorizing a loop changes no value; bf16 in and out is the same
round-to-nearest-even as torch's. The unit tests compare both paths bit for bit; whether
the kernel is there changes speed, never an answer.

Built how: at install, in the native library (:mod:`.native`); where it is absent the
torch operators run, with the same bits.
"""

from __future__ import annotations

import torch

from agentspec.targets.kernels import native

__all__ = ["LINEAR_MAX_ROWS", "available", "combine", "linear", "quantize"]

#: Activation digit rows (digits x rows) :func:`linear` takes in one call.
LINEAR_MAX_ROWS = 128

_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether the native library (with this kernel) is loaded."""
    return native.available()


def quantize(rows: torch.Tensor, digits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`~agentspec.targets.kernels.w8a8.quantize_rows` of CPU ``rows`` ``[m, k]`` (fp32 or
    bf16) in one pass: ``(q [digits·m, k] int8, u [m, 1] fp32)``, or ``None`` where the
    kernel is not there or the rows are not its kind (the caller runs the torch operators).
    """
    lib = native.library()
    if lib is None or rows.dtype not in _DTYPES or rows.device.type != "cpu":
        return None
    rows = rows.contiguous()
    m, k = rows.shape
    q = torch.empty(digits * m, k, dtype=torch.int8)
    u = torch.empty(m, 1)
    bf16 = rows.dtype == torch.bfloat16
    scratch = torch.empty(k) if bf16 else None  # one row widened to fp32
    native.call("agentspec::quantize_digits", lib.agentspec_quantize, rows.data_ptr(),
                int(bf16), m, k, digits, q.data_ptr(), u.data_ptr(),
                None if scratch is None else scratch.data_ptr())
    return q, u


def combine(acc: torch.Tensor, scales: torch.Tensor, u: torch.Tensor,
            bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The outputs ``[m, n]`` in ``dtype`` from the exact int32 sums ``acc``
    ``[digits·m, n]`` (``m`` = ``u``'s rows): ``((254 · high + low) · scales) · u + bias``
    (one digit: ``(acc · scales) · u + bias``), as
    :meth:`~agentspec.targets.kernels.w8a8.W8A8Linear.combine_ops` computes them; ``None`` where
    the kernel is not there or the tensors are not its kind (or there are no rows)."""
    lib = native.library()
    m = u.shape[0]
    if lib is None or dtype not in _DTYPES or acc.dtype != torch.int32 or m == 0:
        return None
    n = acc.shape[1]
    acc = acc.contiguous()
    scales = scales.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    out = torch.empty(m, n, dtype=dtype)
    native.call("agentspec::combine_digits", lib.agentspec_combine, acc.data_ptr(), m, n,
                acc.shape[0] // m, scales.data_ptr(), u.data_ptr(),
                None if bias is None else bias.data_ptr(), out.data_ptr(),
                int(dtype == torch.bfloat16))
    return out


def linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
           bias: torch.Tensor | None, digits: int) -> torch.Tensor | None:
    """A whole int8 layer over CPU rows ``x`` ``[..., k]`` (fp32 or bf16) in one C call:
    :func:`quantize`, the int8 product on the native kernel (``_int8_mm.c``) and
    :func:`combine`, each output recombined by the thread that summed it; the same bits as
    those three (the same operations in the same order). ``[..., n]`` in ``x``'s dtype
    (``n`` = ``qweight``'s rows), or ``None`` where the kernel is not there, the tensors are
    not its kind or ``digits`` times the rows exceeds :data:`LINEAR_MAX_ROWS` (the caller
    takes the three calls).

    Why: a decode step runs ~100 layers, and three calls with five tensors allocated and
    their checks cost ~15 µs a layer beside the arithmetic."""
    lib = native.library()
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if (lib is None or x.dtype not in _DTYPES or not x.is_cpu or m == 0
            or digits * m > LINEAR_MAX_ROWS):
        return None
    x = x.contiguous()
    n = qweight.shape[0]
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)  # [..., n]
    bf16 = int(x.dtype == torch.bfloat16)
    status = native.call("agentspec::int8_linear", lib.agentspec_int8_linear, x.data_ptr(),
                         bf16, m, k, digits, qweight.data_ptr(), n, scales.data_ptr(),
                         None if bias is None else bias.data_ptr(), out.data_ptr(), bf16,
                         torch.get_num_threads())
    return out if status == 0 else None
