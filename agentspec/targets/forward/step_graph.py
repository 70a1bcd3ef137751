"""The shape-stable decode step as a CUDA graph: one replay instead of hundreds of launches.

A small model's decode step on a GPU is bound by the host, not the device: transformers
launches a few hundred kernels per forward (SmolLM2-135M: 30 layers of norms, projections,
rotary embeddings, attention and MLP), each costing microseconds of Python and driver
time, while the kernels themselves take a fraction of that. A CUDA graph records the
launches once and replays them with one call.

A graph replays the same kernels on the same memory, so everything that varies from step
to step must live in tensors the graph reads: the token ids (``[1, rows]``) and the start
position (a 0-d tensor); positions, the mask and the key slots are computed from the start
on the device inside the graph (:meth:`agentspec.targets.forward.kv.ModelKV.stable_call`), and the
keys are written with ``index_copy_`` into the model's static KV buffers. The host-side
fill mark is advanced by the caller (a replay runs no Python).

Capture happens on the first step, right then, after two eager warm-up runs; the replay's
logits must equal the eager run's bit for bit, else (or on any capture error: an operation
that syncs with the host, a kernel that cannot be captured) the graph is dropped and steps
stay eager, with a warning: the output is the same either way, only slower.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


class StepGraph:
    """One captured decode step of ``rows`` rows over ``attend`` key positions.

    Args:
        kv: The :class:`~agentspec.targets.forward.kv.ModelKV` whose model and static KV buffers
            the step runs on (its ``stable_call`` and ``features``).
        rows: Query rows of the step (the policy's bucket).
        attend: Key positions every query attends (the static cache's length).

    Attributes:
        failed: Why the graph was dropped (``None`` while it is usable).
        replays: Steps served by the graph.
    """

    def __init__(self, kv: Any, rows: int, attend: int) -> None:
        self.kv = kv
        self.rows = rows
        self.attend = attend
        self.failed: str | None = None
        self.replays = 0
        self._graph: Any = None
        self._ids = torch.zeros(1, rows, dtype=torch.long, device=kv.device)  # [1, rows]
        self._start = torch.zeros((), dtype=torch.long, device=kv.device)
        self._out: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def _body(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step as the graph records it: every input derived from ``_ids``/``_start``
        (the eager stable step's call, keys at device-side slots)."""
        logits = self.kv.stable_call(self._ids, self._start, self.attend, device_slots=True)
        return logits, self.kv.features  # [rows, V], [1, rows, H]

    def run(self, ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The step's logits ``[rows, V]`` and features ``[1, rows, H]`` (the graph's own
        output tensors: read or copy them before the next step), or ``None`` when the
        graph is unusable (the caller runs the step eagerly)."""
        if self.failed is not None:
            return None
        self._ids.copy_(torch.tensor([ids], dtype=torch.long), non_blocking=True)
        self._start.fill_(start)
        if self._graph is None:
            return self._capture()
        self._graph.replay()
        self.replays += 1
        assert self._out is not None
        return self._out

    def _capture(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Warm up, capture, replay once and check the replay against the eager run (the
        same keys are written at the same slots each time: repeating the step is
        harmless)."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    eager, _feat = self._body()
                    eager = eager.clone()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._body()
            graph.replay()
            if not torch.equal(out[0], eager):
                self.failed = "a replay's logits differ from the eager step's"
            else:
                self._graph, self._out = graph, out
                self.replays += 1
                return out
        except Exception as exc:  # any capture failure: the step stays eager
            self.failed = f"{type(exc).__name__}: {exc}"
        log.warning("CUDA graph of the decode step dropped (%s); decoding stays eager",
                    self.failed)
        self.kv.plan.clear()
        return None
