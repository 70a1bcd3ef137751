"""``agentspec replay``: log loading, error messages, and the replay's bounds."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from agentspec.cli import main
from agentspec.types import SessionRef
from workflows.replay import runner as replay
from workflows.replay.logs import (
    PACKAGED_TRACES,
    ReplaySession,
    ReplayTurn,
    TraceFormatError,
    load_sessions,
)
from workflows.replay.runner import accepted, replay_sessions

END = 3  # the fake tokenizer's end-of-turn token


class CharTokenizer:
    """A ChatML-like template over characters (one token per character)."""

    eos_token_id = END
    unk_token_id = 0

    def apply_chat_template(self, turns: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        text = "".join(f"<{t['role']}>\n{t['content']}\x03\n" for t in turns)
        return text + ("<assistant>\n" if add_generation_prompt else "")

    def convert_tokens_to_ids(self, token: str) -> int:
        return 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def _traj(path: Path, history: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"history": history}, indent=1))
    return path


HISTORY = [
    {"role": "system", "content": "You edit files."},
    {"role": "user", "content": "Fix the bug in a.py"},
    {"role": "assistant", "content": "open a.py", "tool_calls":
        "[{'function': {'arguments': '{\"path\": \"a.py\"}', 'name': 'open'}, 'id': 'c1'}]"},
    {"role": "tool", "content": "def f():\n    return 1\n"},
    {"role": "assistant", "content": "edit a.py: def f():\n    return 2\n"},
]


def test_traj_and_jsonl_render_every_assistant_turn(tmp_path: Path) -> None:
    tok = CharTokenizer()
    traj = _traj(tmp_path / "run.traj", HISTORY)
    row = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"function": {"name": "ls", "arguments": {"dir": "."}}}]},
                        {"role": "tool", "content": "a.py"},
                        {"role": "assistant", "content": "done"}],
           "session": "run-7", "agent": "coder", "tenant": "acme"}
    jsonl = tmp_path / "logs.jsonl"
    jsonl.write_text(json.dumps(row) + "\n\n" + json.dumps(row["messages"]) + "\n")
    sessions = load_sessions([traj, jsonl], tok)
    assert [len(s.turns) for s in sessions] == [2, 2, 2]
    first = sessions[0].turns[0]
    text = "".join(map(chr, first.output))
    assert text.startswith("open a.py<tool_call>") and first.output[-1] == END
    assert "".join(map(chr, first.prompt)).endswith("Fix the bug in a.py\x03\n<assistant>\n")
    assert sessions[1].ref == SessionRef("run-7", tenant="acme", agent="coder")
    assert sessions[2].ref.tenant == "default"
    # The second turn's prompt holds the first answer and the tool result.
    assert "<tool_response>" in "".join(map(chr, sessions[0].turns[1].prompt))


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("bad.traj", '{"history": [\n{"role": "user",\n "content": }]}', "bad.traj:3"),
        ("bad.traj", '{"trajectory": []}', "bad.traj:1"),
        ("bad.jsonl", '[{"role": "user", "content": "a"}]\n{"messages": 5}\n', "bad.jsonl:2"),
        ("bad.jsonl", '[{"role": "user", "content": "a"}]\nnot json\n', "bad.jsonl:2"),
        ("bad.jsonl", '[{"role": "robot", "content": "a"}]\n', "bad.jsonl:1"),
        ("bad.jsonl", '[{"role": "user", "content": 5}]\n', "bad.jsonl:1: message 0"),
    ],
)
def test_malformed_logs_name_file_and_line(tmp_path: Path, name: str, text: str,
                                           where: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(TraceFormatError, match=where):
        load_sessions([tmp_path / name], CharTokenizer())


def test_cli_reports_a_malformed_file_without_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(replay, "load_tokenizer", lambda model: CharTokenizer())
    bad = tmp_path / "x.jsonl"
    bad.write_text("[]\n")
    assert main(["replay", str(bad), "--no-costs", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "x.jsonl:1" in err and "Traceback" not in err
    assert main(["replay", str(tmp_path / "missing"), "--no-costs"]) == 2
    assert main(["replay", "--methods", "magic", "--no-costs"]) == 2


def _sessions() -> list[ReplaySession]:
    doc = list(range(100, 400))
    ref = SessionRef("s1")
    turns = [ReplayTurn([1, *doc[:150], 2], [*doc[:150], END]),
             ReplayTurn([1, *doc[:150], 2, *doc[:150], END, 5], [*doc[150:], END]),
             ReplayTurn([7, 8], [*doc[150:], END])]
    return [ReplaySession("s1", ref, turns), ReplaySession("s2", SessionRef("s2"), turns[2:])]


def test_oracle_is_the_upper_bound_and_none_is_one() -> None:
    sessions = _sessions()
    k = 16
    rows = {r["method"]: r for r in replay_sessions(
        sessions, ["oracle", "none", "agentspec", "suffix", "prompt_lookup", "suffix_chain"], k,
        cost=lambda n: 0.05 + 0.001 * n)}
    lengths = [len(t.output) for s in sessions for t in s.turns]
    tokens = sum(lengths)
    oracle, none = rows["oracle"], rows["none"]
    assert oracle["tokens"] == none["tokens"] == tokens
    assert oracle["steps"] == sum(math.ceil(n / (k + 1)) for n in lengths)
    assert none["steps"] == tokens and none["mean_accepted_len"] == 1.0
    assert none["est_speedup"] == 1.0 and none["drafted_per_token"] == 0.0
    assert oracle["draft_acceptance"] == 1.0
    for r in rows.values():
        assert r["tokens"] == tokens and r["turns"] == 4 and r["sessions"] == 2
        assert 1.0 <= r["mean_accepted_len"] <= oracle["mean_accepted_len"]
    # The copy-heavy turns are drafted from the request and the history.
    assert rows["agentspec"]["mean_accepted_len"] > 3 > rows["prompt_lookup"]["mean_accepted_len"]


def test_copy_ceiling_bounds_every_cache_drafter() -> None:
    # No cache drafter drafts text its indexes do not hold, and from any position the
    # ceiling jumps as far as any copy can (a copy's suffix is a copy): fewest steps.
    sessions = _sessions()
    rows = {r["method"]: r for r in replay_sessions(
        sessions, ["ceiling_tenant", "ceiling_session", "agentspec", "suffix",
                   "suffix_chain", "prompt_lookup", "none"], 16)}
    top = rows["ceiling_tenant"]
    assert top["ceiling_share"] == 1.0 and top["draft_acceptance"] == 1.0
    for name, r in rows.items():
        assert r["steps"] >= top["steps"], name
        assert r["ceiling_share"] == pytest.approx(r["mean_accepted_len"] /
                                                   top["mean_accepted_len"], abs=1e-3)
    # s2's only turn copies s1's last answer: another session's text, so only the tenant
    # ceiling (and the tenant-scoped default) can copy it.
    assert rows["ceiling_session"]["steps"] > top["steps"]


def test_matched_ceiling_lies_between_the_drafters_and_the_ceiling() -> None:
    # A copy that must follow k matched context tokens is a copy: at most the ceiling; with
    # more context demanded, fewer copies qualify.
    sessions = _sessions()
    rows = {r["method"]: r for r in replay_sessions(
        sessions, ["ceiling_tenant", "ceiling_match1", "ceiling_match2", "ceiling_match8",
                   "none"], 16)}
    top, m1, m2, m8 = (rows[m]["steps"] for m in ("ceiling_tenant", "ceiling_match1",
                                                  "ceiling_match2", "ceiling_match8"))
    assert top <= m1 <= m2 <= m8 < rows["none"]["steps"]
    assert rows["ceiling_match2"]["draft_acceptance"] == 1.0


def test_matched_ceiling_needs_the_matched_context() -> None:
    from agentspec.errors import ConfigError
    from agentspec.types import DraftContext
    from workflows.replay.ceiling import MatchedCopyCeilingDrafter
    from workflows.replay.runner import check_method

    ceiling = MatchedCopyCeilingDrafter(2)
    prompt, answer = [7, 1, 2, 3, 4, 8, 5, 2, 9], [3, 4, 6]
    ceiling.add(prompt, answer)
    ctx = DraftContext(prompt, len(prompt), session=SessionRef("s"))
    # "3 4" follows "1 2" in the prompt, but the context ends "5 2 9": no two-token match.
    assert ceiling.propose(ctx, 8).tokens == []
    one = MatchedCopyCeilingDrafter(1)
    one.add([*prompt[:-1]], answer)
    ctx = DraftContext(prompt[:-1], len(prompt) - 1, session=SessionRef("s"))
    assert one.propose(ctx, 8).tokens == [3, 4]  # "2" is followed by "3 4" once
    with pytest.raises(ConfigError, match="k must be"):
        MatchedCopyCeilingDrafter(0)
    for bad in ("ceiling_match0", "ceiling_matchx", "ceiling_galaxy"):
        with pytest.raises(ConfigError, match=bad):
            check_method(bad)


def test_copy_ceiling_drafts_the_longest_copy_of_the_answer() -> None:
    from agentspec.errors import ConfigError
    from agentspec.types import DraftContext
    from workflows.replay.ceiling import CopyCeilingDrafter

    ceiling = CopyCeilingDrafter("session")
    prompt, answer = [1, 2, 3, 4, 5, 9], [3, 4, 5, 6, 2, 3]
    ceiling.add(prompt, answer)
    ctx = DraftContext(prompt, len(prompt), session=SessionRef("s"))
    assert ceiling.propose(ctx, 8).tokens == [3, 4, 5]  # 3 4 5 6 occurs nowhere
    ctx = DraftContext([*prompt, 3, 4, 5, 6], len(prompt), session=SessionRef("s"))
    assert ceiling.propose(ctx, 8).tokens == [2, 3]  # the committed tokens are indexed
    assert ceiling.propose(ctx, 1).tokens == [2]
    other = DraftContext([*prompt, 3, 9], len(prompt), session=SessionRef("s"))
    assert ceiling.propose(other, 8).tokens == []  # diverged from the answer: no draft
    with pytest.raises(ConfigError, match="scope"):
        CopyCeilingDrafter("galaxy")


def test_tree_acceptance_keeps_the_longest_branch() -> None:
    from agentspec.types import Draft

    tree = Draft(tokens=[5, 6, 9, 7], parents=[-1, 0, 0, 1])
    assert accepted(tree, [5, 6, 7, 8]) == (3, [0, 1, 3])
    assert accepted(tree, [5, 9]) == (2, [0, 2])
    assert accepted(Draft(tokens=[1, 2]), [1, 3]) == (1, [0])


def test_packaged_traces_ship_with_their_license() -> None:
    files = sorted(p.name for p in PACKAGED_TRACES.iterdir())
    assert "LICENSE" in files and sum(f.endswith(".traj") for f in files) == 13
    assert "MIT License" in (PACKAGED_TRACES / "LICENSE").read_text()


def test_preamble_lengthens_prompts_without_leaking_answers() -> None:
    from workflows.replay.runner import with_preamble

    sessions = _sessions()
    padded = with_preamble(sessions, 500)
    answers = {tuple(t.output) for s in sessions for t in s.turns}
    for before, after in zip(sessions, padded, strict=True):
        pre = after.turns[0].prompt[:500]
        assert len(pre) == 500 and tuple(pre) not in answers
        for b, a in zip(before.turns, after.turns, strict=True):
            assert a.prompt == pre + b.prompt and a.output == b.output
    assert with_preamble(sessions, 0) == sessions


def test_cost_curve_interpolates_and_rejects_bad_files(tmp_path: Path) -> None:
    from agentspec.errors import ConfigError
    from workflows.replay.runner import curve_cost, read_curve

    packaged = Path(replay.__file__).parents[1] / "data" / "costs"
    curve = read_curve(next(packaged.glob("*.json")))
    cost = curve_cost(curve)
    assert cost(1) == curve[1] and cost(32) == curve[32]
    assert curve[4] < cost(6) < curve[8] or curve[8] < cost(6) < curve[4]
    assert cost(64) > cost(32)
    bad = tmp_path / "c.json"
    bad.write_text('{"costs": {"1": 0.1}}')
    with pytest.raises(ConfigError, match=r"c\.json"):
        read_curve(bad)
