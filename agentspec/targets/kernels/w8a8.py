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

**Two digits: w8a16.** ``dtype="w8a16"`` writes each activation as a 16-bit fixed-point
number of its row, split into a high and a low int8 digit (:func:`quantize_rows` with
``digits=2``); a forward's m rows go to ``_int_mm`` as 2m rows, which costs about what m
rows cost, and the two exact sums are recombined element-wise (``254 · high + low``). The
activations' error shrinks 254-fold, below the weights' own rounding, and a row's bits
still depend on that row alone. Prefill chunks of :data:`W8A16_PREFILL_ROWS` rows or
more multiply the dequantized weights in bf16 instead, as int8's do (in fp32 where bf16 is
emulated): two digits double the product's rows. Shorter chunks (most tails after reused
KV) keep the integer product, whose bits do not depend on the thread count, so a busy
machine may feed them with one thread. ``auto`` picks it on every CPU with the int8
product (:mod:`.precision`); its digits and their recombination are one C call each
(:mod:`.fused_digits`, the same bits as the torch operators here, which run where the
native library is not loaded).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from agentspec.errors import ConfigError
from agentspec.targets.base.cpu import bf16_native
from agentspec.targets.base.step_mode import STABLE_STEP
from agentspec.targets.kernels import fused_digits
from agentspec.targets.kernels.int8_mm import int8_mm, takes_native

__all__ = ["LOW", "PREFILL_ROWS", "W8A16_PREFILL_ROWS", "SharedInput", "W8A8Linear",
           "dequantized", "prefill_switch", "quantize_ops", "quantize_rows", "quantize_weight",
           "stack_layers", "supported"]

#: The low activation digit's weight under ``w8a16``: a unit of the high digit is worth
#: this many of the low one. 254, not 256: the remainder after the high digit is at most
#: 1/2, and 254 · 1/2 = 127 keeps the low digit inside int8's symmetric range.
LOW = 254.0

#: From this many rows on, a forward outside a decode step (a prefill chunk) multiplies the
#: dequantized bf16 weights instead, under ``int8`` (whose kernel's cost grows with the
#: rows much faster than bf16's GEMM: on a 2-core AVX-512 machine, Qwen's MLP shape over
#: 512 rows, 29 ms against 13.5 with the dequantization included; over 32 rows they tie).
#: ``w8a8`` keeps its integer product there (faster than bf16's GEMM over many rows).
PREFILL_ROWS = 64

#: ``w8a16``'s :data:`PREFILL_ROWS`. Its integer product over a chunk's rows as two digits
#: (the digits and their recombination in C, the product ``_int_mm``'s) costs what the
#: dequantization and bf16's GEMM cost up to ~200 rows and more from there (docs/
#: cpu_step.md), and unlike that GEMM it gives the same bits with any thread count: below
#: this, a prompt's forwards may run with one thread beside a busy process
#: (:func:`~agentspec.targets.forward.shapes.prompt_thread_rows`).
W8A16_PREFILL_ROWS = 256


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


