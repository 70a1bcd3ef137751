"""What a :class:`~agentspec.targets.hf.HFTarget` is loaded with: the model, its precision,
its device, the prefix store's budgets and how its decode forwards are shaped.

The settings live apart from the target so that the device and shape-stability rules
(:meth:`TargetConfig.resolved_device`, :meth:`TargetConfig.stable_policy`) are readable on
their own; ``agentspec.targets.hf`` re-exports :class:`TargetConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from agentspec.errors import ConfigError, DeviceUnavailableError
from agentspec.targets import fused_digits, int8, stable, w8a8
from agentspec.targets.probe_cache import ProbeCache, is_bool, is_rows, probed
from agentspec.targets.stable import StablePolicy

__all__ = ["DTYPES", "QUANTIZED", "TargetConfig", "auto_dtype"]

#: The precisions a target loads in (see :attr:`TargetConfig.dtype`).
DTYPES = ("float32", "bfloat16", "int8", "w8a8", "w8a16")

#: The precisions whose linear layers are quantized at load (CPU only), with the int8
#: digits each quantizes a layer's input to (0: the input stays bf16).
QUANTIZED = {"int8": 0, "w8a8": 1, "w8a16": 2}


def auto_dtype(cpu: bool) -> str:
    """What ``dtype="auto"`` becomes: on a CPU where int8 is fast
    (:func:`~agentspec.targets.int8.fast_here`: AVX-512), ``"w8a16"`` where its digits run
    as one C call each (:func:`~agentspec.targets.fused_digits.available`: a C compiler is
    here), else ``"int8"``; ``"float32"`` elsewhere (and on a GPU).

    Why w8a16 first: its verifies of many rows cost little more than one row (int8's grow
    almost linearly) and its decode product is nearer fp32's than int8's; without the C
    kernel its one-row step costs more than int8's (docs/cpu_step.md measures both)."""
    if not (cpu and int8.fast_here()):
        return "float32"
    return "w8a16" if w8a8.supported() and fused_digits.available() else "int8"


@dataclass(frozen=True)
class TargetConfig:
    """Settings of a :class:`HFTarget`.

    Attributes:
        model: Embedded model name or a local Hugging Face folder (see ``resolve_model``).
        dtype: ``"float32"`` (the reference), ``"bfloat16"`` or ``"int8"`` (int8
            weight-only linear layers over bf16 activations, quantized at load from the fp32
            weights; CPU only, see :mod:`~agentspec.targets.int8`) or ``"w8a8"`` (int8
            weights and per-token int8 activations summed in int32: cheap multi-row verifies,
            answers further from fp32's; CPU only, see :mod:`~agentspec.targets.w8a8`) or
            ``"w8a16"`` (int8 weights, activations as two int8 digits of a 16-bit
            fixed-point value, summed in int32: w8a8's cheap verifies, a decode product
            nearer fp32's than int8's, its prompt int8's; CPU only);
            each exact against plain decoding in the same precision (the others through
            shape-stable forwards, see
            ``shape_stable``). ``"auto"`` becomes ``"w8a16"`` (or ``"int8"``) on a CPU
            where they are fast, else ``"float32"`` (:func:`auto_dtype`); the config's
            ``dtype`` holds the choice once built.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when available). The target's
            device owns every tensor that meets its model: drafters, heads and the prefix
            store follow it.
        prefix_cache_bytes: Budget of the KV prefix store (see
            :mod:`agentspec.targets.prefix_cache`); 0 disables prefix reuse; ``None`` (the
            default) sizes it from the memory available where its blocks live (the
            target's device) once the model is loaded
            (:func:`~agentspec.targets.prefix_cache.auto_budget_bytes`).
        prefix_spill_bytes: Budget of the store's disk copies under
            ``$AGENTSPEC_HOME/prefix-kv/<model>-<fingerprint>-<dtype>`` (a session's prefix
            KV survives a restart; see :mod:`agentspec.targets.kv_spill`); 0: memory only.
        measure_costs: Measure the verify cost curves the draft gate prices drafts with
            when the model loads, if ``$AGENTSPEC_HOME/costs`` does not hold them yet (once
            per machine, a progress line); ``False`` leaves the gate on its safe prior
            (short drafts only) until forwards have been timed.
        shape_stable: Give every decode forward (a plain step or a verify) the same
            shapes, so a row's logits never depend on how many rows share its forward
            (:mod:`agentspec.targets.stable`): what makes bf16 speculation token-identical
            to plain bf16 decoding, and on CUDA what lets a step run as a captured graph.
            ``None`` (auto): on for bfloat16, the int8 precisions and on CUDA, off for
            fp32 on the CPU (exact without it; tree drafts verify as chains while it is
            on).
        cuda_graphs: Capture the shape-stable CUDA step as a graph (falls back to eager
            steps, with a warning, if capture fails).
    """

    model: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    prefix_cache_bytes: int | None = None
    prefix_spill_bytes: int = 0
    measure_costs: bool = True
    shape_stable: bool | None = None
    cuda_graphs: bool = True

    def stable_policy(self, device: str, model: Any = None,
                      probes: ProbeCache | None = None) -> StablePolicy | None:
        """The shape-stable policy for ``device`` (``None``: forwards keep their shapes).
        On the CPU ``model``'s products are checked for row-count invariance
        (:func:`~agentspec.targets.stable.invariant_rows`): a plain step is padded to the
        fewest rows they are invariant from (fixed-size chunks where they are not), and
        their thread count is pinned where their bits depend on it; where decode attention
        depends on either (:func:`~agentspec.targets.stable.attention_invariant`), every
        decode forward takes one shape and the process's thread count. ``probes``: where the
        probes' results are kept between loads (``None``: probed here)."""
        on = self.shape_stable
        if on is None:
            on = self.dtype in ("bfloat16", *QUANTIZED) or device.startswith("cuda")
        if not on or (model is not None and not stable.full_attention(model)):
            return None
        policy = StablePolicy.for_device(device, graphs=self.cuda_graphs)
        if model is not None and not device.startswith("cuda"):
            rows = probed(probes, "invariant_rows", lambda: stable.invariant_rows(model),
                           is_rows)
            policy = (dataclasses.replace(policy, min_rows=rows) if rows is not None else
                      dataclasses.replace(policy, min_rows=stable.CPU_MIN_ROWS,
                                          max_rows=stable.CPU_MIN_ROWS))
            if not probed(probes, "thread_invariant", lambda: stable.thread_invariant(model),
                           is_bool):
                policy = dataclasses.replace(policy, pin_threads=True)
            if not probed(probes, "attention_invariant",
                          lambda: stable.attention_invariant(model), is_bool):
                # Attention's products: one shape and one thread count for every forward.
                policy = dataclasses.replace(policy, min_rows=stable.CPU_MIN_ROWS,
                                             max_rows=stable.CPU_MIN_ROWS, pin_threads=True)
        return policy

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
