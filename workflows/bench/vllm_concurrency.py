"""N agent sessions in flight at once on one vLLM engine
(``python -m workflows.bench.vllm --concurrency N``).

An agent session is a chain: turn t+1's prompt holds turn t's answer, so a session has at
most one request in flight. :func:`run_concurrent` keeps ``concurrency`` sessions in the
engine at once: whenever a request finishes, the same session's next turn is added, and
when a session has no turn left, the next waiting session starts. Each engine step is
timed; the proposer's own time per step comes from the proposer (it runs in vLLM's worker
process and writes its counters to ``AGENTSPEC_VLLM_STATS``, see
:mod:`adapters.vllm.proposer`).

A request that carries its prompt as token ids (``prompt_ids``, e.g. a logged agent turn,
:mod:`workflows.bench.vllm_driven`) is sent as it is; others are rendered with the
runtime's chat template. The engine is driven through four calls only (``prompt_ids`` and
``sampling`` of the runtime, ``add_request`` and ``step`` of its engine), so the scheduler
is tested with a fake engine.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from adapters.vllm.cache_salt import engine_prompt
from adapters.vllm.request_ids import encode_request_id
from agentspec.errors import ConfigError
from agentspec.types import SessionRef


@dataclass
class _Flight:
    ref: SessionRef
    session: Any
    turn: int
    prefix: str
    prompt_tokens: int
    start: float
    launched_after: int


@dataclass
class ConcurrentRun:
    """What :func:`run_concurrent` measured.

    Attributes:
        turns: One record per finished request (workload, session, turn, tokens, ...).
        step_s: Wall-clock seconds of every engine step.
        max_in_flight: Most requests in the engine at once.
    """

    turns: list[dict[str, Any]] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    max_in_flight: int = 0

    def step_ms(self, q: float) -> float:
        """A quantile of the engine step time, in milliseconds."""
        if not self.step_s:
            return 0.0
        s = sorted(self.step_s)
        return 1e3 * s[min(len(s) - 1, int(q * len(s)))]

    def summary(self) -> dict[str, Any]:
        """Steps, tokens and step-time quantiles."""
        return {"engine_steps": len(self.step_s), "max_in_flight": self.max_in_flight,
                "tokens": sum(len(t["tokens"]) for t in self.turns),
                "step_ms_p50": round(self.step_ms(0.5), 3),
                "step_ms_p95": round(self.step_ms(0.95), 3),
                "step_ms_mean": round(1e3 * statistics.fmean(self.step_s), 3)
                if self.step_s else 0.0}


def run_concurrent(
    rt: Any,
    sessions: Sequence[tuple[str, SessionRef, Any]],
    concurrency: int,
    max_tokens: int,
    sampling: Callable[[int, Sequence[str]], Any],
) -> ConcurrentRun:
    """Replay workload sessions with ``concurrency`` of them in flight at once.

    Args:
        rt: The vLLM runtime (``prompt_ids(messages, tools, tool_choice, prefix)`` and
            ``engine`` with ``add_request(id, inputs, params)`` / ``step()``).
        sessions: ``(workload name, session ref, workload session)``; a workload session's
            ``next_request(last_text)`` returns the next request or ``None``. A request
            with a ``prompt_ids`` attribute (not ``None``) is sent with those token ids.
        concurrency: Sessions in flight at once (>= 1).
        max_tokens: Cap on every request's token budget.
        sampling: ``(max_tokens, stop strings) -> engine sampling params``.

    Raises:
        ConfigError: ``concurrency < 1``.
    """
    if concurrency < 1:
        raise ConfigError(f"concurrency must be >= 1, got {concurrency}")
    waiting = deque(sessions)
    flying: dict[str, tuple[str, _Flight]] = {}
    run = ConcurrentRun()

    def launch(workload: str, ref: SessionRef, sess: Any, last: str | None, turn: int) -> bool:
        req = sess.next_request(last)
        if req is None:
            return False
        prefix = getattr(req, "prefix", "")
        prompt = getattr(req, "prompt_ids", None)
        if prompt is None:
            prompt, prefix = rt.prompt_ids(req.messages, req.tools, None, prefix)
        stop = [*req.stop, *rt.tool_format.stop] if req.tools else list(req.stop)
        rid = encode_request_id(ref)
        rt.engine.add_request(rid, engine_prompt(prompt, ref),
                              sampling(min(req.max_tokens, max_tokens), stop))
        flying[rid] = (workload, _Flight(ref, sess, turn + 1, prefix, len(prompt),
                                         time.perf_counter(), len(run.turns)))
        return True

    while waiting or flying:
        while waiting and len(flying) < concurrency:
            workload, ref, sess = waiting.popleft()
            launch(workload, ref, sess, None, 0)
        if not flying:
            break
        run.max_in_flight = max(run.max_in_flight, len(flying))
        t0 = time.perf_counter()
        outputs = rt.engine.step()
        run.step_s.append(time.perf_counter() - t0)
        for out in outputs:
            if not out.finished or out.request_id not in flying:
                continue
            workload, f = flying.pop(out.request_id)
            final = out.outputs[0]
            run.turns.append({
                "workload": workload, "session_id": f.ref.session_id, "turn": f.turn,
                "prompt_tokens": f.prompt_tokens, "tokens": [int(t) for t in final.token_ids],
                "seconds": time.perf_counter() - f.start,
                "launched_after": f.launched_after,  # turns finished when it was sent
            })
            launch(workload, f.ref, f.session, f.prefix + str(final.text), f.turn)
    return run
