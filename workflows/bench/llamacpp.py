"""llama.cpp as a peer: greedy decoding of token-id prompts with prefix reuse, as llama-server.

The peer runs the same GGUF file agentspec converts its models from, on the same token ids
(agentspec's tokenizer renders and tokenises every prompt; llama.cpp never tokenises), and
decodes greedily: the argmax of llama.cpp's logits at every step. Between turns it keeps the
longest common prefix of the new prompt with what its KV cache holds and feeds only the rest,
as llama-server does for a slot (``llama_kv_self_seq_rm`` after the shared prefix; at least
the prompt's last token is fed again, so the first answer token comes from this prompt's own
logits).

The library: the CPU build inside the ``llama-cpp-cffi`` wheel (0.4.42: a portable AVX2
build of llama.cpp, installed ``--no-deps`` by ``make llamacpp``). Its Python package is
never imported (it imports transformers 4 and probes for GPUs); its CPU extension module is
loaded directly and driven through llama.cpp's C API with the ``cffi`` declarations the
module carries. The wheel is built with GCC 14 and leaves ``__cxa_call_terminate`` (a C++
runtime helper newer than this machine's libstdc++) unresolved: where the first load fails
on it, a one-function shim is compiled once with ``g++`` under ``$AGENTSPEC_HOME/peers`` and
loaded globally first. ``AGENTSPEC_LLAMACPP_LIB`` points at another build of the same
module.

Timing per turn: ``prefill_s`` from the cache trim to the first answer token (the prompt's
forwards in ``n_batch`` chunks, the logits of its last row, the argmax); ``decode_s`` the
one-token forwards after it. A turn of ``n`` tokens thus runs ``n - 1`` decode forwards.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from agentspec.errors import BenchmarkError
from agentspec.models import agentspec_home

__all__ = ["LLAMACPP_WHEEL", "LlamaCppRunner", "PeerUnavailableError", "PrefixLedger",
           "TurnRecord", "common_prefix", "library_path", "load_library"]

#: The wheel ``make llamacpp`` installs (``--no-deps``), whose CPU module is the peer.
LLAMACPP_WHEEL = "llama-cpp-cffi==0.4.42"
#: Environment variable naming another build of the module (a ``_llama_cpp_cpu*.so``).
LIBRARY_ENV = "AGENTSPEC_LLAMACPP_LIB"
_MODULE = "_llama_cpp_cpu"
_SHIM_SYMBOL = "__cxa_call_terminate"
# The missing C++ runtime helper: reached only when an exception leaves a noexcept
# function, where the program ends anyway.
_SHIM_SOURCE = ('#include <exception>\nextern "C" void __cxa_call_terminate(void *) noexcept '
                "{ std::terminate(); }\n")
_INSTALL_HINT = (f"install it with `make llamacpp` (or `pip install --no-deps {LLAMACPP_WHEEL}` "
                 "and `pip install -e .[peers-llamacpp]`)")


class PeerUnavailableError(BenchmarkError):
    """The llama.cpp peer cannot run here (not installed, or its library does not load)."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class PrefixLedger:
    """What a llama.cpp sequence's KV cache holds: ``tokens[i]`` at position ``i``.

    A new prompt keeps the longest common prefix with it, but never the whole prompt: its
    last token is fed again so its logits are this prompt's (llama-server does the same).
    """

    tokens: list[int] = field(default_factory=list)

    def keep(self, prompt: Sequence[int], reuse: bool = True) -> int:
        """How many of ``prompt``'s leading tokens can stay cached."""
        if not reuse or not prompt:
            return 0
        return min(common_prefix(self.tokens, prompt), len(prompt) - 1)

    def truncate(self, n: int) -> None:
        """The cache now holds only its first ``n`` tokens."""
        del self.tokens[n:]

    def extend(self, ids: Iterable[int]) -> None:
        """``ids`` were fed after what the cache holds."""
        self.tokens.extend(int(t) for t in ids)

    def clear(self) -> None:
        """The cache is empty."""
        self.tokens.clear()


