"""Load-time probe results, kept per model, precision and machine so a second load skips
the probes.

Why. On the CPU a quantized or bf16 target probes its own kernels when it loads: from how
many rows a row's product stops depending on the row count
(:func:`~agentspec.targets.forward.shapes.invariant_rows`), whether the products' bits depend on
the thread count (:func:`~agentspec.targets.forward.shapes.thread_invariant`), whether decode
attention's rows depend on either (:func:`~agentspec.targets.forward.shapes.attention_invariant`),
and up to how many rows a prompt's forwards do not
(:func:`~agentspec.targets.forward.shapes.prompt_thread_rows`). Together
they take about 10 s of a 17 s Qwen2.5-Coder-0.5B int8 load on a 2-core machine, at every
start of a server, a LangChain model or a CLI command, and their answers change only with
the weights, the precision, the kernels and the machine.

What a result is keyed by. Each answer decides an exactness guarantee (a wrong "invariant
from one row" would let speculation change an answer), so the key is stricter than the
cost curves' (:func:`~agentspec.targets.cost.cost_meter.cost_key`: the model's name and
weights, the precision, the device, the machine's architecture, core and thread counts):
it adds every buffer of the model (quantized layers keep their int8 weights as buffers,
not parameters), the torch version and build, the CPU's vector capability as torch
dispatches it, the CPU's model name and the source of the modules whose code the probes
exercise. A new torch, another CPU, other weights or changed kernels get their own file
and run the probes again.

Files. One JSON file per key under ``$AGENTSPEC_HOME/probes``, written atomically; a
corrupt, partial or unwritable file costs a probe run, never an error and never a wrong
value (a value of the wrong type is probed again). Two processes loading one model at
once may both probe, and the file keeps the last writer's entries: a later load may probe
again, never read another key's answer.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from agentspec.models import agentspec_home
from agentspec.targets.base.cpu import cpuinfo
from agentspec.targets.base.files import read_json, write_json
from agentspec.targets.base.fingerprint import forward_code, hash_tensors
from agentspec.targets.kernels import native

__all__ = ["ProbeCache", "is_bool", "is_row_limit", "is_rows", "probe_key", "probed"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Bumped when a probe's meaning changes (its inputs, lengths or tolerance), so results of
#: the old probe are not read as the new one's.
PROBE_VERSION = 2

_DIGITS = 10  # digest bytes of the extra key (20 hex digits)


def probe_key(cost_file_key: str, model: Any) -> str:
    """The probe file's name: the cost file's key (model, precision, device, machine) and a
    digest of the model's buffers, the torch build and the CPU (module doc).

    Args:
        cost_file_key: :func:`~agentspec.targets.cost.cost_meter.cost_key` of the target.
        model: The model as it runs (after quantization).
    """
    h = hashlib.blake2b(f"agentspec-probes-v{PROBE_VERSION}\0".encode(), digest_size=_DIGITS)
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    h.update(f"{torch.__version__}\0{torch.version.git_version}\0{capability}\0"
             f"{cpuinfo('model name') or platform.processor()}\0".encode())
    h.update(forward_code().encode())  # the kernels and forwards the probes exercise
    # Which native library runs them (none: the torch fallbacks, whose bits may depend on
    # the shapes where the library's do not).
    lib = native.library()
    h.update(f"{'' if lib is None else lib._name}\0".encode())
    if isinstance(model, torch.nn.Module):  # int8 layers keep their weights here
        hash_tensors(h, model.named_buffers())
    return f"{cost_file_key}-{h.hexdigest()}"


class ProbeCache:
    """The stored probe results of one target.

    Args:
        key: The file's name (:func:`probe_key`).
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.hits = 0  # results read from the file (reports and tests)

    @property
    def path(self) -> Path:
        """The probe file (``AGENTSPEC_HOME`` is read at each use)."""
        return agentspec_home() / "probes" / f"{self.key}.json"

    def value(self, name: str, probe: Callable[[], T], valid: Callable[[Any], bool]) -> T:
        """Probe ``name``'s stored result, or run ``probe()`` and store what it returns.

        Args:
            name: The probe's name (one entry of the file).
            probe: Runs the probe.
            valid: Whether a stored value has the probe's type (else it is probed again).
        """
        data = read_json(self.path)
        results = data.get("results")
        if isinstance(results, dict) and name in results and valid(results[name]):
            self.hits += 1
            return results[name]
        result = probe()
        data = read_json(self.path)  # another process may have stored other probes
        stored = data.get("results")
        merged = {**(stored if isinstance(stored, dict) else {}), name: result}
        try:
            write_json(self.path, {"version": PROBE_VERSION, "results": merged})
        except OSError as exc:  # a full or read-only disk: the next load probes again
            log.warning("could not store probe results in %s: %s", self.path, exc)
        return result


def is_bool(value: Any) -> bool:
    """A stored boolean probe result."""
    return isinstance(value, bool)


def is_rows(value: Any) -> bool:
    """A stored :func:`~agentspec.targets.forward.shapes.invariant_rows` result: a row count >= 1,
    or ``None`` (no row count tried gives invariant rows)."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool)
                             and value >= 1)


def is_row_limit(value: Any) -> bool:
    """A stored :func:`~agentspec.targets.forward.shapes.prompt_thread_rows` result: a row count
    >= 0, or ``None`` (any row count)."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool)
                             and value >= 0)


def probed(cache: ProbeCache | None, name: str, probe: Callable[[], T],
           valid: Callable[[Any], bool]) -> T:
    """``cache.value(name, probe, valid)``, or ``probe()`` where nothing is kept."""
    return probe() if cache is None else cache.value(name, probe, valid)
