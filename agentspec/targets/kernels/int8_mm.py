"""int8 x int8 products summed in int32, each forward's products on the kernel that is
fastest for its row count here: the native few-rows kernel (:mod:`.native`, ``_int8_mm.c``:
every weight read once from its buffer, each activation row dotted with it while it is in
L1) or ``torch._int_mm`` (a GEMM library's int8 path, which wins from some row count on).

Why a choice costs no exactness: an int32 sum of int8 products has one value whatever
kernel, vector width, row count or thread count computes it (|a|, |w| <= 127: no partial
sum overflows), so a one-row step and a k-row verify may take different kernels and give
the same bits.

Why the choice is measured per forward, not per product: the two kernels run on two
thread pools (the native pool, and the OpenMP pool torch's GEMM uses). A product timed
alone measures one pool with the machine to itself; inside a forward that mixes the two,
each pool's workers spin-wait for their next job while the other's run, and on a 2-core
machine they take turns on the cores. Timed alone per product, ``_int_mm`` won half of
Qwen2.5-0.5B's decode shapes; in the forward, every product on the native kernel made the
one-row step clearly faster than that mix (``docs/cpu_step.md``). So each forward the target
times (:func:`timed_forward`, the cost meter's wrapper around a request's forward) puts all
its products on one kernel; per model (its first product's weight shape), row bucket (1,
2, 4, ... product rows) and thread count the first :data:`TRIALS` forwards on each kernel
alternate, and the faster median is kept. Products outside a timed forward (a prompt
chunk's, the load-time cost measurement's) take the native kernel.

Where ``torch._int_mm`` is not exact it is never used (:func:`int_mm_exact`, probed once
per process): without VNNI, oneDNN's AVX2 int8 GEMM multiplies unsigned by signed bytes
after shifting one operand by 128, and its int16 pair sums saturate (255 · 127 · 2 >
32,767), so some sums come out wrong, and which ones depends on the row count: a verify's
rows would differ from a one-row step's. Measured on an AMD EPYC under
``ONEDNN_MAX_CPU_ISA=AVX2``: 17-row products wrong, 1-16-row ones right. There every
product takes the native kernel (or, without the library, an int32 matmul: exact, slow).
"""

from __future__ import annotations

import contextvars
import functools
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from agentspec.interfaces import Target
from agentspec.targets.kernels import native

__all__ = ["MAX_NATIVE_ROWS", "TRIALS", "choices", "forced", "int8_mm", "int_mm_exact",
           "native_mm", "path", "settle", "takes_native", "timed_forward"]

#: Row counts above this always take ``torch._int_mm`` (the native kernel reads each
#: weight once per call but computes one row at a time: a GEMM wins long before this).
MAX_NATIVE_ROWS = 64
#: Timed forwards on each kernel per row bucket and thread count before one is kept.
TRIALS = 3


@dataclass
class _Trials:
    """One row bucket's and thread count's timed forwards (seconds) and the kept kernel."""

    native: list[float] = field(default_factory=list)
    int_mm: list[float] = field(default_factory=list)
    fast: bool | None = None  # native is faster; None while trials run


@dataclass
class _Forward:
    """The kernel one timed forward's products take, fixed at its first product."""

    key: tuple[int, int, int, int] | None = None  # (first weight's out, in, bucket, threads)
    native: bool = True
    trial: bool = False  # the forward is one of its bucket's trials


_trials: dict[tuple[int, int, int, int], _Trials] = {}
_trials_lock = threading.Lock()
_clock = time.perf_counter  # a test's fake clock replaces it
_force: bool | None = None  # forced(): every product on one kernel
_forward: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar(
    "agentspec_int8_forward", default=None)


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
    native.call("agentspec::int8_mm", lib.agentspec_int8_mm, a.data_ptr(), w.data_ptr(),
                out.data_ptr(), m, k, n, torch.get_num_threads())
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


@contextmanager
def timed_forward() -> Iterator[_Forward]:
    """Run one forward whose int8 products all take one kernel, and time it for the
    choice: while its bucket's trials run, the kernel with fewer trials (native first);
    then the faster one. A forward that raises is not counted. Yields the forward's
    record: ``trial`` says afterwards whether it was one of the trials (its time then says
    what a kernel costs, not what the machine's load does: the live cost skips it)."""
    record = _Forward()
    token = _forward.set(record)
    t0 = _clock()
    try:
        yield record
    finally:
        _forward.reset(token)
    if record.key is not None and record.trial:
        _observe(record.key, record.native, _clock() - t0)


