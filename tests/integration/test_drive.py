"""``agentspec drive`` end to end on the embedded model: the logged runs and the live tool
agent, every variant's output identical, reuse reading what the session already sent."""

from __future__ import annotations

import pytest

from agentspec.errors import BenchmarkError
from agentspec.targets.hf import HFTarget
from workflows.bench.driven import run


def test_logged_runs_reuse_their_history_with_identical_output(
        embedded_target: HFTarget) -> None:
    report = run(["plain", "suffix"], max_tokens=6, max_prompt=1400, turns=2,
                 target=embedded_target, progress=False)
    rows = report["rows"]
    assert [(r["session"], r["turn"]) for r in rows] == [(rows[0]["session"], 0),
                                                       (rows[0]["session"], 1)]
    assert report["all_identical"]
    second = rows[1]
    for name in ("plain+reuse", "suffix+reuse"):
        # The second turn re-sends the first prompt: all of it is read from KV.
        assert second["methods"][name]["cached_tokens"] >= rows[0]["prompt_tokens"] - 1
    for name in ("plain", "suffix"):
        assert second["methods"][name]["cached_tokens"] == 0
    assert report["settings"]["max_prompt"] == 1400
    for r in rows:
        for name, m in r["methods"].items():
            assert m["accepted_tokens"] <= m["draft_tokens"]
            # Each forward commits its accepted draft tokens plus one of its own (the last
            # may be cut by max_tokens).
            assert m["generated"] <= m["forwards"] + m["accepted_tokens"]
            if name.startswith("plain"):
                assert m["draft_tokens"] == 0 and m["forwards"] == m["generated"]


def test_the_copy_ceiling_drafts_only_what_it_copies(embedded_target: HFTarget) -> None:
    """The ceiling copies plain's answer where the tenant's text holds it: every draft
    token is accepted, it takes no more forwards than the default, output identical."""
    report = run(["plain", "suffix", "ceiling"], max_tokens=24, max_prompt=1400, turns=2,
                 target=embedded_target, progress=False, reuse="on")
    assert report["all_identical"]
    for r in report["rows"]:
        ceiling = r["methods"]["ceiling+reuse"]
        assert ceiling["accepted_tokens"] == ceiling["draft_tokens"]
        assert ceiling["forwards"] <= r["methods"]["plain+reuse"]["forwards"]
    total = {n: sum(r["methods"][n]["forwards"] for r in report["rows"])
             for n in ("ceiling+reuse", "suffix+reuse")}
    assert total["ceiling+reuse"] <= total["suffix+reuse"]


def test_the_live_tool_agent_reuses_the_models_own_answers(embedded_target: HFTarget) -> None:
    report = run(["plain", "suffix"], max_tokens=12, turns=3, workload="tool_agent",
                 target=embedded_target, progress=False)
    rows = report["rows"]
    assert len(rows) == 3 and report["all_identical"]
    assert report["settings"]["max_prompt"] == embedded_target.max_positions
    later = [r for r in rows if r["turn"] > 0]
    assert later, "the first tool-agent session has more than one turn"
    for r in later:
        prev = rows[rows.index(r) - 1]
        # The earlier prompt (system prompt, tool schemas, task) is reused at least.
        assert r["methods"]["suffix+reuse"]["cached_tokens"] >= prev["prompt_tokens"] - 16
    # Sessions of one agent share the system prompt and tool schemas across sessions too:
    # a new session's first turn reads them from the tenant's prefix store.
    firsts = [r for r in rows if r["turn"] == 0]
    for r in firsts[1:]:
        assert r["methods"]["plain+reuse"]["cached_tokens"] > 0


def test_unknown_methods_are_refused_before_any_turn(embedded_target: HFTarget) -> None:
    with pytest.raises(BenchmarkError, match="suffix_chain"):  # the message lists them
        run(["plain", "nope"], target=embedded_target, progress=False)
