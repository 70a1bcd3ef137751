"""Quickstart: agentspec's accelerated embedded model as a LangChain chat model.

``ChatAgentSpec()`` runs SmolLM2-135M-Instruct on the CPU with lossless speculative decoding
from the session cache: the output is exactly the model's own greedy output, produced in
fewer forward passes when the session repeats itself. Everything else is plain LangChain.

Run: .venv/bin/python examples/langchain_quickstart.py (exits 1 if a tool call is invalid)
"""

from __future__ import annotations

import sys

from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool

from adapters.langchain import ChatAgentSpec


@tool
def get_weather(city: str) -> str:
    """Get today's weather for a city."""
    return f"It is sunny and 21 C in {city}."


def main() -> int:
    """Invoke, stream, call a tool, and read the speculative decoding numbers; return 1
    when the tool call is missing or invalid."""
    # store=False keeps the session cache in memory (no SQLite file under AGENTSPEC_HOME).
    llm = ChatAgentSpec(max_tokens=96, store=False)
    # One session id for the whole conversation: every call drafts from what it has seen.
    config: RunnableConfig = {"configurable": {"session_id": "quickstart"}}

    reply = llm.invoke("What is the capital of France?", config=config)
    print("invoke:", reply.content)

    print("stream: ", end="")
    for chunk in llm.stream("Name three colours of the rainbow.", config=config):
        print(chunk.content, end="", flush=True)
    print()

    # tool_choice names the tool: the call is decoded under the tool's parameter schema
    # (a grammar), so its arguments always parse.
    with_tools = llm.bind_tools([get_weather], tool_choice="get_weather")
    call = with_tools.invoke("What's the weather in Paris?", config=config)
    if call.invalid_tool_calls or not call.tool_calls:
        print("invalid tool call:", call.invalid_tool_calls or call.content, file=sys.stderr)
        return 1
    for tc in call.tool_calls:
        print(f"tool call: {tc['name']}({tc['args']}) -> {get_weather.invoke(tc['args'])}")

    # The same question again in the same session: the cache has seen the answer.
    again = llm.invoke("What is the capital of France?", config=config)
    stats = again.response_metadata["speculative"]
    print("usage:", again.usage_metadata)
    print(f"repeat: {stats['generated_tokens']} tokens in {stats['forwards']} forwards "
          f"({stats['forwards_per_1k']} per 1,000 tokens), accepted-length histogram "
          f"{stats['accepted_histogram']}, drafter wins {stats['drafter_wins']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
