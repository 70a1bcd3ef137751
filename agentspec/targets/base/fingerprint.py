"""A short, cheap fingerprint of a model's weights: what keys files that are only valid for
one model (prefix KV on disk, measured cost curves); and a digest of the forwards' code
(:func:`forward_code`), for files measured from them.

A model's name is not enough: two folders both called ``final`` (``/a/final``, ``/b/final``)
or new weights written over an old folder would share files, and KV computed by one model
would be read back by another (a wrong output, not just a slow one). A full hash of the
weights would be exact but reads every byte (seconds for a 2 GB model, at every start).
The fingerprint reads a bounded amount instead:

* a model folder: ``config.json``'s bytes, and per weight file its name, size,
  modification time (ns) and its first, middle and last MiB. New weights change the size
  or the time even where the sampled bytes agree; retrained weights of the same shape
  differ in every sampled chunk. Copying a folder without keeping times changes the
  fingerprint: that costs a recomputation, never a wrong answer.
* a model object (no files known): its config (without the path it was loaded from) and
  per parameter its name, shape, dtype and first and last elements' bytes.

Both are blake2b digests, 20 hex digits: short enough for a folder name, and a collision
needs two different models to agree on every sampled byte.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from agentspec.errors import ConfigError

#: File name endings of weight files (any other file in the folder is not hashed, except
#: ``config.json``: tokenizer files do not change the KV of given token ids).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5",
                   ".msgpack", ".npz")
_CHUNK = 1 << 20  # bytes read per sampled chunk
_ELEMENTS = 64  # elements sampled at each end of a parameter
_DIGITS = 10  # digest bytes (20 hex digits)


def _file_samples(h: Any, path: Path) -> None:
    st = path.stat()
    h.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    with path.open("rb") as f:
        for offset in sorted({0, max(0, st.st_size // 2 - _CHUNK // 2),
                              max(0, st.st_size - _CHUNK)}):
            f.seek(offset)
            h.update(f.read(_CHUNK))


def folder_fingerprint(folder: str | os.PathLike[str]) -> str:
    """The fingerprint of a Hugging Face model folder (``config.json`` and weight files).

    Args:
        folder: The folder transformers loads.

    Returns:
        20 hex digits.
    """
    folder = Path(folder)
    h = hashlib.blake2b(b"agentspec-model-files-v1\0", digest_size=_DIGITS)
    config = folder / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    files = sorted(p for p in folder.iterdir() if p.is_file())
    weights = [p for p in files if p.name.endswith(WEIGHT_SUFFIXES)]
    # A folder whose weights go by another name: every file counts (safe, a bit slower).
    for path in weights or [p for p in files if p.name != "config.json"]:
        _file_samples(h, path)
    return h.hexdigest()


def _config_json(model: Any) -> str:
    cfg = getattr(model, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    if not callable(to_dict):
        return ""
    # The load path and the library version say nothing about the weights.
    data = {k: v for k, v in to_dict().items()
            if k not in ("_name_or_path", "transformers_version")}
    return json.dumps(data, sort_keys=True, default=str)


def module_fingerprint(model: Any) -> str:
    """The fingerprint of a model object: its config and samples of every parameter.

    Args:
        model: A ``torch.nn.Module`` (a transformers model has a ``config``).

    Returns:
        20 hex digits.
    """
    h = hashlib.blake2b(b"agentspec-model-object-v1\0", digest_size=_DIGITS)
    h.update(_config_json(model).encode())
    if isinstance(model, torch.nn.Module):
        hash_tensors(h, model.named_parameters())
    return h.hexdigest()


def hash_tensors(h: Any, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Feed ``h`` (a hashlib object) each tensor's name, shape, dtype and the bytes of
    its first and last elements."""
    with torch.no_grad():
        for name, tensor in named:
            h.update(f"{name}\0{tuple(tensor.shape)}\0{tensor.dtype}\0".encode())
            if tensor.device.type == "meta" or tensor.numel() == 0:
                continue  # no data to sample (the shape was hashed)
            flat = tensor.detach().reshape(-1)
            sample = torch.cat([flat[:_ELEMENTS], flat[-_ELEMENTS:]]).cpu().contiguous()
            try:
                h.update(sample.view(torch.uint8).numpy().tobytes())
            except (RuntimeError, TypeError):  # a dtype without a byte view (quantized)
                h.update(repr(sample.tolist()).encode())


#: The modules whose code decides what a forward computes and what it costs (the products
#: and their C part, attention, the forwards, the direct step, the shapes, the cache's
#: layers and the step mode flag): their source keys the files measured from forwards
#: (cost curves, probe results), so an agentspec whose forwards changed measures again
#: rather than reading another code's numbers. A package counts with every ``.py``, ``.c``
#: and ``.h`` file under it, so a module added to it is keyed without naming it here.
FORWARD_CODE = ("agentspec.targets.forward", "agentspec.targets.kernels",
                "agentspec.targets.cache.kv_cache", "agentspec.targets.base.step_mode")

#: File name endings of source files a package's digest reads.
SOURCE_SUFFIXES = (".py", ".c", ".h")


def code_files(modules: Iterable[str] = FORWARD_CODE) -> list[tuple[str, Path]]:
    """The source files of ``modules`` (a package: every source file under it), each with
    its name relative to the ``agentspec`` package (what the digest hashes with it).

    Raises:
        ConfigError: a module is not found or has no source file: the digest would
            otherwise key the caches on less than the forwards' code, and a changed
            forward could read another code's measurements.
    """
    found: list[tuple[str, Path]] = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not Path(spec.origin).is_file():
            raise ConfigError(f"forward-code module {name!r} has no source file: the cost "
                              "and probe caches cannot be keyed on it")
        origin = Path(spec.origin)
        package = spec.submodule_search_locations is not None  # origin: its __init__.py
        root = origin.parents[name.count(".") + package]  # the folder holding agentspec
        paths = ([origin] if not package else
                 sorted(p for p in origin.parent.rglob("*") if p.suffix in SOURCE_SUFFIXES
                        and "__pycache__" not in p.parts))
        found += [(p.relative_to(root).as_posix(), p) for p in paths]
    return sorted(found)


def code_digest(files: Iterable[tuple[str, Path]]) -> str:
    """A digest (20 hex digits) of ``files``' names and bytes."""
    h = hashlib.blake2b(b"agentspec-forward-code-v2\0", digest_size=_DIGITS)
    for name, path in files:
        data = path.read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def forward_code() -> str:
    """The digest of :data:`FORWARD_CODE`'s sources (read once per process).

    Raises:
        ConfigError: a forward-code module's source is missing (:func:`code_files`).
    """
    return code_digest(code_files())
