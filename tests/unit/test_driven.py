"""``agentspec drive``: which logged turns are driven, and how the report adds up."""

from __future__ import annotations

import pytest

from agentspec.cli import console
from agentspec.errors import BenchmarkError
from agentspec.types import SessionRef
from workflows.bench.driven import driven_table, run, select_turns, summarize
from workflows.replay.logs import ReplaySession, ReplayTurn


def _session(name: str, prompt_lens: list[int]) -> ReplaySession:
    turns = [ReplayTurn(list(range(n)), [1]) for n in prompt_lens]
    return ReplaySession(name, SessionRef(name), turns)


def test_select_turns_cuts_sessions_at_the_cap_and_stops_at_the_count() -> None:
    sessions = [_session("a", [100, 200, 900, 300]), _session("b", [1000]),
                _session("c", [50, 60, 70])]
    picked = select_turns(sessions, max_prompt=600, max_tokens=64, turns=0)
    # a is cut at its 900-token turn (later turns only grow), b never fits.
    assert [(s.name, i) for s, i in picked] == [("a", 0), ("a", 1), ("c", 0), ("c", 1),
                                                ("c", 2)]
    assert len(select_turns(sessions, 600, 64, turns=3)) == 3


def _row(session: str, turn: int, prompt: int, cached: dict[str, int],
         latency: dict[str, float]) -> dict[str, object]:
    return {"session": session, "turn": turn, "prompt_tokens": prompt, "identical": True,
            "methods": {n: {"cached_tokens": c, "prefilled_tokens": prompt - c,
                            "ttft_s": latency[n] / 2, "prefill_s": latency[n] / 3,
                            "decode_tok_s": 10.0, "latency_s": latency[n], "generated": 8,
                            "forwards": 8} for n, c in cached.items()}}


def test_summary_shares_and_ratios() -> None:
    rows = [_row("a", 0, 1000, {"plain": 0, "suffix+reuse": 0},
                 {"plain": 9.0, "suffix+reuse": 9.0}),
            _row("a", 1, 1200, {"plain": 0, "suffix+reuse": 1000},
                 {"plain": 12.0, "suffix+reuse": 2.0}),
            _row("a", 2, 1300, {"plain": 0, "suffix+reuse": 1250},
                 {"plain": 12.0, "suffix+reuse": 1.0})]
    report = summarize(rows, ["plain", "suffix+reuse"], {}, {"turns": 3})
    s = report["summary"]["suffix+reuse"]
    # Later turns: (200 + 50) prefilled of 2,500 prompt tokens; the worst turn 200/1200.
    assert s["later_turns_prefilled_share"] == 0.1
    assert s["later_turns_max_prefilled_share"] == round(200 / 1200, 4)
    assert s["later_turns_over_15pct"] == 1
    assert s["cached_tokens"] == 2250 and s["mean_latency_s"] == 4.0
    assert report["latency_speedup_vs_plain"]["suffix+reuse_latency_vs_plain"] == 2.75
    # Later turns only: plain 12.0 s, suffix+reuse (2.0 + 1.0) / 2 = 1.5 s -> 8x.
    assert s["later_turns_mean_latency_s"] == 1.5
    assert report["later_turns_latency_speedup_vs_plain"]["suffix+reuse_latency_vs_plain"] == 8.0
    table = driven_table(report)
    assert "| default (suffix) | on |" in table and "2.75x" in table and "8.00x" in table
    assert report["baseline"] == "plain" and s["forwards"] == 24


def test_reuse_on_only_compares_against_plain_with_reuse() -> None:
    rows = [_row("a", 0, 1000, {"plain+reuse": 0, "suffix+reuse": 0},
                 {"plain+reuse": 9.0, "suffix+reuse": 9.0}),
            _row("a", 1, 1200, {"plain+reuse": 1000, "suffix+reuse": 1000},
                 {"plain+reuse": 6.0, "suffix+reuse": 2.0})]
    report = summarize(rows, ["plain+reuse", "suffix+reuse"], {}, {"turns": 2})
    assert report["baseline"] == "plain+reuse"
    later = report["later_turns_latency_speedup_vs_plain"]
    assert later["suffix+reuse_latency_vs_plain"] == 3.0
    assert "vs plain + reuse" in driven_table(report)


def test_bad_settings_are_refused_before_loading_a_model() -> None:
    with pytest.raises(BenchmarkError, match="prefix_cache_bytes"):
        run(prefix_cache_bytes=0)
    with pytest.raises(BenchmarkError, match="nope"):
        run(methods=["plain", "nope"])
    with pytest.raises(BenchmarkError, match="add 'plain'"):
        run(methods=["suffix", "ceiling"])


def test_drive_command_is_wired() -> None:
    args = console.build_parser().parse_args(
        ["drive", "--methods", "plain,suffix", "--turns", "31", "--max-tokens", "16",
         "--model", "qwen"])
    assert (args.command, args.turns, args.max_tokens, args.model) == ("drive", 31, 16, "qwen")


def test_logged_runs_are_driven_in_file_order_up_to_the_turn_count() -> None:
    from workflows.bench.driven import _turns
    from workflows.bench.driven_sources import logged_sessions

    a, b = _session("a", [10, 20, 30]), _session("b", [5, 6])
    sessions = logged_sessions([(a, 0), (a, 1), (b, 0), (b, 1)])
    assert [(s.name, s.turn_indices) for s in sessions] == [("a", [0, 1]), ("b", [0, 1])]
    got = [(s.name, i, len(t.prompt)) for s, i, t in _turns(list(sessions), 3, {})]
    assert got == [("a", 0, 10), ("a", 1, 20), ("b", 0, 5)]


def test_unknown_driven_workload_is_refused() -> None:
    with pytest.raises(BenchmarkError, match="unknown driven workload 'chat'"):
        run(workload="chat")
    with pytest.raises(BenchmarkError, match="reuse"):
        run(reuse="sometimes")
    args = console.build_parser().parse_args(["drive", "--workload", "tool_agent"])
    assert args.workload == "tool_agent" and args.max_prompt == 0
