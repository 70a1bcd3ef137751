"""The agent workloads: fixture, relay chaining, file blocks, EditEval runner, tool agent."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from agentspec.chat.formats import FORMATS, choose_tool_format, format_for
from agentspec.chat.formats.fallback import FallbackFormat
from agentspec.chat.formats.llama3 import Llama3JsonFormat
from agentspec.chat.formats.mistral import MistralFormat
from agentspec.errors import BenchmarkError, ConfigError
from agentspec.types import check_id
from workflows.workloads.base import WorkloadRequest
from workflows.workloads.datasets import (
    DATA_ENV,
    FIXTURE_DIR,
    data_dir,
    load_delegate52,
    load_editeval,
    load_prompt_template,
)
from workflows.workloads.delegate52 import (
    Delegate52Workload,
    RelaySession,
    documents_from_output,
    estimate_tokens,
    expected_files,
    mentioned_files,
    parse_file_blocks,
)
from workflows.workloads.instructedit import InstructEditWorkload, extract_code, run_test
from workflows.workloads.open_chat import ChatWorkload
from workflows.workloads.tool_agent import SYSTEM_PROMPT, ToolAgentWorkload, system_prompt
from workflows.workloads.tools import TOOLS, FakeTools, calculate, parse_tool_call, strip_tool_calls


def _copy_fixture(dst: Path) -> Path:
    for f in FIXTURE_DIR.iterdir():
        if f.is_file():
            (dst / f.name).write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
    return dst


# --- fixture and data folder -------------------------------------------------------------


def test_fixture_loads() -> None:
    domains = load_delegate52(FIXTURE_DIR)
    assert len(domains) == 8
    assert len({d.seed_file.rsplit(".", 1)[1] for d in domains}) == 8  # eight formats
    assert all(len(d.edits) >= 2 and d.seed_excerpt for d in domains)
    assert "[[INPUT_CONTEXT]]" in load_prompt_template(FIXTURE_DIR)
    tasks = load_editeval(FIXTURE_DIR)
    assert len(tasks) == 20
    assert all("def check(" in t.test for t in tasks)
    assert (FIXTURE_DIR / "ATTRIBUTION.md").is_file()


def test_fixture_prompts_fit_a_small_model() -> None:
    # Turn-1 prompts stay under ~700 tokens (the estimate tracks SmolLM2's count closely).
    for session in Delegate52Workload().sessions(None, 1):
        request = session.next_request(None)
        assert request is not None
        assert estimate_tokens(request.messages[0]["content"]) <= 700


def test_data_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATA_ENV, raising=False)
    assert data_dir(None) == FIXTURE_DIR
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    monkeypatch.setenv(DATA_ENV, str(env_dir))
    assert data_dir(None) == env_dir
    assert data_dir(str(tmp_path)) == tmp_path  # --data wins over the environment
    with pytest.raises(BenchmarkError, match="does not exist"):
        data_dir(str(tmp_path / "nope"))


def test_data_override_is_used(tmp_path: Path) -> None:
    folder = _copy_fixture(tmp_path)
    rows = (folder / "delegate52_domains.jsonl").read_text().splitlines()
    (folder / "delegate52_domains.jsonl").write_text(rows[0] + "\n")
    assert len(Delegate52Workload(str(folder)).domains) == 1


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BenchmarkError, match=r"editeval\.jsonl not found"):
        InstructEditWorkload(str(tmp_path))


def test_malformed_rows_name_file_and_line(tmp_path: Path) -> None:
    folder = _copy_fixture(tmp_path)
    path = folder / "editeval.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    with pytest.raises(BenchmarkError, match=r"editeval\.jsonl:2: malformed JSON"):
        load_editeval(folder)
    row = json.loads(lines[0])
    del row["test"]
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(BenchmarkError, match=r"editeval\.jsonl:1: missing field\(s\) test"):
        load_editeval(folder)
    (folder / "delegate52_prompt_template.txt").write_text("no placeholders")
    with pytest.raises(BenchmarkError, match="lacks placeholder"):
        load_prompt_template(folder)


# --- DELEGATE-52 ----------------------------------------------------------------------------


def test_parse_file_blocks() -> None:
    text = "Here you go:\n```a.csv\nx,y\n1,2\n```\nand\n```json\n{}\n```\n```b.txt\ncut off"
    blocks = parse_file_blocks(text)
    assert [(b.name, b.content, b.closed) for b in blocks] == [
        ("a.csv", "x,y\n1,2", True),
        ("", "{}", True),
        ("b.txt", "cut off", False),
    ]
    assert parse_file_blocks("no fences at all") == []


def test_documents_from_output() -> None:
    prev = {"doc.txt": "old text"}
    docs, status = documents_from_output("```csv\na,b\n1,2\n```", ["out.csv"], prev)
    assert (docs, status) == ({"out.csv": "a,b\n1,2"}, "blocks")  # unnamed block named
    docs, status = documents_from_output("line one of the document\nline two", ["d.txt"], prev)
    assert status == "whole_output" and docs == {"d.txt": "line one of the document\nline two"}
    for garbage in ("", "   \n", "ok."):
        assert documents_from_output(garbage, ["d.txt"], prev) == (prev, "parse_failed")


def test_estimate_tokens() -> None:
    assert estimate_tokens("") == 0
    assert estimate_tokens("hello world") == 2
    assert estimate_tokens("2021,42") == 7  # digits and punctuation are one token each
    assert estimate_tokens("def f():\n        return 1") == 9  # single spaces are free


def test_file_names_from_instructions() -> None:
    text = "Convert this to `ledger.csv` (e.g. like json.dump does) and keep _atom_site.label."
    assert mentioned_files(text) == ["ledger.csv"]
    assert mentioned_files("Split into structure.cif and geometry.cif.") == [
        "structure.cif",
        "geometry.cif",
    ]
    assert expected_files("Convert amounts to euros.", ["a.ledger"]) == ["a.ledger"]
    merge = "Merge `x.ledger` and `y.ledger` into `all.ledger`."
    assert expected_files(merge, ["x.ledger", "y.ledger"]) == ["all.ledger"]


def _relay() -> RelaySession:
    workload = Delegate52Workload()
    return next(iter(workload.sessions(1, 4)))


def test_relay_chains_outputs_into_next_turn() -> None:
    session = _relay()
    seed_name, seed = session.domain.seed_file, session.domain.seed_excerpt
    edit0 = session.domain.edits[0]
    r1 = session.next_request(None)
    assert r1 is not None and r1.meta["direction"] == "forward" and r1.meta["turn"] == 1
    prompt1 = r1.messages[0]["content"]
    assert f"```{seed_name}\n{seed}\n```" in prompt1 and edit0.forward in prompt1
    assert "[[" not in prompt1 and seed_name in r1.meta["files"]

    edited = f"```{seed_name}\nEDITED DOCUMENT LINE 1\nEDITED DOCUMENT LINE 2\n```"
    m1 = session.turn_metrics(r1, edited)
    assert m1["file_block_parsed"] and not m1["parse_failed"]
    assert "similarity_to_original" not in m1  # only backward turns restore

    r2 = session.next_request(edited)
    assert r2 is not None and r2.meta["direction"] == "backward"
    prompt2 = r2.messages[0]["content"]
    assert "EDITED DOCUMENT LINE 2" in prompt2 and seed not in prompt2
    assert edit0.backward in prompt2
    restored = f"```{seed_name}\n{seed}\n```"
    assert session.turn_metrics(r2, restored)["similarity_to_original"] == 1.0
    assert session.turn_metrics(r2, edited)["similarity_to_original"] < 0.2

    r3 = session.next_request("")  # garbage: keep the previous document, record it
    assert r3 is not None and r3.meta["pair"] == 1 and r3.meta["direction"] == "forward"
    assert "EDITED DOCUMENT LINE 2" in r3.messages[0]["content"]
    assert session.turn_metrics(r2, "")["parse_failed"] is True
    r4 = session.next_request(restored)
    assert r4 is not None and seed in r4.messages[0]["content"]
    assert session.next_request(restored) is None  # 4 turns asked


def test_relay_is_fresh_and_deterministic() -> None:
    a, b = _relay(), _relay()
    ra, rb = a.next_request(None), b.next_request(None)
    assert ra == rb and check_id("session", a.session_id)


def test_relay_budget_allows_reemitting_the_document() -> None:
    workload = Delegate52Workload()
    for session in workload.sessions(None, 1):
        request = session.next_request(None)
        assert request is not None
        assert request.max_tokens >= 1.3 * estimate_tokens(session.domain.seed_excerpt)
    capped = Delegate52Workload(max_tokens=50, count_tokens=lambda s: len(s.split()))
    assert all(capped.budget("x " * n) == min(50, max(64, n)) for n in (1, 500))
    with pytest.raises(BenchmarkError):
        list(workload.sessions(None, 0))


# --- EditEval -------------------------------------------------------------------------------


def test_extract_code() -> None:
    assert extract_code("Sure:\n```python\ndef f():\n    return 1\n```\nDone.") == (
        "def f():\n    return 1"
    )
    assert extract_code("```\nx = 1\n```") == "x = 1"
    assert extract_code("```python\nx = 2") == "x = 2"  # cut off by the token limit
    assert extract_code("y = 3\n") == "y = 3"
    assert extract_code("  \n") is None


def test_editeval_reference_passes_and_wrong_answer_fails() -> None:
    tasks = {t.task_id: t for t in load_editeval(FIXTURE_DIR)}
    # One plain row and one whose context binds the code to `edited_code`.
    for task_id in ("EditEval/42", "EditEval/78"):
        task = tasks[task_id]
        assert run_test(task, task.output).passed, task_id
        wrong = run_test(task, task.input)  # the unedited code
        assert not wrong.passed and wrong.error and "AssertionError" in wrong.error


def test_editeval_turn_metrics_and_timeout() -> None:
    workload = InstructEditWorkload(timeout_s=1.0)
    session = next(iter(workload.sessions(1, 1)))
    request = session.next_request(None)
    assert request is not None and session.next_request("x") is None
    assert "```python" in request.messages[0]["content"]
    good = session.turn_metrics(request, f"```python\n{session.task.output}\n```")
    assert good["tests_passed"] is True and good["error"] is None
    assert session.turn_metrics(request, "")["error"] == "no code in output"
    slow = run_test(session.task, "while True:\n    pass", timeout_s=1.0)
    assert not slow.passed and slow.error is not None and slow.error.startswith("timeout")
    assert check_id("session", session.session_id)


# --- tool agent -----------------------------------------------------------------------------


def _play(workload: ToolAgentWorkload, turns: int) -> list[list[WorkloadRequest]]:
    played = []
    for session in workload.sessions(None, turns):
        requests, out = [], None
        while (request := session.next_request(out)) is not None:
            requests.append(request)
            call = {"name": "calculator", "arguments": {"expression": str(len(requests))}}
            out = f"Step {len(requests)}.\n<tool_call>{json.dumps(call)}</tool_call>"
        played.append(requests)
    return played


def test_tool_agent_sessions_are_deterministic() -> None:
    a, b = _play(ToolAgentWorkload(seed=3), 8), _play(ToolAgentWorkload(seed=3), 8)
    assert a == b and 5 <= len(a) <= 8
    other = _play(ToolAgentWorkload(seed=4), 8)
    assert [r[0].messages for r in other] != [r[0].messages for r in a]


def test_tool_agent_carries_same_tools_and_growing_transcript() -> None:
    for requests in _play(ToolAgentWorkload(), 8):
        assert len(requests) >= 3
        assert all(r.tools == TOOLS for r in requests)
        for prev, cur in itertools.pairwise(requests):
            assert cur.messages[: len(prev.messages)] == prev.messages
            assistant, tool = cur.messages[-2], cur.messages[-1]
            # The output's text stays; its own call is replaced by the planned, answered one.
            assert assistant["role"] == "assistant"
            assert assistant["content"] == f"Step {len(prev.messages) // 2}."
            planned = prev.meta["planned_tool"]
            assert assistant["tool_calls"][0]["function"]["name"] == planned
            assert tool["role"] == "tool"
            assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"]
            assert isinstance(json.loads(tool["content"]), dict)
        assert all(isinstance(m["content"], str) for m in requests[-1].messages)


def test_tool_agent_file_contents_come_from_fixture() -> None:
    files = {d.seed_file: d.seed_excerpt for d in load_delegate52(FIXTURE_DIR)}
    contents = [
        json.loads(m["content"]).get("content")
        for requests in _play(ToolAgentWorkload(), 8)
        for m in requests[-1].messages
        if m["role"] == "tool" and m.get("name") == "read_file"
    ]
    assert contents and all(c in files.values() for c in contents)


def test_tool_agent_metrics_and_fake_tools() -> None:
    session = next(iter(ToolAgentWorkload().sessions(1, 4)))
    request = session.next_request(None)
    assert request is not None
    planned = request.meta["planned_tool"]
    call = f'<tool_call>{{"name": "{planned}", "arguments": {{}}}}</tool_call>'
    assert session.turn_metrics(request, call)["matches_plan"] is True
    assert session.turn_metrics(request, "I don't know")["tool_call_parsed"] is False
    assert strip_tool_calls('Hi <tool_call>{"name": "search"}</tool_call>') == "Hi"
    assert strip_tool_calls('{"name": "search", "arguments": {}}') == ""
    assert parse_tool_call('{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}') == (
        "search",
        {"query": "x"},
    )
    tools = FakeTools({"a.txt": "hello"})
    oslo = {"city": "Oslo"}
    assert tools.call("get_weather", oslo) == tools.call("get_weather", oslo)
    assert tools.call("read_file", {"path": "missing"})["error"] == "FileNotFoundError"
    assert tools.call("nope", {})["error"].startswith("unknown tool")
    assert "error" in tools.call("calculator", {"expression": "__import__('os')"})
    assert calculate("(3 + 4) * 2") == 14
    with pytest.raises(ValueError):
        calculate("9 ** 9 ** 9")


#: The tool agent's system prompt before it spoke the model's tool format: the fallback
#: format (SmolLM2) must keep it byte for byte.
OLD_SYSTEM_PROMPT = (
    "You are an agent that completes tasks with tools. To call a tool, reply with exactly one "
    'line: <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>. Tool results come '
    "back as JSON in tool messages. When the task is done, answer the user in plain text."
)
#: sha256 of the SmolLM2 prompt ids of every request of the default sessions (5 turns) fed
#: the outputs below, computed on main before the change (21 requests).
SMOLLM2_PROMPTS_SHA256 = "e54362fe44d5200ddd8620e23719d3fb3fb618f4befa69e7d1d1c1dcf1f5d62c"
PIN_OUTPUTS = (
    'Step 1.\n<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>',
    '{"name": "search", "arguments": {"query": "x"}}',
    "Thinking <tool_call>not json</tool_call> done",
    "plain answer",
)


def test_tool_agent_fallback_prompt_is_unchanged() -> None:
    import hashlib

    from transformers import AutoTokenizer

    from agentspec.models import resolve_model

    assert SYSTEM_PROMPT == OLD_SYSTEM_PROMPT == system_prompt(FallbackFormat())
    tok = AutoTokenizer.from_pretrained(resolve_model().path)
    fmt = format_for(tok)
    assert fmt.name == "fallback"
    digest, count = hashlib.sha256(), 0
    for session in ToolAgentWorkload(tool_format=fmt).sessions(None, 5):
        out, i = None, 0
        while (request := session.next_request(out)) is not None:
            assert request.messages[0]["content"] == OLD_SYSTEM_PROMPT
            digest.update(json.dumps(request.prompt_ids(tok)).encode())
            count += 1
            out, i = PIN_OUTPUTS[i % len(PIN_OUTPUTS)], i + 1
    assert (count, digest.hexdigest()) == (21, SMOLLM2_PROMPTS_SHA256)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tool_agent_prompt_per_format(name: str) -> None:
    fmt = FORMATS[name]()
    prompt = system_prompt(fmt)
    first = next(iter(ToolAgentWorkload(tool_format=name).sessions(1, 2))).next_request(None)
    assert first is not None and first.messages[0]["content"] == prompt
    if name == "fallback":
        assert prompt == OLD_SYSTEM_PROMPT
    else:  # the template teaches the syntax: no tag or call example in the agent's prompt
        assert "To call a tool" not in prompt and "<tool_call>" not in prompt
        assert prompt == OLD_SYSTEM_PROMPT.replace(
            'To call a tool, reply with exactly one line: <tool_call>{"name": "<tool>", '
            '"arguments": {...}}</tool_call>. ', "")
    with pytest.raises(ConfigError, match="'qwen' is unknown"):
        ToolAgentWorkload(tool_format="qwen")


def test_tool_agent_speaks_hermes() -> None:
    from test_tool_formats import FAMILIES, TEMPLATES, byte_tokenizer

    template, eos, special, added = FAMILIES["hermes"]
    tok = byte_tokenizer((TEMPLATES / template).read_text(), eos, special, added)
    fmt = choose_tool_format(tok)
    assert fmt.name == "hermes"
    session = next(iter(ToolAgentWorkload(tool_format=fmt).sessions(1, 4)))
    request = session.next_request(None)
    assert request is not None
    rendered = tok.decode(request.prompt_ids(tok))
    # The call syntax is taught once, by the template; the agent's prompt follows it.
    assert rendered.count("Call a function as <tool_call>") == 1
    assert system_prompt(fmt) in rendered and "To call a tool" not in rendered
    planned = request.meta["planned_tool"]
    block = f'Checking.\n<tool_call>\n{{"name": "{planned}", "arguments": {{}}}}\n</tool_call>'
    assert session.turn_metrics(request, block)["matches_plan"] is True
    bare = f'{{"name": "{planned}", "arguments": {{}}}}'  # Qwen2.5-Coder's habit
    assert session.turn_metrics(request, bare)["matches_plan"] is True
    nxt = session.next_request(block)
    assert nxt is not None and nxt.messages[-2]["content"] == "Checking."
    assert "<tool_call>" in tok.decode(nxt.prompt_ids(tok))  # the template writes the call
    assert strip_tool_calls(bare, fmt) == ""


def test_strip_tool_calls_per_format() -> None:
    assert strip_tool_calls('{"name": "search", "parameters": {"query": "x"}}',
                            Llama3JsonFormat()) == ""
    assert strip_tool_calls('Sure. [TOOL_CALLS] [{"name": "search", "arguments": {}}]',
                            MistralFormat()) == "Sure."
    assert strip_tool_calls("Just prose.", MistralFormat()) == "Just prose."
    # The fallback keeps the workload's own rules: a block that is not JSON stays.
    odd = "Thinking <tool_call>not json</tool_call> done"
    assert strip_tool_calls(odd, FallbackFormat()) == strip_tool_calls(odd) == odd


# --- chat -----------------------------------------------------------------------------------


def test_chat_sessions() -> None:
    sessions = list(ChatWorkload().sessions(None, 2))
    assert len(sessions) == 20
    two_turn = next(s for s in sessions if len(s._questions) == 2)
    first = two_turn.next_request(None)
    second = two_turn.next_request("An answer.")
    assert first is not None and second is not None
    assert [m["role"] for m in second.messages] == ["user", "assistant", "user"]
    assert two_turn.next_request("More.") is None
    assert all(len(list(ChatWorkload().sessions(None, 1))[i]._questions) == 1 for i in range(20))


def test_relay_prompt_styles() -> None:
    compact = next(iter(Delegate52Workload().sessions(1, 1)))
    template = next(iter(Delegate52Workload(prompt_style="template").sessions(1, 1)))
    rc, rt = compact.next_request(None), template.next_request(None)
    assert rc is not None and rt is not None
    name, seed = compact.domain.seed_file, compact.domain.seed_excerpt
    edit = compact.domain.edits[0].forward
    # compact: the document, then the task; the answer opens with the file's fence and the
    # closing fence ends it.
    assert rc.messages[0]["content"] == (
        f"```{name}\n{seed}\n```\n\n{edit}\nWrite the complete updated file."
    )
    assert rc.prefix == f"```{name}\n" and rc.stop == ["\n```"]
    # template: the benchmark's own prompt, no prefix.
    assert "TASK:" in rt.messages[0]["content"] and rt.prefix == "" and rt.stop == []
    assert f"```{name}\n{seed}\n```" in rt.messages[0]["content"]
    # The compact answer (prefix + output) parses back into the document.
    metrics = compact.turn_metrics(rc, rc.prefix + seed)
    assert metrics["file_block_parsed"] and metrics["similarity_to_input"] == 1.0
    with pytest.raises(BenchmarkError, match="prompt style"):
        Delegate52Workload(prompt_style="fancy")
