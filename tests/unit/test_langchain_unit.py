"""ChatAgentSpec and the executor on a scripted stand-in runtime: conversion, tool calls,
streaming, sessions, metadata, errors. No model is loaded."""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from collections.abc import Generator
from types import SimpleNamespace
from typing import Any

import pytest
from langchain_core.messages import (
    AIMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from adapters.langchain import (
    ChatAgentSpec,
    GenerationTimeoutError,
    MessageConversionError,
    ToolCallingExecutor,
    ToolSchemaError,
    to_agentspec_messages,
)
from adapters.langchain import runtimes as runtimes_mod
from adapters.langchain.messages import VisibleText
from agentspec.chat.api import ChatResult
from agentspec.chat.formats.fallback import FallbackFormat
from agentspec.chat.stream import ResultStream
from agentspec.chat.templates import normalise_messages
from agentspec.chat.tool_calls import parse_tool_calls, tool_names
from agentspec.chat.turn import ChatTurn
from agentspec.errors import AgentSpecError, ConfigError, StoreBusyError
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.types import RequestStats, StepStats

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


class FakeRuntime:
    """Plays back scripted outputs through ``Runtime.stream_turn``'s interface."""

    def __init__(self, *outputs: str, delay: float = 0.0, busy: int = 0) -> None:
        self.outputs, self.delay, self.busy = list(outputs), delay, busy
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.tool_format = FallbackFormat()  # the scripted outputs' <tool_call> markup

    def stream_turn(self, turn: ChatTurn) -> ResultStream[ChatResult]:
        return ResultStream(self._play(turn))

    def _play(self, turn: ChatTurn) -> Generator[str, None, ChatResult]:
        tools = turn.tools
        self.calls.append({
            "messages": turn.messages, "tools": tools, "tool_choice": turn.tool_choice,
            "session": turn.session, "spec": turn.spec, "max_tokens": turn.max_tokens,
            "stop": turn.stop, "response_format": turn.response_format,
        })
        if self.busy:
            self.busy -= 1
            raise StoreBusyError("store is locked")
        text = self.outputs.pop(0) if self.outputs else "done"
        with self.lock:
            for i in range(0, len(text), 4):
                time.sleep(self.delay)
                yield text[i : i + 4]
        parsed = parse_tool_calls(text, tool_names(tools) if tools else None)
        stats = RequestStats(prompt_tokens=7, cached_prompt_tokens=3, generated_tokens=5,
                             forwards=2,
                             steps=[StepStats("suffix", 4, 3, 4, 0.0, 0.0),
                                    StepStats("none", 0, 0, 1, 0.0, 0.0)])
        return ChatResult(text, parsed.content, parsed.tool_calls, parsed.invalid_tool_calls,
                          "stop", 7, 5, stats, [1, 2, 3, 4, 5])


def _llm(*outputs: str, **kw: Any) -> tuple[ChatAgentSpec, FakeRuntime]:
    rt = FakeRuntime(*outputs, **{k: kw.pop(k) for k in ("delay", "busy") if k in kw})
    return ChatAgentSpec(runtime=rt, store=False, **kw), rt


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_invoke_metadata_and_usage() -> None:
    llm, rt = _llm("Hello there!", return_token_ids=True)
    msg = llm.invoke("Hi")
    assert msg.content == "Hello there!"
    assert msg.usage_metadata == {"input_tokens": 7, "output_tokens": 5, "total_tokens": 12,
                                  "input_token_details": {"cache_read": 3}}
    meta = msg.response_metadata
    assert meta["model_name"] == "smollm2-135m-instruct" and meta["finish_reason"] == "stop"
    spec = meta["speculative"]
    assert spec["accepted_histogram"] == {"0": 1, "3": 1}
    assert spec["forwards_per_1k"] == 400.0 and spec["drafter_wins"] == {"none": 1, "suffix": 1}
    assert meta["token_ids"] == [1, 2, 3, 4, 5]
    assert rt.calls[0]["messages"] == [{"role": "user", "content": "Hi"}]
    assert rt.calls[0]["tools"] is None and rt.calls[0]["max_tokens"] == 256
    assert spec["dtype"] is None  # this stand-in's target does not say


def test_metadata_reports_the_resolved_precision() -> None:
    """``speculative["dtype"]`` is the precision the runtime's target runs in (``auto``
    resolved: what the target holds), in invoke and in the stream's last chunk."""
    llm, rt = _llm("Hello there!", "Hello there!")
    rt.target = SimpleNamespace(name="tiny", dtype="w8a16")  # type: ignore[attr-defined]
    assert llm.invoke("Hi").response_metadata["speculative"]["dtype"] == "w8a16"
    last = list(llm.stream("Hi"))[-1]
    assert last.response_metadata["speculative"]["dtype"] == "w8a16"


def test_stream_yields_engine_deltas_and_a_last_chunk() -> None:
    llm, _ = _llm("Hello there, friend!")
    chunks = list(llm.stream("Hi"))
    assert [c.content for c in chunks[:-1]] == ["Hell", "o th", "ere,", " fri", "end!"]
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata is not None
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.content == "Hello there, friend!" and full.usage_metadata["total_tokens"] == 12


def test_tool_calls_parsed_in_invoke_and_stream() -> None:
    llm, rt = _llm("Sure." + CALL, "Sure." + CALL)
    bound = llm.bind_tools([add])
    msg = bound.invoke("What is 1 + 2?")
    assert msg.content == "Sure."
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("add", {"a": 1, "b": 2})]
    assert rt.calls[0]["tools"][0]["function"]["name"] == "add"
    full = None
    for chunk in bound.stream("What is 1 + 2?"):
        assert "<tool" not in chunk.content  # markup never leaks into streamed text
        full = chunk if full is None else full + chunk
    assert full is not None and full.content == "Sure."
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [("add", {"a": 1, "b": 2})]


