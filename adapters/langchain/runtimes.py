"""One loaded model per (model, dtype) per process, shared by every ``ChatAgentSpec``.

Loading the embedded model takes seconds and holds a few hundred MB, and LangChain code
creates chat model instances freely (per agent, per test, per ``bind``), so instances never
own a model: they ask this module for a :class:`~agentspec.runtime.Runtime`.

A runtime is kept per (model, dtype, store): requests with different session stores must not
share drafter histories. Runtimes over the same model share its target *and its lock*: the
target holds a single KV cache, so only one request may decode on it at a time, whichever
runtime it came through.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from agentspec.runtime import Runtime
from agentspec.targets.hf import HFTarget, TargetConfig

log = logging.getLogger(__name__)

StoreArg = bool | str | Path | None

_GUARD = threading.Lock()
_TARGETS: dict[tuple[str, str], tuple[HFTarget, threading.RLock]] = {}
_RUNTIMES: dict[tuple[str, str, str], Runtime] = {}


def _store_key(store: StoreArg) -> str:
    if not store:
        return ""
    if store is True:
        return "default"
    return str(Path(str(store)).expanduser().resolve())


def shared_runtime(model: str | None, dtype: str = "float32", store: StoreArg = True) -> Runtime:
    """The process-wide runtime for ``model`` / ``dtype`` / ``store``, loaded on first use.

    Args:
        model: Embedded model name (``None`` for the default) or a local model folder.
        dtype: ``float32`` (exact) or ``bfloat16``.
        store: ``True`` for the default session store under ``AGENTSPEC_HOME``, a path for
            a SQLite file, or ``False``/``None`` to keep session caches in memory only.

    Raises:
        ModelLoadError: the model cannot be found or loaded.
        ConfigError: an invalid dtype.
    """
    from agentspec.store import open_store

    key = (model or "", dtype, _store_key(store))
    with _GUARD:
        runtime = _RUNTIMES.get(key)
        if runtime is not None:
            return runtime
        target_key = (model or "", dtype)
        if target_key not in _TARGETS:
            target = HFTarget.load(TargetConfig(model=model, dtype=dtype))
            _TARGETS[target_key] = (target, threading.RLock())
        target, lock = _TARGETS[target_key]
        runtime = Runtime(target, open_store(store))
        runtime.lock = lock  # one KV cache per target: all its runtimes take the same lock
        _RUNTIMES[key] = runtime
        return runtime


def clear_runtimes() -> None:
    """Forget every shared runtime and model (tests; frees memory once callers drop them)."""
    with _GUARD:
        for runtime in _RUNTIMES.values():
            if runtime.store is not None and hasattr(runtime.store, "close"):
                runtime.store.close()
        _RUNTIMES.clear()
        _TARGETS.clear()
