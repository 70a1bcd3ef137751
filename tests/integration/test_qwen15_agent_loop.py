"""A stock LangChain agent loop on the 1.5B, in process and through the server.

``langchain.agents.create_agent`` with no guard node, no middleware and no system prompt,
two tools, ``temperature=0``: once over ``ChatAgentSpec(model="qwen2.5-coder-1.5b-instruct")``
and once over langchain-openai's ``ChatOpenAI`` against ``agentspec serve`` on loopback
(the same loaded model). Both loops must make the same calls and say the same things, token
for token: the server adds nothing to the model's answers and loses nothing of its calls.

What the loop then does is the model's: the 1.5B (Q4_K_M, greedy) calls the right tool
with the right argument, and after the tool's answer calls it again (docs/usage.md, "Stock
agent loops"). This test pins the first call and the two paths' agreement, not the repeat.
"""

from __future__ import annotations

from typing import Any

import pytest
from server_harness import serving

from adapters.langchain import ChatAgentSpec
from adapters.langchain.runtimes import shared_runtime
from adapters.openai_server import ServerConfig
from agentspec.models import LOOP_MODEL, SHIPPED_MODELS
from agentspec.runtime import Runtime

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not SHIPPED_MODELS[LOOP_MODEL].installed,
                       reason=f"the chunks of {LOOP_MODEL} are not installed (`make qwen15`)"),
]

WEATHER = {"Tokyo": "Sunny, 22 C", "Paris": "Rainy, 12 C", "Lima": "Cloudy, 18 C"}
POPULATION = {"Tokyo": "13,960,000", "Paris": "2,103,000", "Lima": "10,004,000"}
QUESTION = "What is the weather in Lima?"
MAX_TOKENS = 96  # both clients name it: the server's default (256) is not ChatAgentSpec's


def _tools() -> list[Any]:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return WEATHER.get(city, "unknown city")

    @tool
    def get_population(city: str) -> str:
        """Get the population of a city."""
        return POPULATION.get(city, "unknown city")

    return [get_weather, get_population]


def _transcript(llm: Any, question: str) -> list[tuple[str, str, list[tuple[str, Any]]]]:
    """Run the stock loop; each message as (kind, text, [(tool, args)]) without call ids
    (each client makes its own)."""
    from langchain.agents import create_agent

    agent = create_agent(llm, _tools())
    state = agent.invoke({"messages": [("user", question)]}, {"recursion_limit": 12})
    return [(type(m).__name__, str(m.content),
             [(c["name"], c["args"]) for c in getattr(m, "tool_calls", [])])
            for m in state["messages"]]


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    """The process-wide runtime ``ChatAgentSpec(model=LOOP_MODEL, store=False)`` uses."""
    return shared_runtime(LOOP_MODEL, "auto", store=False)


def test_stock_loop_in_process_and_through_the_server_agree(runtime: Runtime) -> None:
    from langchain_openai import ChatOpenAI

    local = _transcript(ChatAgentSpec(model=LOOP_MODEL, temperature=0, store=False,
                                      max_tokens=MAX_TOKENS), QUESTION)
    with serving(runtime, ServerConfig()) as server:
        remote = ChatOpenAI(model=LOOP_MODEL, base_url=server.base_url,
                            api_key="local", temperature=0,  # type: ignore[arg-type]
                            max_tokens=MAX_TOKENS, max_retries=0, timeout=600)
        served = _transcript(remote, QUESTION)
    assert served == local
    # The model's first decision: the right tool, the right argument; the tool's answer
    # reaches the model as the next message.
    assert local[1] == ("AIMessage", "", [("get_weather", {"city": "Lima"})])
    assert local[2][:2] == ("ToolMessage", WEATHER["Lima"])
    assert local[-1][0] == "AIMessage" and not local[-1][2]  # the loop ended on an answer