def test_malformed_call_becomes_invalid_tool_call() -> None:
    bad = '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>'
    llm, _ = _llm(bad, bad)
    msg = llm.bind_tools([add]).invoke("add")
    assert msg.tool_calls == [] and len(msg.invalid_tool_calls) == 1
    assert msg.invalid_tool_calls[0]["name"] == "add"
    assert "not valid JSON" in (msg.invalid_tool_calls[0]["error"] or "")
    chunks = list(llm.bind_tools([add]).stream("add"))
    assert chunks[-1].invalid_tool_calls and not chunks[-1].tool_calls


class Person(BaseModel):
    """A person."""

    name: str = Field(description="full name")


def test_bind_tools_accepts_every_tool_form() -> None:
    def shout(text: str) -> str:
        """Upper-case text."""
        return text.upper()

    raw = {"type": "function", "function": {"name": "noop", "description": "Nothing.",
                                            "parameters": {"type": "object", "properties": {}}}}
    llm, rt = _llm("ok")
    llm.bind_tools([add, Person, shout, raw, Person.model_json_schema()]).invoke("x")
    assert [t["function"]["name"] for t in rt.calls[0]["tools"]] == [
        "add", "Person", "shout", "noop"]


@pytest.mark.parametrize(("choice", "expected"), [
    ("any", "add"), ("required", "add"), (True, "add"), ("add", "add"), ("auto", None),
    ({"type": "function", "function": {"name": "add"}}, "add"),
])
def test_tool_choice_forms(choice: Any, expected: str | None) -> None:
    llm, rt = _llm("ok")
    llm.bind_tools([add], tool_choice=choice).invoke("x")
    assert rt.calls[0]["tool_choice"] == expected


def test_tool_choice_any_with_two_tools_and_none() -> None:
    llm, rt = _llm("ok", "ok")
    llm.bind_tools([add, Person], tool_choice="any").invoke("x")
    llm.bind_tools([add, Person], tool_choice="none").invoke("x")
    assert rt.calls[0]["tool_choice"] == "any"
    # "none" reaches the runtime, which hides the tools and lets the model write only prose.
    assert rt.calls[1]["tools"] and rt.calls[1]["tool_choice"] == "none"
    with pytest.raises(ConfigError, match="names no bound tool"):
        llm.bind_tools([add], tool_choice="multiply")


@pytest.mark.parametrize("bad", [
    42,
    {"type": "function", "function": {"name": "bad name!", "parameters": {}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}},
    {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"default": object()}}}}},
])
def test_invalid_tool_schemas_are_config_errors(bad: Any) -> None:
    llm, _ = _llm()
    with pytest.raises(ToolSchemaError) as info:
        llm.bind_tools([bad])
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("messages", [
    [FunctionMessage(content="1", name="f")],
    [ChatMessage(content="hi", role="critic")],
    [HumanMessage(content=[{"type": "image_url", "image_url": {"url": "data:,"}}])],
    [AIMessage("", tool_calls=[{"name": "f", "args": {"when": datetime.date(2024, 1, 1)},
                                "id": "1", "type": "tool_call"}])],
])
def test_unsupported_input_is_a_clear_error(messages: list[Any]) -> None:
    llm, rt = _llm("ok")
    with pytest.raises(MessageConversionError) as info:
        llm.invoke(messages)
    assert isinstance(info.value, AgentSpecError) and not rt.calls


