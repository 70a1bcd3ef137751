"""The workloads by name: ``agentspec bench --workloads NAME`` and every other runner load
them through :func:`load_workload`."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from agentspec.errors import BenchmarkError
from workflows.workloads.base import Workload

__all__ = ["WORKLOADS", "load_workload"]

# name -> "module:Class"; imported lazily so a missing optional workload fails alone.
WORKLOADS: dict[str, str] = {
    "smoke": "workflows.workloads.smoke:SmokeWorkload",
    "delegate52": "workflows.workloads.delegate52:Delegate52Workload",
    "editeval": "workflows.workloads.instructedit:InstructEditWorkload",
    "tool_agent": "workflows.workloads.tool_agent:ToolAgentWorkload",
    "chat": "workflows.workloads.open_chat:ChatWorkload",
}


def load_workload(name: str, data_dir: str | None, **options: Any) -> Workload:
    """Instantiate workload ``name``.

    Args:
        name: A key of :data:`WORKLOADS`.
        data_dir: Data folder for the workloads that read files.
        **options: Workload-specific keyword arguments (e.g. ``prompt_style`` of
            ``delegate52``), passed only to the workloads that accept them.

    Raises:
        BenchmarkError: unknown workload.
    """
    if name not in WORKLOADS:
        raise BenchmarkError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    module, cls = WORKLOADS[name].split(":")
    factory: Callable[..., Workload] = getattr(importlib.import_module(module), cls)
    params = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in {"data_dir": data_dir, **options}.items() if k in params}
    return factory(**kwargs)