def dequantized(qweight: torch.Tensor, scales: torch.Tensor,
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """int8 weights ``qweight`` ``[out, in]`` times their per-row ``scales`` ``[out]``, in
    ``dtype`` (the weights a prefill chunk of ``int8`` or ``w8a16`` multiplies: bf16, or
    fp32 where bf16 is emulated).

    Multiplied in ``dtype``: ``q`` is exact in bf16 and the exact product of ``q`` and the
    bf16 scale has at most 16 significant bits, so the one rounding to bf16 gives the bits
    an fp32 product would, without an fp32 copy of the matrix."""
    return qweight.to(dtype) * scales.to(dtype)[:, None]


def quantize_rows(rows: torch.Tensor, digits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of activations ``rows`` ``[m, k]`` into ``digits``
    int8 digits (1 for ``w8a8``, 2 for ``w8a16``).

    With one digit ``rows ≈ q · a``, ``a = max|row| / 127``. With two, each row is a
    16-bit fixed-point number ``n = round(rows / u)``, ``u = max|row| / (127 · 254)``, so
    ``|n| <= 32,258``, written as a high and a low digit: ``high = round(n / 254)`` and
    ``low = n - 254 · high``, both in ``[-127, 127]`` (the remainder of a rounded
    division is at most half the divisor). Then ``rows ≈ (254 · high + low) · u``: an
    error of at most ``u / 2`` per value, 254 times less than one digit's ``a / 2``.

    Returns:
        ``(q, u)``: ``q`` ``[digits · m, k]`` int8 in ``[-127, 127]`` (the high digits' rows
        first) and ``u`` ``[m, 1]`` fp32, the value of one unit of the combined integer
        (``a`` with one digit). Each row's values depend on that row alone.
    """
    if digits not in (1, 2):
        raise ConfigError(f"activation digits must be 1 or 2, got {digits!r}")
    fused = fused_digits.quantize(rows, digits)  # one pass in C, the same bits
    return fused if fused is not None else quantize_ops(rows, digits)


def quantize_ops(rows: torch.Tensor, digits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` as torch operators: the definition :mod:`.fused_digits`
    reproduces bit for bit, and what runs where its kernel is not built."""
    # The maximum is exact whatever the dtype; the division promotes the rows to fp32 on
    # the way (no separate fp32 copy: each pass over a chunk's rows costs).
    peak = torch.linalg.vector_norm(rows, float("inf"), dim=1, keepdim=True,
                                    dtype=torch.float32).clamp_(min=1e-30)  # [m, 1]
    if digits == 1:
        a = peak / 127.0  # [m, 1]
        # |rows / a| <= 127 up to one rounding, which round() brings back: no clamp.
        return (rows / a).round_().to(torch.int8), a
    u = peak / (127.0 * LOW)  # [m, 1]
    n = (rows / u).round_()  # [m, k] fp32 integers, |n| <= 32,258: exact from here on
    high = (n / LOW).round_()  # [m, k] in [-127, 127]
    low = n.sub_(high, alpha=LOW)  # [m, k]: exact integer arithmetic, in [-127, 127]
    return torch.cat((high, low)).to(torch.int8), u


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
        digits: Int8 digits per activation (1: ``w8a8``, 2: ``w8a16``).
    """

    __slots__ = ("_a", "_members", "_q", "_reads", "_x", "digits")

    def __init__(self, members: int = 1, digits: int = 1) -> None:
        self._members = members
        self.digits = digits
        self._x: torch.Tensor | None = None
        self._reads = 0
        self._q = torch.empty(0, dtype=torch.int8)
        self._a = torch.empty(0)

    def quantize(self, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`quantize_rows` of ``x`` ``[..., width]`` viewed as rows, reused when
        ``x`` is the tensor the group quantized last and not every member has read it."""
        if x is not self._x:
            self._q, self._a = quantize_rows(x.reshape(-1, width), self.digits)
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
                 shared: SharedInput | None = None, digits: int = 1) -> None:
        super().__init__()
        if shared is not None and shared.digits != digits:
            raise ConfigError(f"a layer of {digits} activation digits cannot share an input "
                              f"quantized to {shared.digits}")
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        q, scale = quantize_weight(weight)
        self.register_buffer("qweight", q)  # [out, in] int8
        self.register_buffer("scales", scale)  # [out] fp32: applied to the exact int32 sums
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.shared = shared if shared is not None else SharedInput(digits=digits)

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

    @classmethod
    def concat(cls, parts: list[W8A8Linear]) -> W8A8Linear:
        """One layer whose outputs are ``parts``' side by side (their int8 weights, scales
        and biases stacked, not quantized again), reading its input quantized as theirs
        is: each output column is its own exact integer sum, scaled element-wise, so each
        part's columns are the bits its own product gives."""
        if len({p.shared.digits for p in parts}) > 1:
            raise ConfigError("concat needs layers of one number of activation digits")
        out = stack_layers(cls, parts)
        out.shared = SharedInput(digits=parts[0].shared.digits)
        return out

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weights (bf16, ``[out, in]``, :func:`dequantized`), made on each
        call: what a ``w8a16`` prefill chunk multiplies, and what code that reads a
        linear's ``weight`` sees."""
        return dequantized(self.qweight, self.scales)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ Wᵀ`` for ``rows`` ``[m, in]``: ``[m, out]`` in ``rows``' dtype (no
        bias), quantizing the rows on the way: the kernel a forward runs."""
        q, a = quantize_rows(rows, self.shared.digits)
        return self._finish(q, a, rows.dtype)

    def _finish(self, q: torch.Tensor, a: torch.Tensor, dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        acc = int8_mm(q, self.qweight)  # [digits·m, out] int32, exact on either kernel
        fused = fused_digits.combine(acc, self.scales, a, bias, dtype)  # the same bits
        return fused if fused is not None else self.combine_ops(acc, a, dtype, bias)

    def combine_ops(self, acc: torch.Tensor, a: torch.Tensor, dtype: torch.dtype,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        """The outputs ``[m, out]`` from the exact sums ``acc`` ``[digits·m, out]`` as
        torch operators: the definition :func:`.fused_digits.combine` reproduces."""
        m = a.shape[0]
        if acc.shape[0] == m:  # one digit
            y = acc * self.scales  # [m, out] fp32
        else:  # two: 254 · high + low, each step one IEEE rounding (no fused multiply-add,
            # whose rounding would depend on which path a kernel takes)
            y = acc[:m] * LOW  # [m, out] fp32
            y.add_(acc[m:])
            y.mul_(self.scales)
        y.mul_(a)
        if bias is not None:
            y.add_(bias)
        return y.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ Wᵀ + b`` for ``x`` ``[..., in]``: ``[..., out]`` in ``x``'s dtype."""
        if (self.shared.digits == 2 and x.numel() >= W8A16_PREFILL_ROWS * self.in_features
                and not STABLE_STEP.get()):
            # A long prefill chunk under w8a16: a float GEMM over the dequantized weights,
            # as int8 does. Two digits make the integer product one of twice the rows,
            # plus a single-threaded C pass over the chunk's rows and one over its outputs
            # (without the kernel, ~10 torch operators: 4.5x slower over a 1,750-token
            # prompt). Never inside a decode forward, whose rows must take one kernel.
            if bf16_native():
                y = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight,
                                               None if self.bias is None
                                               else self.bias.to(torch.bfloat16))
            else:  # bf16 emulated (many times slower): fp32's GEMM, ~1.8x the integer
                # product over 512 rows on AVX2 (docs/cpu_step.md)
                w = dequantized(self.qweight, self.scales, torch.float32)  # [out, in]
                y = torch.nn.functional.linear(x.float(), w, self.bias)
            return y.to(x.dtype)
        rows = x.reshape(-1, self.in_features)  # [m, in]
        digits = self.shared.digits
        if (digits * rows.shape[0] <= fused_digits.LINEAR_MAX_ROWS
                and takes_native(digits * rows.shape[0], self.qweight)):
            # One C call for the whole layer (the same bits as the calls below).
            one = fused_digits.linear(rows, self.qweight, self.scales, self.bias, digits)
            if one is not None:
                return one.reshape(*x.shape[:-1], self.out_features)
        q, a = self.shared.quantize(x, self.in_features)
        y = self._finish(q, a, x.dtype, self.bias)  # [rows, out]
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weights=int8, "
                f"activations={8 * self.shared.digits}-bit fixed point")


