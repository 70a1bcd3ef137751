"""One loaded model per (model, dtype) per process, shared by every ``ChatAgentSpec``.

Loading the embedded model takes seconds and holds a few hundred MB, and LangChain code
creates chat model instances freely (per agent, per test, per ``bind``), so instances never
own a model: they ask this module for a :class:`~agentspec.runtime.Runtime`.

A runtime is kept per (model, dtype, store, tool format): requests with different session
stores must not share drafter histories, and a runtime renders, constrains and parses tool
calls in one format; ``dtype="auto"`` is keyed by the precision it resolves to, so ``auto``
and its choice share one model. Runtimes over the same model share its target, and so its lock
(``HFTarget.lock``, which every :class:`~agentspec.runtime.Runtime` over the target takes):
the target holds a single KV cache, so only one request may decode on it at a time,
whichever runtime it came through.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from agentspec.chat.formats import check_format_name
from agentspec.runtime import Runtime
from agentspec.targets.hf import HFTarget, TargetConfig

log = logging.getLogger(__name__)

StoreArg = bool | str | Path | None

_GUARD = threading.Lock()
_TARGETS: dict[tuple[str, str], HFTarget] = {}
_RUNTIMES: dict[tuple[str, str, str, str], Runtime] = {}
_TOKENIZERS: dict[str, Any] = {}


def _store_key(store: StoreArg) -> str:
    if not store:
        return ""
    if store is True:
        return "default"
    return str(Path(str(store)).expanduser().resolve())


def shared_runtime(
    model: str | None, dtype: str = "auto", store: StoreArg = True,
    tool_format: str | None = None,
) -> Runtime:
    """The process-wide runtime for ``model`` / ``dtype`` / ``store`` / ``tool_format``,
    loaded on first use (runtimes that differ only in store or format share the model).

    Args:
        model: Embedded model name (``None`` for the default) or a local model folder.
        dtype: ``auto`` (the default; see :class:`~agentspec.targets.hf.TargetConfig`),
            ``float32`` (the reference, by name), ``bfloat16``, ``int8``, ``w8a8`` or
            ``w8a16`` (CPU only).
        store: ``True`` for the default session store under ``AGENTSPEC_HOME``, a path for
            a SQLite file, or ``False``/``None`` to keep session caches in memory only.
        tool_format: The model's tool-call format (``None``: chosen from its chat template,
            see :func:`agentspec.chat.formats.choose_tool_format`).

    Raises:
        ModelLoadError: the model cannot be found or loaded.
        ConfigError: an invalid dtype or an unknown ``tool_format`` (checked before loading).
    """
    from agentspec.storage.sessions import open_store

    if tool_format is not None:
        check_format_name(tool_format)
    # Validates the dtype and resolves "auto" (the machine's choice), loading nothing.
    dtype = TargetConfig(model=model, dtype=dtype).dtype
    key = (model or "", dtype, _store_key(store), tool_format or "")
    with _GUARD:
        runtime = _RUNTIMES.get(key)
        if runtime is not None:
            return runtime
        target_key = (model or "", dtype)
        if target_key not in _TARGETS:
            _TARGETS[target_key] = HFTarget.load(TargetConfig(model=model, dtype=dtype))
        # One KV cache per target: its runtimes all take the target's lock.
        runtime = Runtime(_TARGETS[target_key], open_store(store), tool_format=tool_format)
        _RUNTIMES[key] = runtime
        return runtime


def shared_tokenizer(model: str | None) -> Any:
    """The tokenizer of ``model``: a loaded target's, else read from the local model folder
    (offline, well under a second; the weights are not loaded).

    Raises:
        ModelLoadError: the model cannot be found.
    """
    from agentspec.models import resolve_model

    key = model or ""
    with _GUARD:
        for (name, _), target in _TARGETS.items():
            if name == key and getattr(target, "tokenizer", None) is not None:
                return target.tokenizer
        if key not in _TOKENIZERS:
            path = resolve_model(model).path
            if (path / "tokenizer.json").is_file():
                # The `tokenizers` file loads in ~0.2 s; transformers' import alone takes
                # seconds, and get_num_tokens should not pay for it.
                _TOKENIZERS[key] = _FileTokenizer(path / "tokenizer.json")
            else:
                from transformers import AutoTokenizer

                _TOKENIZERS[key] = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return _TOKENIZERS[key]


class _FileTokenizer:
    """A ``tokenizer.json`` behind the ``encode`` of a transformers tokenizer."""

    def __init__(self, path: Path) -> None:
        import tokenizers

        self._tok = tokenizers.Tokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)


def clear_runtimes() -> None:
    """Forget every shared runtime and model (tests; frees memory once callers drop them)."""
    with _GUARD:
        for runtime in _RUNTIMES.values():
            if runtime.store is not None and hasattr(runtime.store, "close"):
                runtime.store.close()
        _RUNTIMES.clear()
        _TARGETS.clear()
        _TOKENIZERS.clear()
