"""int8 x int8 products summed in int32, each shape on the kernel that is fastest for it
here: the native few-rows kernel (:mod:`.native`, ``_int8_mm.c``: every weight read once
from its buffer, each activation row dotted with it while it is in L1) or
``torch._int_mm`` (a GEMM library's int8 path, which wins from some row count on).

Why a choice costs no exactness: an int32 sum of int8 products has one value whatever
kernel, vector width, row count or thread count computes it (|a|, |w| <= 127: no partial
sum overflows), so a one-row step and a k-row verify may take different kernels and give
the same bits. The choice is measured, not assumed from CPU flags: per weight shape and
row bucket (1, 2, 4, ... rows) the first call times both kernels on its own operands
(:data:`TRIALS` each, median) and keeps the faster for that bucket from then on.

Where ``torch._int_mm`` is not exact it is never used (:func:`int_mm_exact`, probed once
per process): without VNNI, oneDNN's AVX2 int8 GEMM multiplies unsigned by signed bytes
after shifting one operand by 128, and its int16 pair sums saturate (255 · 127 · 2 >
32,767), so some sums come out wrong, and which ones depends on the row count: a verify's
rows would differ from a one-row step's. Measured on an AMD EPYC under
``ONEDNN_MAX_CPU_ISA=AVX2``: 17-row products wrong, 1-16-row ones right. There every
product takes the native kernel (or, without the library, an int32 matmul: exact, slow).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import torch

from agentspec.targets.kernels import native

__all__ = ["MAX_NATIVE_ROWS", "TRIALS", "choices", "int8_mm", "int_mm_exact", "native_mm",
           "path"]

#: Row counts above this always take ``torch._int_mm`` (the native kernel reads each
#: weight once per call but computes one row at a time: a GEMM wins long before this).
MAX_NATIVE_ROWS = 64
#: Timed calls of each kernel per shape and row bucket.
TRIALS = 3

_choice: dict[tuple[int, int, int], bool] = {}  # (out, in, bucket) -> native is faster
_choice_lock = threading.Lock()


def path() -> str | None:
    """The native kernel's vector path (``avx512vnni``, ``avxvnni``, ``avx2`` or ``c``),
    ``None`` where the library is not loaded."""
    lib = native.library()
    return None if lib is None else lib.agentspec_int8_mm_path().decode()


def native_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """``a @ wᵀ`` in int32 for ``a`` ``[m, k]`` and ``w`` ``[n, k]`` (both contiguous int8
    on the CPU) on the native kernel with the process's thread count; ``None`` where the
    library is not loaded."""
    lib = native.library()
    if lib is None:
        return None
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.int32)  # [m, n]
    with native.recorded("agentspec::int8_mm"):
        lib.agentspec_int8_mm(a.data_ptr(), w.data_ptr(), out.data_ptr(), m, k, n,
                              torch.get_num_threads())
    return out


@functools.lru_cache(maxsize=1)
def int_mm_exact() -> bool:
    """Whether ``torch._int_mm`` gives exact int32 sums here, for the row counts a decode
    step, a verify and a prompt chunk use: extreme operands (every product 127 · 127 or
    -127 · 127, the sums' largest int16 pairs) and random ones, against an int32 matmul."""
    gen = torch.Generator().manual_seed(0)
    k, n = 256, 48
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    w[: n // 2] = 127
    for m in (1, 2, 8, 17, 33, 64, 256):
        a = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
        a[0], a[-1] = 127, -127
        if not torch.equal(torch._int_mm(a, w.t()), a.int() @ w.int().t()):
            return False
    return True


def _exact_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm``, or an int32 matmul where it is not exact (:func:`int_mm_exact`)."""
    return torch._int_mm(a, w.t()) if int_mm_exact() else a.int() @ w.int().t()


def _bucket(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def _median_s(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(TRIALS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def int8_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ wᵀ`` in int32 (``a`` ``[m, k]``, ``w`` ``[n, k]``, int8, values in
    [-127, 127]) on the kernel measured fastest for ``w``'s shape and ``m``'s bucket."""
    m = a.shape[0]
    if not a.is_contiguous() or not w.is_contiguous() or a.device.type != "cpu" \
            or native.library() is None:
        return _exact_mm(a, w)
    if not int_mm_exact():  # the native kernel for every row count
        out = native_mm(a, w)
        return out if out is not None else _exact_mm(a, w)
    if m > MAX_NATIVE_ROWS:
        return torch._int_mm(a, w.t())
    key = (int(w.shape[0]), int(w.shape[1]), _bucket(m))
    fast = _choice.get(key)
    if fast is None:
        with _choice_lock:
            fast = _choice.get(key)
            if fast is None:  # time both on these operands (the same bits either way)
                ours = _median_s(lambda: native_mm(a, w))
                theirs = _median_s(lambda: torch._int_mm(a, w.t()))
                fast = _choice[key] = ours <= theirs
    out = native_mm(a, w) if fast else None
    return out if out is not None else torch._int_mm(a, w.t())


def choices() -> dict[str, str]:
    """The kernel measured fastest per ``"out x in, rows <= bucket"`` so far (stats)."""
    return {f"{o}x{i},rows<={b}": "native" if fast else "_int_mm"
            for (o, i, b), fast in sorted(_choice.items())}