L = TypeVar("L", bound=torch.nn.Module)


def stack_layers(cls: type[L], parts: list[Any]) -> L:
    """A new ``cls`` layer (:class:`W8A8Linear` or int8's ``Int8Linear``) whose int8
    weights, scales and biases are ``parts``' stacked along the outputs, not quantized
    again; the caller adds what else its kind holds.

    Raises:
        ConfigError: no parts, parts of different input widths, or some with a bias and
            some without.
    """
    if not parts or len({p.in_features for p in parts}) != 1:
        raise ConfigError("concat needs int8 layers of one input width")
    if len({p.bias is None for p in parts}) != 1:
        raise ConfigError("concat needs int8 layers that all have a bias or none")
    out = cls.__new__(cls)
    torch.nn.Module.__init__(out)
    out.in_features = parts[0].in_features
    out.out_features = sum(p.out_features for p in parts)
    out.register_buffer("qweight", torch.cat([p.qweight for p in parts]))  # [out, in]
    out.register_buffer("scales", torch.cat([p.scales for p in parts]))  # [out]
    biases = [p.bias for p in parts if p.bias is not None]
    out.register_buffer("bias", torch.cat(biases) if biases else None)
    return out


def supported() -> bool:
    """Whether this torch build has the CPU int8 × int8 product."""
    return hasattr(torch, "_int_mm")


def prefill_switch(model: torch.nn.Module) -> int | None:
    """The row count from which ``model``'s prompt forwards leave the integer product for
    a float GEMM (bf16's, fp32's where bf16 is emulated), where that is above the prompt
    probe's own lengths: :data:`W8A16_PREFILL_ROWS` for a model with w8a16 layers, else
    ``None`` (int8 switches at :data:`PREFILL_ROWS`, inside what the probe feeds; w8a8 and
    unquantized models never switch)."""
    if any(isinstance(m, W8A8Linear) and m.shared.digits == 2 for m in model.modules()):
        return W8A16_PREFILL_ROWS
    return None
