"""The chat turn's shared skeleton, its request type and its result stream: a runtime
supplies only its decode; results are returned (``stream.result``), never appended; a
runtime takes its target's lock. No model is loaded."""

from __future__ import annotations

import threading
from collections.abc import Generator
from types import SimpleNamespace
from typing import Any

import pytest
from test_tool_formats import FAMILIES, TEMPLATES, WEATHER, byte_tokenizer

from agentspec.chat.base import BaseChatRuntime, Decoded, TurnPlan
from agentspec.chat.formats import choose_tool_format
from agentspec.chat.stream import ResultStream
from agentspec.chat.turn import ChatTurn
from agentspec.errors import RequestStateError
from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec
from agentspec.types import RequestStats

MSGS = [{"role": "user", "content": "Weather in Oslo?"}]


def _steps(result: int) -> Generator[str, None, int]:
    yield "a"
    yield "b"
    return result


def test_result_stream_returns_the_generators_value() -> None:
    stream = ResultStream(_steps(7))
    with pytest.raises(RequestStateError, match="iterate it to the end"):
        _ = stream.result
    assert list(stream) == ["a", "b"] and stream.finished and stream.result == 7
    assert list(stream) == [] and stream.result == 7  # exhausted: stays so
    assert ResultStream(_steps(3)).drain() == 3


def test_a_closed_stream_has_no_result() -> None:
    stream = ResultStream(_steps(7))
    assert next(stream) == "a"
    with stream:
        pass  # leaving the block closes it
    assert list(stream) == [] and not stream.finished
    with pytest.raises(RequestStateError):
        _ = stream.result


class Scripted(BaseChatRuntime[str]):
    """A runtime whose decode answers a fixed text; records what the skeleton planned."""

    def __init__(self, answer: str, grammar: str | None = None) -> None:
        template, eos, special, added = FAMILIES["hermes"]
        self.tokenizer = byte_tokenizer((TEMPLATES / template).read_text(), eos, special, added)
        self.tool_format = choose_tool_format(self.tokenizer, None)
        self.default_spec = AgentSpec()
        self.answer, self.grammar = answer, grammar
        self._lock = threading.RLock()
        self.plans: list[TurnPlan[str]] = []
        self.locked: list[bool] = []

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def grammar_for(self, turn: ChatTurn, spec: AgentSpec) -> str | None:
        return self.grammar

    def begin_decode(self, plan: TurnPlan[str]) -> Generator[str, None, Decoded]:
        self.plans.append(plan)
        return self._decode()

    def _decode(self) -> Generator[str, None, Decoded]:
        self.locked.append(self._lock._is_owned())  # type: ignore[attr-defined]
        yield self.answer
        return Decoded(self.answer, [1, 2], "stop", RequestStats(), stored=True)


def test_the_skeleton_plans_opens_decodes_and_parses() -> None:
    call = '{"city": "Oslo"}}</tool_call>'
    rt = Scripted(call)
    stream = rt.stream_chat(MSGS, [WEATHER], tool_choice="get_weather", stop=["END"])
    deltas = list(stream)
    plan = rt.plans[0]
    # The forced call's opening is the first delta, rendered into the prompt too.
    assert deltas[0].startswith("<tool_call>") and deltas[1] == call and rt.locked == [True]
    assert plan.stop == ["END", *rt.tool_format.stop] and plan.spec is rt.default_spec
    assert plan.sampling == rt.default_spec.verifier.sampling()
    result = stream.result
    assert result.text == "".join(deltas) and result.finish_reason == "tool_calls"
    assert [c.name for c in result.tool_calls] == ["get_weather"] and result.stored is True
    assert result.prompt_tokens == len(plan.prompt)
    assert rt.chat(MSGS, [WEATHER], tool_choice="none").tool_calls == []  # not parsed


def test_a_grammar_that_forces_the_call_writes_its_opening() -> None:
    rt = Scripted('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
                  grammar="call")
    forced = rt.chat(MSGS, [WEATHER], tool_choice="required")
    assert forced.text == rt.answer  # no forced prefix: the grammar writes it
    plain, _ = rt.prompt_ids(MSGS, [WEATHER])
    assert rt.plans[0].prompt == plain


def test_keywords_build_the_turn() -> None:
    rt = Scripted("hi")
    cancel = threading.Event()
    rt.chat(MSGS, max_tokens=3, assistant_prefix="> ", cancel=cancel)
    turn = rt.plans[0].turn
    assert turn == ChatTurn(MSGS, max_tokens=3, assistant_prefix="> ")
    assert turn.cancel is cancel
    with pytest.raises(TypeError):
        rt.chat(MSGS, result=[])  # no out-parameter: the result is returned


def test_runtimes_over_one_target_take_its_lock() -> None:
    template, eos, special, added = FAMILIES["hermes"]
    tok = byte_tokenizer((TEMPLATES / template).read_text(), eos, special, added)
    target: Any = SimpleNamespace(tokenizer=tok, lock=threading.RLock())
    a, b = Runtime(target), Runtime(target, tool_format="fallback")
    assert a.lock is b.lock is target.lock
    with pytest.raises(AttributeError):
        a.lock = threading.RLock()  # type: ignore[misc]  # the target owns it


def test_a_failed_stream_has_no_result() -> None:
    def failing() -> Generator[str, None, int]:
        yield "a"
        raise RequestStateError("boom")

    stream = ResultStream(failing())
    with pytest.raises(RequestStateError, match="boom"):
        list(stream)
    assert list(stream) == [] and not stream.finished
