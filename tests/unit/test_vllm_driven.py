"""``workflows.bench.vllm --workloads traces``: logged agent runs as driven sessions on the
concurrency scheduler (fake engine, no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from adapters.vllm.request_ids import decode_request_id
from agentspec.errors import BenchmarkError
from agentspec.types import SessionRef
from tests.unit.test_replay import CharTokenizer
from tests.unit.test_vllm_concurrency import FakeEngine
from workflows.bench.vllm import build_parser
from workflows.bench.vllm_concurrency import run_concurrent
from workflows.bench.vllm_driven import (
    LoggedSession,
    draftable_content,
    driven_jobs,
    driven_sessions,
)
from workflows.replay.logs import ReplaySession, ReplayTurn


class RecordingEngine(FakeEngine):
    """Records every prompt sent and checks one request per session in the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, list[int]]] = []  # (session id, prompt)

    def add_request(self, rid: str, inputs: dict[str, list[int]], params: Any) -> None:
        ref = decode_request_id(rid)
        assert ref is not None
        live = {decode_request_id(r).session_id for r in self.live}  # type: ignore[union-attr]
        assert ref.session_id not in live, f"two requests of {ref.session_id} in flight"
        self.sent.append((ref.session_id, list(inputs["prompt_token_ids"])))
        super().add_request(rid, inputs, params)


class TokenRuntime:
    """A runtime whose chat rendering must not be used: logged turns carry token ids."""

    def __init__(self) -> None:
        self.engine = RecordingEngine()

    def prompt_ids(self, *args: Any) -> tuple[list[int], str]:
        raise AssertionError("a logged turn's prompt was re-rendered")


def _runs(path: Path, lengths: list[int]) -> Path:
    """One JSONL run per entry: ``n`` assistant turns after a task, each with a tool result."""
    lines = []
    for k, n in enumerate(lengths):
        msgs: list[dict[str, Any]] = [{"role": "system", "content": f"agent {k}"},
                                      {"role": "user", "content": f"task {k}"}]
        for t in range(n):
            msgs += [{"role": "assistant", "content": f"step {t} of run {k}"},
                     {"role": "user", "content": f"observation {t}" + "." * 20 * t}]
        lines.append(json.dumps({"messages": msgs[:-1], "session": f"run-{k}"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_driven_sessions_send_the_logged_prompts_one_per_session_n_at_once(
        tmp_path: Path) -> None:
    traces = _runs(tmp_path / "runs.jsonl", [3, 2, 4, 1, 2, 3])
    chains = driven_sessions(CharTokenizer(), [traces], max_prompt=400, max_tokens=16,
                             turns=0)
    rt = TokenRuntime()
    jobs = driven_jobs(chains, "bench-x")
    assert [ref.session_id for _, ref, _ in jobs] == [f"run-{k}" for k in range(6)]
    assert all(ref.tenant == "bench-x" for _, ref, _ in jobs)
    budgets: list[int] = []
    run = run_concurrent(rt, jobs, 3, 64, lambda n, stop: budgets.append(n))
    # Concurrency: three sessions in the engine at once, never more.
    assert rt.engine.max_live == run.max_in_flight == 3
    # Each session's prompts, in order, are its logged turn prompts (token ids as logged).
    for chain in chains:
        sid = chain.session.ref.session_id
        mine = [p for s, p in rt.engine.sent if s == sid]
        assert mine == [chain.session.turns[i].prompt for i in chain.turn_indices]
        assert [t["turn"] for t in run.turns if t["session_id"] == sid] == list(
            range(1, len(chain.turn_indices) + 1))
    # Sessions start in file order.
    first_seen = list(dict.fromkeys(s for s, _ in rt.engine.sent))
    assert first_seen == [f"run-{k}" for k in range(6)]
    assert budgets == [16] * len(rt.engine.sent)  # the drive's answer budget, under the cap
    # launched_after: a turn is sent after its session's previous turn finished.
    for t in run.turns:
        earlier = run.turns[: t["launched_after"]]
        assert sum(e["session_id"] == t["session_id"] for e in earlier) == t["turn"] - 1


def test_driven_sessions_cut_at_max_prompt_and_the_turn_cap(tmp_path: Path) -> None:
    traces = _runs(tmp_path / "runs.jsonl", [4, 4])
    full = driven_sessions(CharTokenizer(), [traces], 10_000, 16, 0)
    assert [c.turn_indices for c in full] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    cap = len(full[0].session.turns[2].prompt) + 16 - 1  # turn 2 no longer fits
    cut = driven_sessions(CharTokenizer(), [traces], cap, 16, 0)
    assert [c.turn_indices for c in cut] == [[0, 1], [0, 1]]
    assert [c.turn_indices for c in driven_sessions(CharTokenizer(), [traces], cap, 16, 3)] \
        == [[0, 1], [0]]
    with pytest.raises(BenchmarkError, match="max_prompt=10"):
        driven_sessions(CharTokenizer(), [traces], 10, 16, 0)


def test_a_logged_session_ignores_the_answer() -> None:
    sess = ReplaySession("a", SessionRef("a"),
                         [ReplayTurn([1, 2], [9]), ReplayTurn([1, 2, 3], [9])])
    chain = LoggedSession(sess, [0, 1], 8)
    first = chain.next_request(None)
    second = chain.next_request("whatever the model said")
    assert first is not None and second is not None
    assert (first.prompt_ids, second.prompt_ids, second.max_tokens) == ([1, 2], [1, 2, 3], 8)
    assert chain.next_request("x") is None


def test_draftable_content_names_where_answer_tokens_can_come_from() -> None:
    # Session b's answer copies text that only a's prompt holds; a's answer copies its own.
    a = ReplaySession("a", SessionRef("a"), [ReplayTurn([10, 11, 12, 13, 20, 21, 22, 23], [])])
    b = ReplaySession("b", SessionRef("b"), [ReplayTurn([50, 51, 52, 53], [])])
    chains = [LoggedSession(a, [0], 8), LoggedSession(b, [0], 8)]
    turns = [{"session_id": "a", "turn": 1, "tokens": [10, 11], "launched_after": 0},
             {"session_id": "b", "turn": 1, "tokens": [20, 21, 22, 23], "launched_after": 1}]
    got = draftable_content(chains, turns, n=1)
    # a: 53->... no; a's answer: (23,10) is new, (10,11) is in its own prompt.
    # b: (53,20) new, (20,21) (21,22) (22,23) only in a's prompt.
    assert got["answer_tokens"] == 6
    assert (got["own_tokens"], got["other_prompts_tokens"], got["none_tokens"]) == (1, 3, 2)
    # Launched before a finished, b could draft from nothing but itself.
    turns[1]["launched_after"] = 0
    assert draftable_content(chains, turns, n=1)["other_prompts_tokens"] == 0
    # Once a's answer is known it counts as an earlier answer first.
    turns[0]["tokens"] = [20, 21]
    turns[1]["launched_after"] = 1
    assert draftable_content(chains, turns, n=1)["earlier_answers_tokens"] == 1


def test_bench_parser_takes_the_drive_selection() -> None:
    args = build_parser().parse_args(["--workloads", "traces", "--max-prompt", "4096",
                                      "--trace-turns", "12"])
    assert (args.workloads, args.max_prompt, args.trace_turns) == ("traces", 4096, 12)
    default = build_parser().parse_args([])
    assert (default.max_prompt, default.trace_turns) == (2560, 30)
    assert Path(default.traces[0]).is_dir()