def test_message_conversion_round_trips_tool_calls_compactly() -> None:
    messages = to_agentspec_messages([
        SystemMessage("sys"), HumanMessage([{"type": "text", "text": "a"}, "b"]),
        AIMessage([{"type": "text", "text": "t"}, {"type": "tool_use", "id": "1"}],
                  tool_calls=[{"name": "add", "args": {"b": 2, "a": "é"}, "id": "1"}]),
        ToolMessage("boom", tool_call_id="1", status="error"),
        ChatMessage(content="dev", role="developer"),
    ])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "system"]
    assert messages[1]["content"] == "ab" and messages[3]["content"] == "Error: boom"
    # The model's own form: compact JSON in its key order, unicode kept.
    rendered = normalise_messages(messages)[2]["content"]
    assert rendered == 't<tool_call>{"name": "add", "arguments": {"b": 2, "a": "é"}}</tool_call>'


def test_session_id_sources() -> None:
    llm, rt = _llm(*["ok"] * 6, session_id="field-1", agent_spec=AgentSpec(name="coder"))
    llm.invoke("x")
    llm.invoke("x", config={"configurable": {"session_id": "cfg-1"}})
    llm.invoke("x", config={"configurable": {"thread_id": "has spaces"}})
    llm.invoke("x", session_id="kw-1", config={"configurable": {"session_id": "cfg-1"}})
    list(llm.stream("x", config={"configurable": {"thread_id": 7}}))
    llm.batch(["x"], config={"configurable": {"session_id": "batch-1"}})
    ids = [c["session"].session_id for c in rt.calls]
    assert ids[:2] == ["field-1", "cfg-1"] and ids[2].startswith("thread-")
    assert ids[3:] == ["kw-1", "7", "batch-1"]
    assert {c["session"].agent for c in rt.calls} == {"coder"}
    with pytest.raises(ConfigError):
        llm.invoke("x", config={"configurable": {"session_id": "bad id!"}})
    with pytest.raises(ConfigError):
        ChatAgentSpec(session_id="no spaces allowed", store=False)


def test_spec_temperature_stop_and_limits() -> None:
    spec = AgentSpec(drafting=DraftingPolicy(method="none"))
    llm, rt = _llm("ok", "ok", "ok", agent_spec=spec, stop=["\n"], max_tokens=9)
    llm.invoke("x")
    llm.invoke("x", stop=["END"], max_tokens=3)
    ChatAgentSpec(runtime=rt, temperature=0.7, seed=3, store=False).invoke("x")
    assert rt.calls[0]["spec"] is spec and rt.calls[0]["stop"] == ["\n"]
    assert rt.calls[1]["stop"] == ["END"] and rt.calls[1]["max_tokens"] == 3
    assert rt.calls[2]["spec"].verifier.temperature == 0.7
    assert rt.calls[2]["spec"].verifier.seed == 3
    assert llm._get_ls_params(stop=["s"])["ls_stop"] == ["s"]


def test_timeout_and_retries() -> None:
    llm, _ = _llm("x" * 40, delay=0.02, timeout=0.05)
    with pytest.raises(GenerationTimeoutError) as info:
        llm.invoke("x")
    assert isinstance(info.value, TimeoutError)
    llm, rt = _llm("ok", busy=1)
    assert llm.invoke("x").content == "ok" and len(rt.calls) == 2
    llm, _ = _llm("ok", busy=1, max_retries=0)
    with pytest.raises(StoreBusyError):
        llm.invoke("x")


def test_async_invoke_stream_and_batch() -> None:
    async def run() -> tuple[Any, ...]:
        llm, rt = _llm("one", "two two", "three", "four")
        a = await llm.ainvoke("x", config={"configurable": {"session_id": "as-1"}})
        parts = [c.content async for c in llm.astream("x")]
        b = await llm.abatch(["x", "y"])
        return a, parts, b, rt

    a, parts, batch, rt = asyncio.run(run())
    assert a.content == "one" and rt.calls[0]["session"].session_id == "as-1"
    assert parts[:-1] == ["two ", "two"] and sorted(m.content for m in batch) == ["four", "three"]


def test_astream_stopped_early_frees_the_model() -> None:
    async def run() -> str:
        llm, _ = _llm("a" * 64, "after", delay=0.01)
        async for _ in llm.astream("x"):
            break
        return (await llm.ainvoke("x")).text

    assert asyncio.run(run()) == "after"


def test_visible_text_filter() -> None:
    vt = VisibleText()
    assert vt.feed("ab<to") == "ab" and vt.feed("ol") == "" and vt.feed("_call>{") == ""
    assert vt.feed("junk") == "" and vt.flush() == ""
    vt = VisibleText()
    assert vt.feed("x <") == "x " and vt.flush() == "<"


