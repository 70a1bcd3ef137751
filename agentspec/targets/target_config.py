"""What a :class:`~agentspec.targets.hf.HFTarget` is loaded with: the model, its precision,
its device, the prefix store's budgets and how its decode forwards are shaped.

Data only: the settings and their validation, apart from the target. What the settings
become on a loaded model lives with what decides it (the shape policy:
:func:`agentspec.targets.probes.policy.stable_policy`; ``auto``'s precision:
:func:`agentspec.targets.kernels.precision.auto_dtype`); ``agentspec.targets.hf``
re-exports :class:`TargetConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentspec.errors import ConfigError, DeviceUnavailableError
from agentspec.targets.kernels.precision import DTYPES, QUANTIZED, auto_dtype

__all__ = ["DTYPES", "QUANTIZED", "TargetConfig", "auto_dtype"]


@dataclass(frozen=True)
class TargetConfig:
    """Settings of a :class:`HFTarget`.

    Attributes:
        model: Embedded model name or a local Hugging Face folder (see ``resolve_model``).
        dtype: ``"auto"`` (the default), ``"float32"`` (the reference, by name),
            ``"bfloat16"`` or ``"int8"`` (int8
            weight-only linear layers over bf16 activations, quantized at load from the fp32
            weights; CPU only, see :mod:`~agentspec.targets.kernels.int8`) or ``"w8a8"`` (int8
            weights and per-token int8 activations summed in int32: cheap multi-row verifies,
            answers further from fp32's; CPU only, see :mod:`~agentspec.targets.kernels.w8a8`) or
            ``"w8a16"`` (int8 weights, activations as two int8 digits of a 16-bit
            fixed-point value, summed in int32: w8a8's cheap verifies, a decode product
            nearer fp32's than int8's, its prompt int8's; CPU only);
            each exact against plain decoding in the same precision (the others through
            shape-stable forwards, see
            ``shape_stable``). ``"auto"`` becomes ``"w8a16"`` on a CPU whose torch has
            the int8 product (``torch._int_mm``), else ``"float32"`` (on a GPU too; see
            :func:`auto_dtype`); the config's ``dtype`` holds the choice once built, so
            what a target reports is never ``"auto"``.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when available). The target's
            device owns every tensor that meets its model: drafters, heads and the prefix
            store follow it.
        prefix_cache_bytes: Budget of the KV prefix store (see
            :mod:`agentspec.targets.cache.prefix_cache`); 0 disables prefix reuse; ``None`` (the
            default) sizes it from the memory available where its blocks live (the
            target's device) once the model is loaded
            (:func:`~agentspec.targets.cache.prefix_cache.auto_budget_bytes`).
        prefix_spill_bytes: Budget of the store's disk copies under
            ``$AGENTSPEC_HOME/prefix-kv/<model>-<fingerprint>-<dtype>`` (a session's prefix
            KV survives a restart; see :mod:`agentspec.targets.cache.kv_spill`); 0: memory only.
        measure_costs: Measure the verify cost curves the draft gate prices drafts with
            when the model loads, if ``$AGENTSPEC_HOME/costs`` does not hold them yet (once
            per machine, a progress line); ``False`` leaves the gate on its safe prior
            (short drafts only) until forwards have been timed.
        shape_stable: Give every decode forward (a plain step or a verify) the same
            shapes, so a row's logits never depend on how many rows share its forward
            (:mod:`agentspec.targets.forward.shapes`): what makes bf16 speculation token-identical
            to plain bf16 decoding, and on CUDA what lets a step run as a captured graph.
            ``None`` (auto): on for bfloat16, the int8 precisions and on CUDA, off for
            fp32 on the CPU (exact without it; tree drafts verify as chains while it is
            on).
        cuda_graphs: Capture the shape-stable CUDA step as a graph (falls back to eager
            steps, with a warning, if capture fails).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    prefix_cache_bytes: int | None = None
    prefix_spill_bytes: int = 0
    measure_costs: bool = True
    shape_stable: bool | None = None
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        for name in ("prefix_cache_bytes", "prefix_spill_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.dtype == "auto":  # resolved once, so every key and label names the choice
            cpu = self.device == "cpu" or (self.device == "auto"
                                           and not torch.cuda.is_available())
            object.__setattr__(self, "dtype", auto_dtype(cpu))
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"dtype must be 'float32', 'bfloat16', 'int8', 'w8a8', 'w8a16' or 'auto', "
                f"got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")

    @property
    def load_dtype(self) -> str:
        """The precision the model's files are loaded in (the int8 precisions are quantized
        from fp32)."""
        return "float32" if self.dtype in QUANTIZED else self.dtype

    def resolved_device(self) -> str:
        """The device actually used.

        Raises:
            DeviceUnavailableError: ``device="cuda"`` on a machine without CUDA.
            ConfigError: an int8 precision (``int8``, ``w8a8``, ``w8a16``) with
                ``device="cuda"`` (CPU kernels).
        """
        if self.dtype in QUANTIZED:  # the int8 kernels used are the CPU's
            if self.device == "cuda":
                raise ConfigError(f"dtype={self.dtype!r} (int8 layers) runs on the CPU "
                                  "only; on a GPU use dtype='bfloat16'")
            return "cpu"
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise DeviceUnavailableError(
                "device='cuda' was asked for, but torch finds no CUDA device on this machine "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                "use device='cpu' or 'auto' (--device cpu|auto)")
        return self.device
