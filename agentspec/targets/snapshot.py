"""A quantized snapshot of a shipped model: its int8 loads take seconds and hold only the
quantized tensors.

Every shipped model loads its int8 precisions from a snapshot. Quantizing at load reads the
fp32 weights first, and the process keeps most of that memory after they are freed (the
0.5B model loaded in w8a16 beside the 1.5B as its draft model held 4.7 GB more resident
memory quantized at load, for 0.8 GB of tensors). The 1.5B shipped model keeps no fp32
folder (it would take 7.1 GB): its weights are in its
GGUF, which transformers dequantises to fp32 in about a minute at every load
(:attr:`~agentspec.models.ShippedModel.fp32_folder`). The int8 precisions (``int8``,
``w8a8``, ``w8a16``: ``dtype="auto"`` on an AVX-512 CPU) keep of those fp32 weights only
what :func:`~agentspec.targets.kernels.int8.quantize_linears` makes of them: per linear
layer its int8 weights, its fp32 per-row scales and its bias, and the rest of the model cast
to bf16. The snapshot is exactly that, one safetensors file (~2 GB for the 1.5B) written at
the model's first int8 load; that load and every later one build the model from it
(:func:`read`: a skeleton on the meta device, then each tensor in its place), so every layer
holds the tensors quantizing at load would give it and the logits are bit-identical
(``tests/unit/test_models_snapshot.py``).

One snapshot serves the three precisions: it keeps w8a8's fp32 scales and bias; ``int8``'s
bf16 ones are their casts, as :class:`~agentspec.targets.kernels.int8.Int8Linear` makes
them from fp32.

The file is keyed by the model folder's fingerprint (its config, tokenizer and the marker
naming the GGUF it was converted from) and :func:`code_key`: the digest of the kernels'
sources (the quantizers, the quantized layers, this module) and the torch and transformers
versions. A snapshot made from other weights or by other quantization code is never read.
Not the whole forward code's digest (:func:`~agentspec.targets.base.fingerprint.
forward_code`, which keys the measured costs): attention or the decode step do not change
what a snapshot holds, and a key that changed with them would re-dequantise the GGUF (two
minutes) after every edit of the forward. Writing one deletes the model's older snapshots
(one per model on disk).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from agentspec.errors import ConfigError, ModelLoadError
from agentspec.models import (
    EMBEDDED_MODEL,
    ModelFiles,
    ShippedModel,
    atomic_path,
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_model,
    shipped_model,
)
from agentspec.targets.base.cpu import release_freed_memory
from agentspec.targets.base.fingerprint import code_digest, code_files, folder_fingerprint
from agentspec.targets.kernels import int8, w8a8
from agentspec.targets.kernels.precision import activation_dtype

__all__ = ["FORMAT", "KERNELS", "build", "code_key", "load_quantized", "read", "snapshot_path",
           "tensors", "write"]

log = logging.getLogger(__name__)

#: The snapshot's format, in its metadata (a file of another format is rebuilt).
FORMAT = "agentspec-int8-snapshot-v1"

#: The code a snapshot's key digests: every source file of the kernels package (where the
#: quantizers and the quantized layers live) and this module.
KERNELS = ("agentspec.targets.kernels", __name__)


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The snapshot of an fp32 ``model``: per ``nn.Linear`` ``<name>.qweight`` (int8),
    ``<name>.scales`` (fp32) and ``<name>.bias`` (fp32) as
    :func:`~agentspec.targets.kernels.w8a8.quantize_weight` and ``W8A8Linear`` make them;
    every other parameter and buffer (non-persistent ones too: the rotary frequencies) as
    ``model.to(activation_dtype())`` would leave it (bf16 where it is native, else fp32)."""
    out: dict[str, torch.Tensor] = {}
    linears = set()
    rest = activation_dtype()  # what the quantized target keeps the rest in here
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module) is torch.nn.Linear:
                q, scale = w8a8.quantize_weight(module.weight)
                out[f"{name}.qweight"], out[f"{name}.scales"] = q, scale.contiguous()
                if module.bias is not None:
                    out[f"{name}.bias"] = module.bias.detach().float().contiguous()
                linears.add(name)
        seen: set[int] = set()
        for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                       model.named_buffers(remove_duplicate=False)):
            if name.rpartition(".")[0] in linears or name in out:
                continue  # a linear's weight (a tied output layer's too) is quantized above
            t = t.detach().to(rest) if t.is_floating_point() else t.detach()
            t = t.contiguous()
            if t.data_ptr() in seen:  # one tensor under two names: the file needs two
                t = t.clone()
            seen.add(t.data_ptr())
            out[name] = t
    return out


