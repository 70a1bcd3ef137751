"""The int8 activation digits of ``w8a8`` and ``w8a16`` in one pass each, as a small C
kernel built at first use: the same bits as the torch operators they replace, fewer
dispatches per step.

Why. Quantizing a row into digits (:func:`~agentspec.targets.w8a8.quantize_rows`) and
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

Built how. From ``fused_digits.c`` beside this module, with the system C compiler
(``$CC`` or ``cc``) at first use, for this CPU (``-march=native``: the loops vectorize
with the instructions this CPU has, which a setuptools extension built for any machine,
as the suffix tree's merge is, cannot assume), into ``$AGENTSPEC_HOME/kernels`` under a
name keyed by the source, the flags and the CPU, written atomically; a second process
loads the file. Without a compiler, or when the build or load fails, or with
``AGENTSPEC_FUSED_DIGITS=0``, the torch operators run instead (one warning per process).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from agentspec.models import agentspec_home, private_dir
from agentspec.targets.fingerprint import cpuinfo

__all__ = ["SOURCE", "available", "combine", "quantize"]

log = logging.getLogger(__name__)

#: The kernel's C source, beside this module (package data).
SOURCE = Path(__file__).with_name("fused_digits.c")

_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False

_DTYPES = (torch.float32, torch.bfloat16)


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _build(cc: str) -> Path:
    """Compile the kernel for this CPU (or find it compiled) and return the library's path."""
    key = hashlib.blake2b(digest_size=10)
    source = SOURCE.read_bytes()
    key.update(source)
    key.update(f"\0{' '.join(_FLAGS)}\0{cc}\0{platform.machine()}\0"
               f"{cpuinfo('model name')}\0{cpuinfo('flags')}".encode())
    folder = private_dir(agentspec_home() / "kernels")
    lib = folder / f"digits-{key.hexdigest()}.so"
    if lib.exists():
        return lib
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = Path(tmp) / "digits.c"
        src.write_bytes(source)
        built = Path(tmp) / "digits.so"
        subprocess.run([cc, *_FLAGS, str(src), "-o", str(built)], check=True,
                       capture_output=True, timeout=120)
        os.replace(built, lib)  # atomic: a concurrent builder's file is the same code
    return lib


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:  # every call after the first: no lock on the hot path
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("AGENTSPEC_FUSED_DIGITS", "1") == "0":
            return None
        cc = _compiler()
        if cc is None:
            log.warning("no C compiler: w8a8/w8a16 digits run as torch operators (slower "
                        "one-row steps, the same bits)")
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc)))
        except (OSError, subprocess.SubprocessError) as exc:  # no source, no build, no load
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("building the fused digit kernel failed (%s%s): w8a8/w8a16 digits "
                        "run as torch operators", exc, f": {detail.decode()[:300]}"
                        if detail else "")
            return None
        p, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.agentspec_quantize.argtypes = [p, cint, i64, i64, cint, p, p, p]
        lib.agentspec_quantize.restype = None
        lib.agentspec_combine.argtypes = [p, i64, i64, cint, p, p, p, p, cint]
        lib.agentspec_combine.restype = None
        _lib = lib
        return lib


def available() -> bool:
    """Whether the kernel is built and loaded (building it on the first call)."""
    return _load() is not None


def quantize(rows: torch.Tensor, digits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`~agentspec.targets.w8a8.quantize_rows` of CPU ``rows`` ``[m, k]`` (fp32 or
    bf16) in one pass: ``(q [digits·m, k] int8, u [m, 1] fp32)``, or ``None`` where the
    kernel is not there or the rows are not its kind (the caller runs the torch operators).
    """
    lib = _load()
    if lib is None or rows.dtype not in _DTYPES or rows.device.type != "cpu":
        return None
    rows = rows.contiguous()
    m, k = rows.shape
    q = torch.empty(digits * m, k, dtype=torch.int8)
    u = torch.empty(m, 1)
    bf16 = rows.dtype == torch.bfloat16
    scratch = torch.empty(k) if bf16 else None  # one row widened to fp32
    lib.agentspec_quantize(rows.data_ptr(), int(bf16), m, k, digits, q.data_ptr(),
                           u.data_ptr(), None if scratch is None else scratch.data_ptr())
    return q, u


def combine(acc: torch.Tensor, scales: torch.Tensor, u: torch.Tensor,
            bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The outputs ``[m, n]`` in ``dtype`` from the exact int32 sums ``acc``
    ``[digits·m, n]`` (``m`` = ``u``'s rows): ``((254 · high + low) · scales) · u + bias``
    (one digit: ``(acc · scales) · u + bias``), as
    :meth:`~agentspec.targets.w8a8.W8A8Linear.combine_ops` computes them; ``None`` where
    the kernel is not there or the tensors are not its kind (or there are no rows)."""
    lib = _load()
    m = u.shape[0]
    if lib is None or dtype not in _DTYPES or acc.dtype != torch.int32 or m == 0:
        return None
    n = acc.shape[1]
    acc = acc.contiguous()
    scales = scales.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    out = torch.empty(m, n, dtype=dtype)
    lib.agentspec_combine(acc.data_ptr(), m, n, acc.shape[0] // m, scales.data_ptr(),
                          u.data_ptr(), None if bias is None else bias.data_ptr(),
                          out.data_ptr(), int(dtype == torch.bfloat16))
    return out
