"""The precisions a target loads in, and what ``dtype="auto"`` picks on this machine.

The choice depends only on the machine (its CPU and the torch build), never on whether a
library happens to be built or a compiler is on PATH: two precisions give different
answers, so a choice that changed with the installation would change answers with it.
"""

from __future__ import annotations

import torch

from agentspec.targets.base.cpu import bf16_native
from agentspec.targets.kernels import w8a8

__all__ = ["DTYPES", "QUANTIZED", "activation_dtype", "auto_dtype", "rest_dtype"]

#: The precisions a target loads in (see :attr:`~agentspec.targets.target_config.
#: TargetConfig.dtype`).
DTYPES = ("float32", "bfloat16", "int8", "w8a8", "w8a16")

#: The precisions whose linear layers are quantized at load (CPU only), with the int8
#: digits each quantizes a layer's input to (0: the input stays bf16).
QUANTIZED = {"int8": 0, "w8a8": 1, "w8a16": 2}


def activation_dtype() -> torch.dtype:
    """The dtype a quantized CPU target keeps its activations, KV and small layers in:
    bf16 where it is native (:func:`bf16_native`), else fp32 (an emulated bf16 product
    would make every prompt and attention many times slower)."""
    return torch.bfloat16 if bf16_native() else torch.float32


def rest_dtype(digits: int) -> torch.dtype:
    """The dtype a quantized target of ``digits`` activation digits keeps everything but its
    int8 weights in (embedding, norms, attention, KV): ``int8``'s kernel (``digits=0``) takes
    bf16 rows, ``w8a8`` / ``w8a16`` keep :func:`activation_dtype`."""
    return torch.bfloat16 if digits == 0 else activation_dtype()


def auto_dtype(cpu: bool) -> str:
    """What ``dtype="auto"`` becomes: ``"w8a16"`` on a CPU where this torch has the
    int8 x int8 product (:func:`~agentspec.targets.kernels.w8a8.supported`), on every
    x86-64 CPU alike (AVX-512 or AVX2 only: its one-row product runs in the native
    library's kernel for the CPU at hand, its activations in bf16 or fp32 by
    :func:`activation_dtype`); ``"float32"`` elsewhere (and on a GPU).

    Why w8a16: its weights are int8 (a quarter of fp32's bytes per step), its verifies of
    many rows cost little more than one row, and every row's product is an exact integer
    sum, so speculation is token-identical to its plain decoding on any CPU. The choice
    depends on the machine only, never on whether a library or compiler is present."""
    return "w8a16" if cpu and w8a8.supported() else "float32"