def _layer(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, digits: int,
           shared: w8a8.SharedInput | None) -> torch.nn.Module:
    """The layer ``quantize_linears`` would make with ``digits``, from its tensors."""
    if not digits:  # int8: the bf16 casts of the fp32 scale and bias, as Int8Linear's are
        scale = scale.to(torch.bfloat16)
        bias = None if bias is None else bias.to(torch.bfloat16)
    part = SimpleNamespace(in_features=int(q.shape[1]), out_features=int(q.shape[0]),
                           qweight=q, scales=scale, bias=bias)
    if not digits:
        return w8a8.stack_layers(int8.Int8Linear, [part])
    layer = w8a8.stack_layers(w8a8.W8A8Linear, [part])
    layer.shared = shared if shared is not None else w8a8.SharedInput(digits=digits)
    return layer


def _check_kernel(digits: int) -> None:
    """Raise :class:`ConfigError`, as ``quantize_linears`` would, where ``digits`` is not 0,
    1 or 2 or torch lacks their kernel."""
    if digits not in (0, 1, 2):
        raise ConfigError(f"activations must be 0, 1 or 2 int8 digits, got {digits!r}")
    if not (w8a8.supported() if digits else int8.supported()):
        raise ConfigError(f"dtype {('int8', 'w8a8', 'w8a16')[digits]!r} needs a CPU int8 "
                          f"kernel that torch {torch.__version__} lacks; use 'bfloat16'")


def build(model: torch.nn.Module, snapshot: dict[str, torch.Tensor],
          digits: int) -> torch.nn.Module:
    """Put ``snapshot``'s tensors into ``model`` (the model's skeleton, e.g. on the meta
    device): each ``nn.Linear`` becomes the layer :func:`~agentspec.targets.kernels.int8.
    quantize_linears` makes with ``activations=digits`` (siblings sharing their quantized
    input as there), every other parameter and buffer takes its tensor. Every tensor is
    copied (the model holds nothing of a file ``snapshot`` maps); ``snapshot`` is emptied.

    Raises:
        ConfigError: ``digits`` is not 0, 1 or 2, or torch lacks the kernel.
        ModelLoadError: the snapshot does not fit the model (a missing, extra or misshapen
            tensor, or a tensor left on the meta device).
    """
    _check_kernel(digits)
    replaced = 0
    for prefix, parent in list(model.named_modules()):
        linears = {name: child for name, child in parent.named_children()
                   if type(child) is torch.nn.Linear}
        shared = int8._shared_inputs(linears, digits) if digits and linears else {}
        for name, child in linears.items():
            key = f"{prefix}.{name}" if prefix else name
            q, scale = snapshot.pop(f"{key}.qweight", None), snapshot.pop(f"{key}.scales", None)
            bias = snapshot.pop(f"{key}.bias", None)
            if q is None or scale is None or tuple(q.shape) != tuple(child.weight.shape) \
                    or (bias is None) != (child.bias is None):
                raise ModelLoadError(f"the int8 snapshot does not fit the model's layer {key!r}")
            setattr(parent, name, _layer(q, scale, bias, digits, shared.get(name)))
            replaced += 1
    if not replaced:
        raise ModelLoadError(f"{type(model).__name__} has no nn.Linear layer to rebuild")
    for name, t in snapshot.items():
        # A copy, as the layers' tensors are (stacked): nothing keeps the file's mapping,
        # whose pages would count in the process's memory beside the copies.
        t = t.clone()
        owner, _, leaf = name.rpartition(".")
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            raise ModelLoadError(f"the int8 snapshot holds {name!r}, which the model "
                                 "lacks") from None
        old = module._parameters.get(leaf)
        if old is not None:
            if tuple(old.shape) != tuple(t.shape):
                raise ModelLoadError(f"the int8 snapshot's {name!r} does not fit the model")
            module._parameters[leaf] = torch.nn.Parameter(t, requires_grad=old.requires_grad)
        elif leaf in module._buffers:
            buffer = module._buffers[leaf]
            if buffer is not None and tuple(buffer.shape) != tuple(t.shape):
                raise ModelLoadError(f"the int8 snapshot's {name!r} does not fit the model")
            module._buffers[leaf] = t
        else:
            raise ModelLoadError(f"the int8 snapshot holds {name!r}, which the model lacks")
    snapshot.clear()
    left = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers())
            if t.is_meta]
    if left:
        raise ModelLoadError(f"the int8 snapshot lacks {left[0]!r} (and {len(left) - 1} more)")
    # As quantize_linears: a tied output layer now holds its own int8 weights.
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
    return model


