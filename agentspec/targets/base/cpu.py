"""What the CPU is (``/proc/cpuinfo``; whether it multiplies bf16 natively, measured) and
the one place a forward's thread count changes.

Thread counts change for two reasons: the live cost model runs a forward with the count
that is fastest on the machine's load right now, and the load-time probes compare a
forward's bits with one thread against the process's count. Both go through
:func:`threads`, which restores the count however the block exits.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["BF16_SLOWDOWN", "bf16_native", "cpuinfo", "release_freed_memory", "threads",
           "warn_spinning_openmp"]

log = logging.getLogger(__name__)


def cpuinfo(field: str) -> str:
    """The value of ``field`` in ``/proc/cpuinfo``'s first processor (``""`` where the file
    or the field is missing): what a key or a choice says of the CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=1)
def warn_spinning_openmp() -> bool:
    """Say once per process (a warning) when torch's OpenMP workers spin while idle, which
    ``import agentspec`` prevents only when it comes before ``import torch``: OpenMP reads
    ``OMP_WAIT_POLICY`` once, when torch loads, and the variable is unset only where torch
    loaded first and nobody set it. Returns whether it warned."""
    if "OMP_WAIT_POLICY" in os.environ:
        return False
    log.warning("torch was imported before agentspec, so its idle OpenMP workers spin and "
                "take the cores the native kernels' threads need: CPU decode steps run "
                "slower (~20%% for Qwen2.5-0.5B in w8a16, docs/cpu_step.md). Import "
                "agentspec first, or start Python with OMP_WAIT_POLICY=PASSIVE.")
    return True


@contextmanager
def threads(count: int | None) -> Iterator[int]:
    """Run the block with ``count`` intra-op threads (``None``: leave the count as it is)
    and restore the process's count after it; yields the count in force."""
    before = torch.get_num_threads()
    if count is None or count == before:
        yield before
        return
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)


#: How many times slower than fp32's a bf16 product may be and still count as native:
#: native bf16 runs about twice as fast as fp32, emulated bf16 tens of times slower (a
#: 512x896x4864 product at 0.9 GFLOP/s against fp32's ~55 on an AVX2-only CPU), so no
#: timing noise moves a machine across it.
BF16_SLOWDOWN = 4.0


@functools.lru_cache(maxsize=1)
def bf16_native() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (measured once per process: a
    256 x 896 x 896 product in bf16 against fp32, best of five each, not read from CPU
    flags, which say nothing of what torch's kernels do with them, e.g. under
    ``ONEDNN_MAX_CPU_ISA=AVX2``)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(256, 896, generator=gen)
    b = torch.randn(896, 896, generator=gen)

    def best(x: torch.Tensor, y: torch.Tensor) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - t0)
        return min(times)

    with torch.inference_mode():
        fp32 = best(a, b)
        bf16 = best(a.bfloat16(), b.bfloat16())
    return bf16 <= BF16_SLOWDOWN * fp32


def release_freed_memory() -> None:
    """Hand the memory of freed tensors back to the system (glibc's ``malloc_trim``).

    Loading fp32 weights to quantize them frees gigabytes at once; glibc keeps most of it
    in its arenas, so the process stays that large. Called after such a load; a libc
    without ``malloc_trim`` (musl, macOS) keeps its own policy."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return
    trim(0)
