"""The agent-grade shipped model in its own dialect: Qwen2.5-Coder-0.5B-Instruct renders,
calls and is constrained in the Hermes format of its chat template.

Qwen's greedy decoding is several times slower than SmolLM2's on a CPU, so these tests are
few and short (one weather question, answers of at most 40 tokens).
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from server_harness import serving

from adapters.langchain import ChatAgentSpec
from adapters.openai_server import ServerConfig
from agentspec.models import AGENT_MODEL
from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.types import SessionRef

pytestmark = pytest.mark.integration

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What's the weather in Paris right now?"}]
TAG_OPEN, TAG_CLOSE = 151657, 151658


def _paris(name: str, args: dict[str, Any]) -> None:
    assert name == "get_weather" and args.get("city", "").lower().startswith("paris"), args


def test_format_tags_and_prompt_tokens_are_the_templates(qwen_runtime: Runtime) -> None:
    rt = qwen_runtime
    assert rt.tool_format.name == "hermes"
    assert rt.tool_format.tag_ids == {"<tool_call>": TAG_OPEN, "</tool_call>": TAG_CLOSE}
    # A multi-turn conversation with parallel calls (arguments as JSON text, as OpenAI
    # clients send them) and their results renders exactly as the template does.
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"temp_c": 18}'},
        {"role": "tool", "tool_call_id": "call_b", "content": '{"temp_c": 24}'},
        {"role": "assistant", "content": "Paris 18 C, Rome 24 C."},
        {"role": "user", "content": "And Oslo?"},
    ]
    ids, prefix = rt.prompt_ids(messages, [WEATHER])
    reference = json.loads(json.dumps(messages))
    for call in reference[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = rt.tokenizer.apply_chat_template(reference, tools=[WEATHER], tokenize=True,
                                                add_generation_prompt=True, return_dict=False)
    assert prefix == "" and ids == list(expected)
    # Two tags in the template's own instructions, two calls.
    assert ids.count(TAG_OPEN) == 4 and ids.count(TAG_CLOSE) == 4


def test_forced_grammar_accepts_the_models_own_tag_token(qwen_runtime: Runtime) -> None:
    rt = qwen_runtime
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = list(rt.tokenizer.encode(call, add_special_tokens=False))
    assert ids[0] == TAG_OPEN and ids[-1] == TAG_CLOSE
    for choice in ("required", "get_weather"):
        grammar = rt.tool_format.grammar([WEATHER], choice)
        assert grammar is not None
        assert rt.grammars.constraint(grammar).matcher.validate_tokens(ids) == len(ids)
        spelled = [t for ch in "<tool_call>" for t in rt.tokenizer.encode(ch)]
        assert rt.grammars.constraint(grammar).matcher.validate_tokens(spelled) == 0


def test_weather_question_gives_a_parsed_call_from_the_runtime(qwen_runtime: Runtime) -> None:
    result = qwen_runtime.chat(QUESTION, [WEATHER], max_tokens=40)
    assert len(result.tool_calls) == 1 and result.finish_reason == "tool_calls", result.text
    _paris(result.tool_calls[0].name, result.tool_calls[0].arguments)


def test_weather_question_through_the_server(qwen_runtime: Runtime) -> None:
    with serving(qwen_runtime, ServerConfig()) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                               timeout=600)
        reply = client.chat.completions.create(
            model=AGENT_MODEL, messages=QUESTION, tools=[WEATHER], max_tokens=40)  # type: ignore[arg-type,list-item]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    fn = choice.message.tool_calls[0].function  # type: ignore[union-attr]
    _paris(fn.name, json.loads(fn.arguments))


def test_weather_question_through_chat_agentspec(qwen_runtime: Runtime) -> None:
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    # fp32 by name: the fixture's runtime (one Qwen load), not a second model in "auto".
    llm = ChatAgentSpec(model=AGENT_MODEL, dtype="float32", store=False, max_tokens=40)
    reply = llm.bind_tools([get_weather]).invoke(QUESTION[0]["content"])
    assert reply.response_metadata["speculative"]["dtype"] == qwen_runtime.target.dtype
    assert len(reply.tool_calls) == 1, reply.content
    _paris(reply.tool_calls[0]["name"], reply.tool_calls[0]["args"])


@pytest.mark.slow
def test_constrained_suffix_equals_constrained_greedy(qwen_runtime: Runtime) -> None:
    """A forced call (the grammar opens with the tag token) under suffix drafts is token for
    token the constrained greedy answer, also when the session cache drafts it whole."""
    rt = qwen_runtime
    greedy = AgentSpec(drafting=DraftingPolicy(method="none"))
    # Ungated: the draft gate's choices follow the machine's load, so a forward count
    # under it would be a timing.
    suffix = AgentSpec(drafting=DraftingPolicy(method="suffix", max_draft=16,
                                               draft_gate=False))
    ask = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 32}
    ref = rt.chat(QUESTION, spec=greedy, **ask)
    assert ref.tokens[0] == TAG_OPEN and ref.tool_calls
    session = SessionRef("qwen-constrained")
    first = rt.chat(QUESTION, spec=suffix, session=session, **ask)
    again = rt.chat(QUESTION, spec=suffix, session=session, **ask)
    assert first.tokens == ref.tokens and again.tokens == ref.tokens
    assert again.stats.forwards < len(again.tokens) // 2  # the cache drafted the call


@pytest.mark.slow
def test_langgraph_example_calls_tools_and_finishes() -> None:
    """examples/langgraph_agent.py: the model picks its tools, every call parses, and both
    turns end with an answer (the example exits 1 otherwise). In the default precision,
    auto, as ``make demo`` runs it (w8a16 on a CPU: its own model, not the fp32 fixture's)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "langgraph_agent.py"
    spec = importlib.util.spec_from_file_location("langgraph_agent", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--model", AGENT_MODEL]) == 0