def write(model: torch.nn.Module, path: Path) -> None:
    """Write the snapshot of the fp32 ``model`` to ``path`` atomically (a temporary file
    beside it, fsynced and renamed; removed on any failure, a full disk or Ctrl-C
    included)."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors(model), str(tmp), metadata={"format": FORMAT})


def read(path: Path, folder: Path, digits: int) -> torch.nn.Module:
    """The model of ``folder``'s config with ``path``'s tensors, its linear layers those
    of ``digits`` activation digits (:func:`build`), in eval mode on the CPU.

    Raises:
        ModelLoadError: the file is not a snapshot of this format or does not fit.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("format") != FORMAT:
            raise ModelLoadError(f"{path} is not an {FORMAT} file")
    snapshot = load_file(str(path))
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return build(model, snapshot, digits).eval()


@functools.lru_cache(maxsize=1)
def code_key() -> str:
    """What decides a snapshot's tensors and the layers built from them besides the
    weights: the kernels' sources (the quantizers, the layers, this module), and the
    torch and transformers versions (their rounding, the GGUF's dequantisation and the
    parameters' names). 12 hex digits."""
    import transformers

    h = hashlib.blake2b(digest_size=6)
    h.update(f"{FORMAT}\0{torch.__version__}\0{transformers.__version__}\0"
             f"{activation_dtype()}\0".encode())
    h.update(code_digest(code_files(KERNELS)).encode())
    return h.hexdigest()


def snapshot_path(model: ShippedModel, files: ModelFiles) -> Path:
    """Where the snapshot of ``files`` (the converted folder of ``model``) made by this
    code lives."""
    return model.snapshot_dir / f"{folder_fingerprint(files.path)}-{code_key()}.safetensors"


def _written(model: ShippedModel) -> tuple[Path, Any, ModelFiles]:
    """Load the model in fp32 (from its GGUF: about a minute), write its snapshot and
    delete the model's other snapshots; the snapshot's path, the tokenizer, the files."""
    log.warning("writing the int8 snapshot of %s under %s (once per model and agentspec "
                "version: the fp32 weights are dequantised from the GGUF, a minute or more)",
                model.name, model.snapshot_dir)
    fp32, tok, files = load_model_and_tokenizer(model.name, "float32", "cpu")
    path = snapshot_path(model, files)
    write(fp32, path)
    del fp32
    release_freed_memory()  # the fp32 weights: gigabytes the allocator would keep
    for old in model.snapshot_dir.glob("*.safetensors"):
        if old != path:
            old.unlink(missing_ok=True)
    return path, tok, files


def load_quantized(name: str | None, digits: int) -> tuple[Any, Any, ModelFiles] | None:
    """``(model, tokenizer, files)`` of the model called ``name`` with its linear layers
    quantized to ``digits`` activation digits, from its snapshot (written first if there
    is none for these files and this code; a snapshot that cannot be read is written
    again); ``None`` for a local folder (quantized at load).

    Raises:
        ModelLoadError: the model is not installed or its files are damaged.
        ConfigError: torch lacks the int8 kernel.
    """
    model = shipped_model(EMBEDDED_MODEL if name is None else str(name))
    if model is None:
        return None
    _check_kernel(digits)  # before a snapshot is written for nothing
    files = resolve_model(model.name) if model.converted else None
    path = None if files is None else snapshot_path(model, files)
    tok = None
    if path is None or not path.is_file():
        path, tok, files = _written(model)
    assert files is not None
    try:
        lm = read(path, files.path, digits)
    except ConfigError:  # the kernel, not the file
        raise
    except Exception as exc:  # a damaged file or another format (several types raised)
        log.warning("the int8 snapshot %s cannot be used (%s: %s): writing it again", path,
                    type(exc).__name__, exc)
        path.unlink(missing_ok=True)
        path, tok, files = _written(model)
        lm = read(path, files.path, digits)
    return lm, tok if tok is not None else load_tokenizer(files), files