def test_executor_runs_tools_and_returns_errors_to_the_model() -> None:
    def divide(a: float, b: float) -> float:
        """Divide a by b."""
        return a / b

    outputs = [
        '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>',
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "divide", "arguments": {"a": 1,</tool_call>',
        '<tool_call>{"name": "divide", "arguments": {"a": 6, "b": 3}}</tool_call>',
        "The answer is 2.",
    ]
    llm, rt = _llm(*outputs)
    ex = ToolCallingExecutor(llm, [divide], session_id="run-7", system_prompt="Be brief.")
    result = ex.invoke("What is 6 / 3?")
    assert result.stopped == "final_answer" and result.output == "The answer is 2."
    assert result.steps == 5 and result.tool_errors == 3
    tool_msgs = [m for m in result.messages if isinstance(m, ToolMessage)]
    assert "ZeroDivisionError" in tool_msgs[0].content and tool_msgs[0].status == "error"
    assert "unknown tool 'nope'" in tool_msgs[1].content
    assert "not valid JSON" in tool_msgs[2].content and tool_msgs[3].content == "2.0"
    assert {c["session"].session_id for c in rt.calls} == {"run-7"}
    assert rt.calls[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert result.speculative()["forwards"] == 10


def test_executor_step_limit_async_and_bad_tools() -> None:
    llm, rt = _llm(*[CALL] * 3)
    ex = ToolCallingExecutor(llm, [add], max_steps=3, tool_choice=lambda s: "any")
    result = asyncio.run(ex.ainvoke("loop"))
    assert result.stopped == "step_limit" and result.steps == 3 and result.output == ""
    assert [c["tool_choice"] for c in rt.calls] == ["add"] * 3
    with pytest.raises(ToolSchemaError):
        ToolCallingExecutor(llm, [Person])  # a schema cannot be executed
    with pytest.raises(ConfigError):
        ToolCallingExecutor(llm, [add], max_steps=0)


def test_shared_runtime_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    loads: list[Any] = []

    def fake_load(config: Any) -> Any:
        loads.append(config)
        # A target owns its lock: every runtime over it takes that one.
        return SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=0), lock=threading.RLock())

    monkeypatch.setattr(runtimes_mod.HFTarget, "load", staticmethod(fake_load))
    monkeypatch.setattr(runtimes_mod, "_TARGETS", {})
    monkeypatch.setattr(runtimes_mod, "_RUNTIMES", {})
    a = runtimes_mod.shared_runtime("m", "float32", False)
    b = runtimes_mod.shared_runtime("m", "float32", False)
    c = runtimes_mod.shared_runtime("m", "float32", tmp_path / "s.db")
    assert a is b and a is not c and len(loads) == 1
    assert c.target is a.target and c.lock is a.lock and c.store is not None
    # Keyed by the tool format too: same model and lock, its own format.
    d = runtimes_mod.shared_runtime("m", "float32", False, "hermes")
    assert d is not a and d is runtimes_mod.shared_runtime("m", "float32", False, "hermes")
    assert d.target is a.target and d.lock is a.lock and len(loads) == 1
    assert (a.tool_format.name, d.tool_format.name) == ("fallback", "hermes")
    with pytest.raises(ConfigError, match="'hermes2' is unknown"):
        runtimes_mod.shared_runtime("other", "float32", False, "hermes2")
    with pytest.raises(ConfigError, match="dtype must be"):
        runtimes_mod.shared_runtime("other", "float16", False)
    assert len(loads) == 1  # rejected before any load
    # "auto" is keyed by its choice on this machine: it and the choice share one model.
    chosen = runtimes_mod.TargetConfig(model="m").dtype
    e = runtimes_mod.shared_runtime("m", "auto", False)
    assert e is runtimes_mod.shared_runtime("m", chosen, False) and chosen != "auto"
    assert [c.dtype for c in loads] == list(dict.fromkeys(["float32", chosen]))
    runtimes_mod.clear_runtimes()


def test_tool_format_field(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"tool_format 'qwen' is unknown; use one of "
                                          r"\['fallback', 'hermes', 'llama3_json'") as info:
        ChatAgentSpec(tool_format="qwen", store=False)
    assert type(info.value) is ConfigError  # not re-wrapped by pydantic
    requested: list[tuple[Any, ...]] = []

    def fake_shared(*args: Any) -> FakeRuntime:
        requested.append(args)
        return FakeRuntime("hi")

    monkeypatch.setattr("adapters.langchain.chat_model.shared_runtime", fake_shared)
    llm = ChatAgentSpec(tool_format="llama3_json", store=False)
    assert llm.invoke("x").content == "hi"
    assert requested == [("smollm2-135m-instruct", "auto", False, "llama3_json")]
    assert llm._identifying_params["tool_format"] == "llama3_json"
    assert llm.model_dump()["tool_format"] == "llama3_json"
    assert ChatAgentSpec(store=False)._identifying_params["tool_format"] is None
    # A given runtime has its format already: a different one cannot be honoured.
    ChatAgentSpec(runtime=FakeRuntime(), tool_format="fallback")
    with pytest.raises(ConfigError, match="'hermes' differs from the given runtime's format "
                                          "'fallback'"):
        ChatAgentSpec(runtime=FakeRuntime(), tool_format="hermes")
