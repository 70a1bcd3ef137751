"""A LangGraph agent on agentspec: a tool loop graph with a checkpointer.

The graph is the classic agent: a model node that may call tools, a ``ToolNode`` that runs
them, and an edge back to the model until it answers. LangGraph's ``thread_id`` becomes the
agentspec session id, so every model call of every turn in the thread drafts from the same
session cache — no extra wiring. (``langchain.agents.create_agent(ChatAgentSpec(), tools)``
builds the same loop in one line.)

Run: .venv/bin/python examples/langgraph_agent.py (exits 1 on an invalid tool call, or
if no tool was called)
"""

from __future__ import annotations

import sys

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from adapters.langchain import ChatAgentSpec

SYSTEM = (
    'To call a tool, reply with <tool_call>{"name": <tool name>, "arguments": {...}}'
    "</tool_call>. Use get_population for population questions."
)


@tool
def get_population(city: str) -> str:
    """Look up the population of a city."""
    table = {"paris": "2.1 million", "lisbon": "0.55 million", "oslo": "0.71 million"}
    return table.get(city.strip().lower(), "unknown")


def build_agent(llm: ChatAgentSpec) -> object:
    """Model node + tool node + checkpointer, compiled."""
    decide = llm.bind_tools([get_population])
    # A 135M model seldom decides to call a tool by itself: the first call of each user turn
    # is forced to call it (decoded under the tool's parameter schema, so it always parses);
    # later calls are free, and a call the model opens there is constrained the same way.
    act = llm.bind_tools([get_population], tool_choice="get_population")

    def call_model(state: MessagesState, config: RunnableConfig) -> dict[str, list]:
        model = act if isinstance(state["messages"][-1], HumanMessage) else decide
        # The thread_id in `config` is read by ChatAgentSpec as the session id.
        return {"messages": [model.invoke([SystemMessage(SYSTEM), *state["messages"]], config)]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([get_population]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile(checkpointer=InMemorySaver())


def main() -> int:
    """Two turns in one LangGraph thread; print the transcript, each tool call with its
    result, and the speculative numbers. Return 1 on an invalid call or no call at all."""
    agent = build_agent(ChatAgentSpec(max_tokens=96, store=False))
    config: RunnableConfig = {"configurable": {"thread_id": "langgraph-demo"},
                              "recursion_limit": 8}
    valid = invalid = 0
    for question in ("What is the population of Paris?", "And the population of Oslo?"):
        state = agent.invoke({"messages": [HumanMessage(question)]}, config)  # type: ignore[attr-defined]
        turn = state["messages"][state["messages"].index(
            next(m for m in reversed(state["messages"]) if isinstance(m, HumanMessage))):]
        results = {m.tool_call_id: m.content for m in turn if isinstance(m, ToolMessage)}
        for msg in turn:
            if isinstance(msg, AIMessage):
                for tc in msg.tool_calls:
                    valid += 1
                    print(f"tool call: {tc['name']}({tc['args']}) -> {results.get(tc['id'])!r}")
                for bad in msg.invalid_tool_calls:
                    invalid += 1
                    print(f"INVALID tool call: {bad}", file=sys.stderr)
        last = state["messages"][-1]
        print(f"{type(last).__name__}: {last.content!r}")
        stats = last.response_metadata.get("speculative", {})
        print(f"  session {stats.get('session_id')}: {stats.get('generated_tokens')} tokens, "
              f"{stats.get('forwards')} forwards\n")
    if invalid or not valid:
        print(f"{valid} valid and {invalid} invalid tool calls", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
