"""Int8 weight-only linear layers for the CPU: a quarter of fp32's bytes per step.

A decode step on a CPU is bound by reading the weights: every plain step and every short
verify streams each weight matrix once. The shipped models are 4-6 bit GGUF files
dequantised to fp32, so an fp32 step reads 4 bytes per weight and a bf16 step 2; an int8
step reads 1 (plus one scale per output row). PyTorch's CPU kernel for this
(``torch._weight_int8pack_mm``) multiplies bf16 activations by int8 weights with an fp32
accumulator and scales each output column afterwards:

    y[r, j] = bf16( (Σ_k x[r, k] · q[j, k]) · s[j] )

The weights are quantized once, symmetrically per output row, from the fp32 weights the
model was loaded with: ``s[j] = max_k |w[j, k]| / 127`` and ``q = round(w / s)`` (an error of
at most ``s/2`` per weight, well under the step of the 4-6 bit grid the GGUF file already
put them on, but not zero: an int8 model's answers are its own, not fp32's or bf16's).

Every forward of an int8 target uses the same weights and the same kernel, and the target
runs shape-stable forwards (:mod:`.stable`, probed on these layers like any other): so
speculation is token-identical to plain decoding of the same int8 model, as for bf16. The
kernel's cost grows with the row count faster than bf16's GEMM does (on a 2-core AVX-512
machine an int8 product costs ~0.5x bf16's over 1-4 rows, ~1x over 8 and ~2x over 16), so
the verify cost curves, measured per dtype, let the gate price long drafts accordingly.
Prefill chunks (:data:`PREFILL_ROWS` rows or more, outside a decode step) multiply the
dequantized weights in bf16 instead, which keeps prefill at bf16's speed; the prompt's KV
then differs from what one-row steps would write only in the last bits, as it does in bf16.
"""

from __future__ import annotations

from typing import Any

import torch

from agentspec.errors import ConfigError
from agentspec.targets.base.step_mode import STABLE_STEP
from agentspec.targets.kernels import w8a8
from agentspec.targets.kernels.w8a8 import PREFILL_ROWS

__all__ = ["PREFILL_ROWS", "SIBLINGS", "Int8Linear", "quantize_linears",
           "supported"]


class Int8Linear(torch.nn.Module):
    """A drop-in ``nn.Linear`` with int8 weights and one bf16 scale per output row.

    Attributes:
        in_features: Input width.
        out_features: Output width.
    """

    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] bf16
    bias: torch.Tensor | None  # [out] bf16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        q, scale = w8a8.quantize_weight(weight)  # from fp32, whatever it was stored in
        self.register_buffer("qweight", q)  # [out, in] int8
        self.register_buffer("scales", scale.to(torch.bfloat16))  # [out]
        self.register_buffer("bias", None if bias is None else
                             bias.detach().to(torch.bfloat16))

    @classmethod
    def concat(cls, parts: list[Int8Linear]) -> Int8Linear:
        """One layer whose outputs are ``parts``' side by side (their int8 weights, scales
        and biases stacked, not quantized again): the kernel computes each output column
        on its own, so each part's columns are the bits its own product gives."""
        return w8a8.stack_layers(cls, parts)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weights (bf16, ``[out, in]``,
        :func:`~agentspec.targets.kernels.w8a8.dequantized`), made on each call: what a prefill
        chunk multiplies, and what code that reads a linear's ``weight`` sees."""
        return w8a8.dequantized(self.qweight, self.scales)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """The int8 kernel: ``rows @ Wᵀ`` for ``rows`` ``[m, in]`` (bf16), ``[m, out]``."""
        return torch._weight_int8pack_mm(rows, self.qweight, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ Wᵀ + b`` for ``x`` ``[..., in]`` (bf16): ``[..., out]``."""
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [rows, in]
        if rows.shape[0] >= PREFILL_ROWS and not STABLE_STEP.get():
            # A prefill chunk: bf16's GEMM over the dequantized weights (the same weights,
            # other rounding) runs many rows ~2x faster than the int8 kernel. Never inside
            # a decode forward, whose rows must all take one kernel.
            y = torch.nn.functional.linear(rows, self.weight)  # [rows, out]
        else:
            y = self.product(rows)  # [rows, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weights=int8")


def supported() -> bool:
    """Whether this torch build has the CPU int8 weight-only kernel."""
    return hasattr(torch, "_weight_int8pack_mm")


#: Sibling layers that read the same input, by their names in Hugging Face decoders
#: (Llama, Qwen2, Mistral, ...): under ``w8a8`` and ``w8a16`` they quantize it once (see
#: :class:`~agentspec.targets.kernels.w8a8.SharedInput`).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def quantize_linears(model: Any, activations: int = 0) -> int:
    """Replace every ``nn.Linear`` of ``model`` (on the CPU) by an :class:`Int8Linear`
    (``activations=0``: bf16 activations), or by a
    :class:`~agentspec.targets.kernels.w8a8.W8A8Linear` whose activations are quantized to
    ``activations`` int8 digits (1: ``w8a8``, 2: ``w8a16``); return how many were replaced.
    Call it on the fp32 model, before casting the rest to bf16 (the scales come from the
    fp32 weights).

    Raises:
        ConfigError: the model is not on the CPU, has no ``nn.Linear`` layer, torch lacks
            the kernel, or ``activations`` is not 0, 1 or 2.
    """
    digits = int(activations)
    if digits not in (0, 1, 2):
        raise ConfigError(f"activations must be 0, 1 or 2 int8 digits, got {activations!r}")
    dtype = ("int8", "w8a8", "w8a16")[digits]
    if not (w8a8.supported() if digits else supported()):
        raise ConfigError(f"dtype {dtype!r} needs a CPU int8 kernel that torch "
                          f"{torch.__version__} lacks; use dtype 'bfloat16'")
    replaced = 0
    for parent in list(model.modules()):
        linears = {name: child for name, child in parent.named_children()
                   if type(child) is torch.nn.Linear}
        shared = _shared_inputs(linears, digits) if digits else {}
        for name, child in linears.items():
            if child.weight.device.type != "cpu":
                raise ConfigError(f"dtype {dtype!r} runs on the CPU only; layer {name!r} is "
                                  f"on {child.weight.device.type} (use bfloat16 on a GPU)")
            layer: torch.nn.Module = (
                w8a8.W8A8Linear(child.weight, child.bias, shared.get(name), digits) if digits
                else Int8Linear(child.weight, child.bias))
            setattr(parent, name, layer)
            replaced += 1
    if not replaced:  # else "int8" would silently be bf16
        raise ConfigError(f"dtype {dtype!r} found no torch.nn.Linear layer to quantize in "
                          f"{type(model).__name__}; use dtype 'bfloat16'")
    # A tied output layer was a view of the embedding: the embedding keeps its own tensor
    # and the config must not tie them again on a later call.
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
    return replaced


def _shared_inputs(linears: dict[str, torch.nn.Linear],
                   digits: int) -> dict[str, w8a8.SharedInput]:
    """One :class:`~agentspec.targets.kernels.w8a8.SharedInput` of ``digits`` activation digits per
    group of :data:`SIBLINGS` present (all members, one input width) among one module's
    ``linears``."""
    out: dict[str, w8a8.SharedInput] = {}
    for group in SIBLINGS:
        if all(n in linears for n in group) and \
                len({linears[n].in_features for n in group}) == 1:
            shared = w8a8.SharedInput(members=len(group), digits=digits)
            out.update({n: shared for n in group})
    return out