@dataclass
class TurnRecord:
    """One greedy turn of the peer.

    Attributes:
        prompt_tokens: Tokens of the prompt.
        reused: Leading prompt tokens read from the KV cache (not fed).
        new_prompt: Prompt tokens fed (``prompt_tokens - reused``).
        prefill_s: Trim, prompt forwards and the first token's argmax.
        decode_s: The one-token forwards after the first token.
        tokens: The answer's token ids (an end token included when one stopped it).
    """

    prompt_tokens: int
    reused: int
    new_prompt: int
    prefill_s: float
    decode_s: float
    tokens: list[int]

    @property
    def generated(self) -> int:
        """Answer tokens."""
        return len(self.tokens)

    @property
    def latency_s(self) -> float:
        """Prefill plus decode."""
        return self.prefill_s + self.decode_s

    @property
    def prefill_tok_s(self) -> float:
        """Fed prompt tokens per second of prefill."""
        return self.new_prompt / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Decode forwards (one token each) per second."""
        return (self.generated - 1) / self.decode_s if self.decode_s else 0.0

    def to_dict(self, with_tokens: bool = True) -> dict[str, Any]:
        """The record with its rates, seconds rounded to 0.1 ms."""
        out = asdict(self)
        out["prefill_s"], out["decode_s"] = round(self.prefill_s, 4), round(self.decode_s, 4)
        out.update(generated=self.generated, latency_s=round(self.latency_s, 4),
                   prefill_tok_s=round(self.prefill_tok_s, 2),
                   decode_tok_s=round(self.decode_tok_s, 2))
        if not with_tokens:
            del out["tokens"]
        return out


def library_path() -> Path:
    """The llama.cpp CPU module: ``$AGENTSPEC_LLAMACPP_LIB``, else the one inside the
    installed ``llama-cpp-cffi`` wheel (found without importing its package).

    Raises:
        PeerUnavailableError: neither exists.
    """
    env = os.environ.get(LIBRARY_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise PeerUnavailableError(f"{LIBRARY_ENV}={env} is not a file")
        return path
    spec = importlib.util.find_spec("llama")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        found = sorted(Path(root).glob(f"{_MODULE}.*.so"))
        if found:
            return found[0]
    raise PeerUnavailableError(f"llama.cpp (the peer) is not installed: {_INSTALL_HINT}")


def _shim() -> Path:
    """The compiled ``__cxa_call_terminate`` shim (built once under $AGENTSPEC_HOME/peers)."""
    out = agentspec_home() / "peers" / "cxa_call_terminate.so"
    if out.is_file():
        return out
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        raise PeerUnavailableError(
            f"the llama.cpp library needs {_SHIM_SYMBOL}, which this machine's libstdc++ "
            "lacks, and no C++ compiler (g++) was found to build the one-line shim")
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".cc")
    src.write_text(_SHIM_SOURCE)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    proc = subprocess.run([cxx, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src)],
                          capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise PeerUnavailableError(f"building the {_SHIM_SYMBOL} shim failed: {proc.stderr[-500:]}")
    tmp.replace(out)
    return out


def _import_module(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
    spec = importlib.util.spec_from_file_location(_MODULE, path, loader=loader)
    if spec is None:
        raise PeerUnavailableError(f"{path} is not a loadable module")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_LOADED: dict[Path, ModuleType] = {}
_CALLBACKS: list[Any] = []


def load_library(path: Path | None = None) -> ModuleType:
    """The llama.cpp CPU module (``.lib``: the C API, ``.ffi``: its declarations), loaded
    once per process, with the shim first where the library needs it.

    Raises:
        PeerUnavailableError: not installed, ``cffi`` missing, or the library does not load.
    """
    path = (path or library_path()).resolve()
    if path in _LOADED:
        return _LOADED[path]
    try:
        module = _import_module(path)
    except ImportError as exc:
        if "_cffi_backend" in str(exc):
            raise PeerUnavailableError(f"the llama.cpp peer needs cffi: {_INSTALL_HINT}") from exc
        if _SHIM_SYMBOL not in str(exc):
            raise PeerUnavailableError(f"{path} does not load: {exc}") from exc
        ctypes.CDLL(str(_shim()), mode=ctypes.RTLD_GLOBAL)
        try:
            module = _import_module(path)
        except ImportError as again:
            raise PeerUnavailableError(f"{path} does not load: {again}") from again
    lib, ffi = module.lib, module.ffi
    # llama.cpp logs every load to stderr; the callback lives as long as the process.
    quiet = ffi.callback("void(enum ggml_log_level, const char *, void *)",
                         lambda level, text, data: None)
    _CALLBACKS.append(quiet)
    lib.llama_log_set(quiet, ffi.NULL)
    lib.llama_backend_init()
    _LOADED[path] = module
    return module


class LlamaCppRunner:
    """One llama.cpp model and context (one sequence, like a llama-server slot), decoding
    token-id prompts greedily with prefix reuse across turns.

    Args:
        gguf: The model file.
        n_ctx: Context positions (prompt plus answer must fit).
        threads: Threads for decoding and for prompt batches.
        n_batch: Prompt tokens per forward (llama.cpp's ``n_batch`` and ``n_ubatch``).
        library: The module path (default: :func:`library_path`).
        warmup: Tokens decoded once at load and dropped, so the first turn does not pay
            for the first forward's buffers.
        pool: Attach a persistent thread pool (llama-server's way; else llama.cpp starts
            and joins its threads in every forward).

    Raises:
        PeerUnavailableError: the library does not load.
        BenchmarkError: the model or context cannot be created.
    """

    def __init__(self, gguf: str | os.PathLike[str], n_ctx: int = 4096, threads: int = 2,
                 n_batch: int = 512, library: Path | None = None, warmup: int = 8,
                 pool: bool = True) -> None:
        self.module = load_library(library)
        self.lib, self.ffi = self.module.lib, self.module.ffi
        lib, ffi = self.lib, self.ffi
        self.gguf, self.n_ctx, self.threads, self.n_batch = Path(gguf), n_ctx, threads, n_batch
        self.model = lib.llama_model_load_from_file(str(self.gguf).encode(),
                                                    lib.llama_model_default_params())
        if self.model == ffi.NULL:
            raise BenchmarkError(f"llama.cpp could not load {self.gguf}")
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_threads = params.n_threads_batch = threads
        params.n_seq_max = 1
        self.ctx = lib.llama_init_from_model(self.model, params)
        if self.ctx == ffi.NULL:
            lib.llama_model_free(self.model)
            raise BenchmarkError(f"llama.cpp could not create a {n_ctx}-token context")
        # One persistent thread pool for decode and prompt batches, llama.cpp's defaults
        # (hybrid polling), as llama-server attaches (without one, every forward would start
        # and join its threads).
        pool_params = ffi.new("struct ggml_threadpool_params *",
                              lib.ggml_threadpool_params_default(threads))
        self.pool = lib.ggml_threadpool_new(pool_params) if pool else ffi.NULL
        if pool and self.pool == ffi.NULL:
            raise BenchmarkError(f"llama.cpp could not start a {threads}-thread pool")
        if pool:
            lib.llama_attach_threadpool(self.ctx, self.pool, ffi.NULL)
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model)))
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.ledger = PrefixLedger()
        if warmup:
            self._feed(list(range(1, warmup + 1)), 0, logits=True)
            self.clear()

    @property
    def system_info(self) -> str:
        """llama.cpp's build features (``AVX2 = 1 | ...``)."""
        return str(self.ffi.string(self.lib.llama_print_system_info()).decode()).strip(" |")

    @property
    def description(self) -> str:
        """llama.cpp's one-line description of the model (architecture, size, quantization)."""
        buf = self.ffi.new("char[256]")
        self.lib.llama_model_desc(self.model, buf, 256)
        return str(self.ffi.string(buf).decode())

    def clear(self) -> None:
        """Empty the KV cache (the next turn prefills everything)."""
        self.lib.llama_kv_self_clear(self.ctx)
        self.ledger.clear()

    def _feed(self, ids: Sequence[int], start: int, logits: bool,
              every_row: bool = False) -> list[int]:
        """Forward ``ids`` at positions ``start...`` in ``n_batch`` chunks; with ``logits``,
        keep the last token's logits; with ``every_row``, return every row's argmax."""
        b, lib = self.batch, self.lib
        argmaxes: list[int] = []
        for i0 in range(0, len(ids), self.n_batch):
            chunk = ids[i0 : i0 + self.n_batch]
            b.n_tokens = len(chunk)
            for j, tok in enumerate(chunk):
                b.token[j] = tok
                b.pos[j] = start + i0 + j
                b.n_seq_id[j] = 1
                b.seq_id[j][0] = 0
                b.logits[j] = 1 if every_row else 0
            if logits and i0 + len(chunk) == len(ids):
                b.logits[len(chunk) - 1] = 1
            rc = lib.llama_decode(self.ctx, b)
            if rc != 0:
                raise BenchmarkError(f"llama_decode failed ({rc}) at position {start + i0}")
            if every_row:
                argmaxes += [self._argmax(j) for j in range(len(chunk))]
        return argmaxes

    def _argmax(self, row: int = -1) -> int:
        logits = self.lib.llama_get_logits_ith(self.ctx, row)
        values = np.frombuffer(self.ffi.buffer(logits, self.n_vocab * 4), dtype=np.float32)
        return int(values.argmax())

    def teacher_forced(self, prompt: Sequence[int], continuation: Sequence[int]) -> list[int]:
        """llama.cpp's argmax after ``prompt`` and after each prefix of ``continuation``
        (its last token excluded), all fed cold: where another decoder's greedy tokens are
        ``continuation``, the share of positions where the two agree does not depend on
        where the free-running answers first part."""
        prompt, cont = [int(t) for t in prompt], [int(t) for t in continuation]
        if not prompt or not cont or len(prompt) + len(cont) > self.n_ctx:
            raise BenchmarkError("teacher forcing needs a prompt and a continuation that fit")
        self.clear()
        self._feed(prompt[:-1], 0, logits=False)
        out = self._feed([prompt[-1], *cont[:-1]], len(prompt) - 1, logits=False,
                         every_row=True)
        self.ledger.extend([*prompt, *cont[:-1]])
        return out

    def run_turn(self, prompt: Sequence[int], max_tokens: int, eos: Iterable[int] = (),
                 reuse: bool = True) -> TurnRecord:
        """Greedy-decode up to ``max_tokens`` tokens after ``prompt``, stopping after an
        ``eos`` token; with ``reuse``, keep the cached common prefix.

        Raises:
            BenchmarkError: the prompt plus answer does not fit ``n_ctx``, or a forward fails.
        """
        prompt = [int(t) for t in prompt]
        if not prompt or max_tokens < 1:
            raise BenchmarkError("a turn needs a prompt and max_tokens >= 1")
        if len(prompt) + max_tokens > self.n_ctx:
            raise BenchmarkError(f"prompt {len(prompt)} + answer {max_tokens} tokens exceeds "
                                 f"the peer's context of {self.n_ctx}")
        stop = set(eos)
        t0 = time.perf_counter()
        keep = self.ledger.keep(prompt, reuse)
        self.lib.llama_kv_self_seq_rm(self.ctx, 0, keep, -1)
        self.ledger.truncate(keep)
        self._feed(prompt[keep:], keep, logits=True)
        self.ledger.extend(prompt[keep:])
        out = [self._argmax()]
        t1 = time.perf_counter()
        while len(out) < max_tokens and out[-1] not in stop:
            self._feed(out[-1:], len(self.ledger.tokens), logits=True)
            self.ledger.extend(out[-1:])
            out.append(self._argmax())
        t2 = time.perf_counter()
        return TurnRecord(len(prompt), keep, len(prompt) - keep, t1 - t0, t2 - t1, out)

    def close(self) -> None:
        """Free the batch, context and model."""
        if getattr(self, "ctx", None) is not None:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            if self.pool != self.ffi.NULL:
                self.lib.ggml_threadpool_free(self.pool)
            self.lib.llama_model_free(self.model)
            self.ctx = None

    def __enter__(self) -> LlamaCppRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
