"""Whether the forward running now is a shape-stable decode step.

The flag is read by the layers that pick a kernel by what kind of forward runs (attention,
the int8 layers' prompt path) and set by the forward that runs it
(:meth:`~agentspec.targets.forward.kv.ModelKV` steps). It lives below both, so the kernels
never import the forward: a :class:`~contextvars.ContextVar`, so concurrent forwards on
other threads keep their own value.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["STABLE_STEP", "stable_step"]

#: Set while a shape-stable decode forward runs: attention takes its row-invariant
#: products and the int8 layers keep their decode kernel for any row count.
STABLE_STEP: ContextVar[bool] = ContextVar("agentspec_stable_step", default=False)


@contextmanager
def stable_step() -> Iterator[None]:
    """Mark the forwards run inside the block as shape-stable decode steps."""
    token = STABLE_STEP.set(True)
    try:
        yield
    finally:
        STABLE_STEP.reset(token)
