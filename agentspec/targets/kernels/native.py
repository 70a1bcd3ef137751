"""The native kernels' library: built at install, loaded once through ctypes.

One C extension, ``agentspec.targets.kernels._native`` (``pyproject.toml``), holds the
kernels written here: the activation digits of ``w8a8`` / ``w8a16`` (:mod:`.fused_digits`),
the int8 products of few rows (:mod:`.int8_mm`), a whole int8 layer over few rows in one
call (:func:`.fused_digits.linear`), decode attention whose rows' bits do not
depend on the forward's shape (:mod:`.attention_kernel`) and the thread pool they share. It is
compiled at install with the install's C compiler for the installing CPU
(``-march=native``: the loops use the vector instructions this CPU has), with no fused
multiply-add and no fast-math (the floating-point kernels reproduce the torch operators'
bits). A machine without a C compiler fails the install with the compiler's error.

Whether the library loads changes speed, never an answer: every kernel here has a torch
reference with the same bits, which runs where the library is absent (a source tree used
without installing) or switched off (``AGENTSPEC_NATIVE=0``), with one warning per process;
``AGENTSPEC_NATIVE_LIBRARY`` names another build to load (an AVX2-only build tried on an
AVX-512 machine);
``dtype="auto"`` never looks at it. While ``torch.profiler`` records, each call is a named
event (ctypes calls are otherwise invisible to it).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from torch.autograd import profiler

__all__ = ["EXTENSION", "SOURCES", "available", "call", "library", "library_path"]

log = logging.getLogger(__name__)
R = TypeVar("R")

#: The extension module the install builds.
EXTENSION = f"{__package__}._native"
#: Its C sources, beside this module (package data; keyed into the forward-code digest of
#: :mod:`agentspec.targets.base.fingerprint`).
SOURCES = tuple(sorted(Path(__file__).parent.glob("_*.[ch]")))

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def library_path() -> Path | None:
    """Where the install put the built library (``None``: not built)."""
    try:
        spec = importlib.util.find_spec(EXTENSION)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.agentspec_quantize.argtypes = [p, cint, i64, i64, cint, p, p, p]
    lib.agentspec_quantize.restype = None
    lib.agentspec_combine.argtypes = [p, i64, i64, cint, p, p, p, p, cint]
    lib.agentspec_combine.restype = None
    lib.agentspec_int8_mm.argtypes = [p, p, p, i64, i64, i64, cint]
    lib.agentspec_int8_mm.restype = None
    lib.agentspec_int8_linear.argtypes = [p, cint, i64, i64, cint, p, i64, p, p, p, cint, cint]
    lib.agentspec_int8_linear.restype = cint
    lib.agentspec_int8_mm_path.argtypes = []
    lib.agentspec_int8_mm_path.restype = ctypes.c_char_p
    lib.agentspec_attention.argtypes = [p, ctypes.c_float, cint]
    lib.agentspec_attention.restype = cint


def library() -> ctypes.CDLL | None:
    """The loaded library, or ``None`` where it is not built or switched off."""
    global _lib, _tried
    if _tried:  # every call after the first: no lock on the hot path
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("AGENTSPEC_NATIVE", "1") == "0":
            return None
        override = os.environ.get("AGENTSPEC_NATIVE_LIBRARY")  # e.g. an AVX2 build to test
        path = Path(override) if override else library_path()
        try:
            if path is None:
                raise OSError(f"{EXTENSION} is not built (install agentspec with pip)")
            lib = ctypes.CDLL(str(path))
            _declare(lib)
        except (OSError, AttributeError) as exc:
            log.warning("the native kernels are not loaded (%s): w8a8/w8a16 run their torch "
                        "operators (slower steps, the same bits)", exc)
            return None
        _lib = lib
        return lib


def available() -> bool:
    """Whether the library built at install is loaded (loading it on the first call)."""
    return library() is not None


def call(name: str, fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)``, as one event named ``name`` in a running ``torch.profiler``. Without
    one, the check is one flag read: no context manager on the hot path (a decode step
    makes a few hundred of these calls, and each manager costs microseconds)."""
    if profiler._is_profiler_enabled:
        with profiler.record_function(name):
            return fn(*args)
    return fn(*args)
