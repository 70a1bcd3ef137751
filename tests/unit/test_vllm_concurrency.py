"""``workflows.bench.vllm --concurrency``: the scheduler (on a fake engine) and proposer timing."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from adapters.vllm.request_ids import decode_request_id
from agentspec.errors import ConfigError
from agentspec.types import SessionRef
from tests.unit.test_vllm_adapter import PROMPT, FakeModelRunner
from workflows.bench.vllm import build_parser
from workflows.bench.vllm_concurrency import run_concurrent


class FakeEngine:
    """Finishes each request after ``len(prompt) % 3 + 2`` steps with a fixed answer."""

    def __init__(self) -> None:
        self.live: dict[str, list[Any]] = {}  # id -> [steps left, prompt]
        self.max_live = 0
        self.order: list[str] = []

    def add_request(self, rid: str, inputs: dict[str, list[int]], params: Any) -> None:
        assert rid not in self.live
        prompt = inputs["prompt_token_ids"]
        self.live[rid] = [len(prompt) % 3 + 2, prompt, params]
        self.max_live = max(self.max_live, len(self.live))

    def step(self) -> list[Any]:
        outs = []
        for rid in list(self.live):
            rec = self.live[rid]
            rec[0] -= 1
            done = rec[0] == 0
            toks = [len(rec[1]), 7] if done else []
            outs.append(SimpleNamespace(request_id=rid, finished=done, outputs=[
                SimpleNamespace(text=f"out{len(rec[1])}", token_ids=toks)]))
            if done:
                del self.live[rid]
                self.order.append(rid)
        return outs


class FakeRuntime:
    def __init__(self) -> None:
        self.engine = FakeEngine()

    def prompt_ids(self, messages: list[dict[str, str]], tools: Any, choice: Any,
                   prefix: str) -> tuple[list[int], str]:
        return [ord(c) for m in messages for c in m["content"]], prefix


class FakeSession:
    """Two turns; the second prompt holds the first answer."""

    def __init__(self, name: str) -> None:
        self.name, self.seen = name, []  # type: list[str | None]

    def next_request(self, last: str | None) -> Any:
        self.seen.append(last)
        if len(self.seen) > 2:
            return None
        content = self.name + (last or "")
        return SimpleNamespace(messages=[{"role": "user", "content": content}], tools=None,
                               stop=["\n\n"], max_tokens=50, prefix="")


def test_scheduler_keeps_n_sessions_in_flight_and_turns_in_order() -> None:
    rt = FakeRuntime()
    sessions = [FakeSession(f"s{i}" * (i + 1)) for i in range(5)]
    jobs = [("wl", SessionRef(f"s{i}", tenant="t"), s) for i, s in enumerate(sessions)]
    seen_params = []
    run = run_concurrent(rt, jobs, 3, 20, lambda n, stop: seen_params.append((n, stop)))
    assert rt.engine.max_live == run.max_in_flight == 3
    assert len(run.turns) == 10 and len(run.step_s) >= 4
    for i, s in enumerate(sessions):
        # Each session: its first turn, then its second turn with the first answer.
        assert s.seen[0] is None and s.seen[1].startswith("out") and s.seen[2] is not None
        mine = [t for t in run.turns if t["session_id"] == f"s{i}"]
        assert [t["turn"] for t in mine] == [1, 2]
    assert all(decode_request_id(r) is not None for r in rt.engine.order)
    assert seen_params[0] == (20, ["\n\n"])  # the budget is capped
    assert run.summary()["tokens"] == 20


def test_scheduler_rejects_zero_concurrency() -> None:
    with pytest.raises(ConfigError, match="0"):
        run_concurrent(FakeRuntime(), [], 0, 10, lambda n, s: None)


def test_bench_vllm_parses_concurrency() -> None:
    assert build_parser().parse_args(["--concurrency", "4"]).concurrency == 4


def test_proposer_reports_its_time_per_step(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "stats.json"
    monkeypatch.setenv("AGENTSPEC_VLLM_STATS", str(path))
    runner = FakeModelRunner()
    runner.start(0, "a", PROMPT + PROMPT[:3])
    runner.start(1, "b", PROMPT)
    runner.step({0: [PROMPT[3]], 1: [PROMPT[0]]})
    runner.drafter.finish_all()
    stats = json.loads(path.read_text())
    assert stats["calls"] == 1 and stats["max_rows"] == 2
    assert stats["propose_ms_per_step"] > 0 and stats["finished"] == 0
    assert np.isclose(stats["propose_ms_per_step"], 1e3 * stats["propose_s"])