@contextmanager
def forced(native: bool) -> Iterator[None]:
    """Put every product of up to :data:`MAX_NATIVE_ROWS` rows on one kernel (the native
    one, or ``torch._int_mm`` where it is exact) for the block, trials aside: benchmarks
    comparing the two (the bits are the same)."""
    global _force
    before, _force = _force, native
    try:
        yield
    finally:
        _force = before


def _observe(key: tuple[int, int, int, int], was_native: bool, seconds: float) -> None:
    with _trials_lock:
        trials = _trials.setdefault(key, _Trials())
        if trials.fast is not None:
            return
        (trials.native if was_native else trials.int_mm).append(seconds)
        if len(trials.native) >= TRIALS and len(trials.int_mm) >= TRIALS:
            trials.fast = statistics.median(trials.native) <= statistics.median(trials.int_mm)


def _takes_native(m: int, w: torch.Tensor) -> bool:
    """Whether a product of ``m`` rows (at most :data:`MAX_NATIVE_ROWS`) by ``w`` takes the
    native kernel: its timed forward's kernel (outside one: the native kernel).

    A forward's trials are keyed by its first product's weight shape too (a model's first
    layer: two models in one process, a target and its draft model, are timed apart)."""
    if _force is not None:
        return _force
    record = _forward.get()
    if record is None:
        return True
    if record.key is not None:
        return record.native  # one kernel for every product of the forward
    key = (int(w.shape[0]), int(w.shape[1]), _bucket(m), torch.get_num_threads())
    with _trials_lock:
        trials = _trials.get(key)
        fast = None if trials is None else trials.fast
        record.key = key
        if fast is not None:
            record.native = fast
        else:  # a trial: the kernel timed fewer times so far
            record.trial = True
            record.native = trials is None or len(trials.native) <= len(trials.int_mm)
        return record.native


def takes_native(m: int, w: torch.Tensor) -> bool:
    """Whether :func:`int8_mm` would put a product of ``m`` int8 rows by ``w`` (contiguous,
    on the CPU) on the native kernel, deciding it as :func:`int8_mm` does (the first
    product of a timed forward fixes the forward's kernel): for a caller that runs the
    native kernel through another entry point (:func:`.fused_digits.linear`)."""
    if native.library() is None:
        return False
    if not int_mm_exact():
        return True
    return m <= MAX_NATIVE_ROWS and _takes_native(m, w)


def int8_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ wᵀ`` in int32 (``a`` ``[m, k]``, ``w`` ``[n, k]``, int8, values in
    [-127, 127]) on the kernel measured fastest for forwards of ``m``'s bucket."""
    if not a.is_contiguous() or not w.is_contiguous() or a.device.type != "cpu":
        return _exact_mm(a, w)
    if takes_native(a.shape[0], w):
        out = native_mm(a, w)
        if out is not None:
            return out
    return _exact_mm(a, w)  # torch._int_mm where it is exact


def settle(target: Target, rows: Sequence[int], token: int = 0) -> int:
    """Run ``target``'s forwards of each row count in ``rows`` (appended to a one-token
    context, then rolled back) until that count's kernel trials end, at most
    ``2 · TRIALS + 1`` forwards per count. Returns the forwards run: 0 where no trials run
    (no native library, or an inexact ``torch._int_mm``). Outside any request: the target's
    cache holds one token afterwards (the next request starts with a prefill).

    Why: half of a bucket's trial forwards take the slower kernel (for a one-row step of
    Qwen 0.5B in w8a16, ``_int_mm`` about 2.4x the native one), so whoever runs a row
    count first pays them: a request's first steps, or the first method of a benchmark.
    A warm-up that must leave only steady-state costs (a draft model priced by its
    measured drafting time, a benchmark) settles its row counts first."""
    runs = 0
    if native.library() is None or not int_mm_exact():
        return runs
    target.prefill([token])
    for n in rows:
        for _ in range(2 * TRIALS + 1):
            target.score([token] * n)  # [n, V]
            target.rollback(n)
            runs += 1
            with _trials_lock:
                if all(t.fast is not None for t in _trials.values()):
                    break
    return runs


def choices() -> dict[str, str]:
    """The kernel kept per ``"first weight out x in, rows <= bucket, threads"`` so far
    (``"timing"`` while its trials run), for stats."""
    with _trials_lock:
        return {f"{o}x{i},rows<={b},threads={t}": ("timing" if tr.fast is None else
                                                  "native" if tr.fast else "_int_mm")
                for (o, i, b, t), tr in sorted(_trials.items())}
