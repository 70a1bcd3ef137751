"""A multi-turn tool-using agent that edits a DELEGATE-52 document through file tools.

The agent gets ``list_files`` / ``read_file`` / ``write_file`` over an in-memory folder that
holds one DELEGATE-52 seed document, and relays the domain's reversible edits: forward edit,
backward edit, ... — one LangChain conversation, one agentspec session. Every turn re-reads
the file and writes it back whole, so most of what the model writes (file contents, tool-call
JSON) is already in the session cache: the suffix drafter commits many tokens per forward.

Run:
    .venv/bin/python examples/langchain_delegate52_agent.py --domain subtitles --turns 2
    .venv/bin/python examples/langchain_delegate52_agent.py --compare   # vs. no drafting

``--compare`` runs the same agent with drafting method "none" and checks that both runs
produced the same tokens (lossless), then prints the speed-up.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.tools import BaseTool, StructuredTool

from adapters.langchain import ChatAgentSpec, ExecutorResult, ToolCallingExecutor
from agentspec.spec import AgentSpec, DraftingPolicy
from workflows.workloads.datasets import Domain, data_dir, load_delegate52

SYSTEM = (
    "You are a careful document-editing agent. Use the tools: read a file with read_file, "
    "then save the complete edited file with write_file. Answer briefly when done."
)


def file_tools(files: dict[str, str]) -> list[BaseTool]:
    """``list_files``, ``read_file`` and ``write_file`` over the in-memory folder ``files``."""

    def list_files() -> str:
        """List the files in the working folder."""
        return json.dumps(sorted(files))

    def read_file(path: str) -> str:
        """Return the full text of a file."""
        if path not in files:
            raise FileNotFoundError(f"no file {path!r}; files: {sorted(files)}")
        return files[path]

    def write_file(path: str, content: str) -> str:
        """Replace a file's text with content (creates the file if needed)."""
        files[path] = content
        return f"wrote {len(content)} characters to {path}"

    return [StructuredTool.from_function(f) for f in (list_files, read_file, write_file)]


def schedule(step: int) -> str | None:
    """Tool choice per step: read first, then write; afterwards the model decides."""
    return {0: "read_file", 1: "write_file"}.get(step)


@dataclass
class RelayRun:
    """One relay: per-turn executor results plus the final folder."""

    results: list[ExecutorResult] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def token_ids(self) -> list[list[int]]:
        """Generated token ids of every model call, in order."""
        return [m.response_metadata.get("token_ids", []) for r in self.results
                for m in r.ai_messages]

    def totals(self) -> dict[str, float]:
        """Generated tokens, target forwards and engine seconds over the whole relay."""
        parts = [r.speculative() for r in self.results]
        tokens = sum(p["generated_tokens"] for p in parts)
        forwards = sum(p["forwards"] for p in parts)
        seconds = sum(p["seconds"] for p in parts)
        return {"calls": sum(r.steps for r in self.results), "generated_tokens": tokens,
                "forwards": forwards, "engine_seconds": round(seconds, 3),
                "tokens_per_forward": round(tokens / forwards, 3) if forwards else 0.0}


def relay(
    llm: ChatAgentSpec, domain: Domain, turns: int = 2, session_id: str = "delegate52",
    on_turn: Callable[[int, str, ExecutorResult], Any] | None = None,
) -> RelayRun:
    """Relay ``turns`` instructions of ``domain`` (forward, backward, forward, ...).

    Args:
        llm: The chat model (its ``max_tokens`` bounds each call, e.g. a whole file).
        domain: A DELEGATE-52 domain (seed document + reversible edits).
        turns: Instructions to relay, each a user turn of one growing conversation.
        session_id: The agentspec session every call of the relay shares.
        on_turn: Called after each turn with (turn index, instruction, result).
    """
    run = RelayRun(files={domain.seed_file: domain.seed_excerpt})
    executor = ToolCallingExecutor(llm, file_tools(run.files), max_steps=3,
                                   session_id=session_id, system_prompt=SYSTEM,
                                   tool_choice=schedule)
    messages: list[BaseMessage] = []
    t0 = time.perf_counter()
    for turn in range(turns):
        edit = domain.edits[(turn // 2) % len(domain.edits)]
        instruction = edit.forward if turn % 2 == 0 else edit.backward
        task = f"File {domain.seed_file}: {instruction}"
        result = executor.invoke([*messages, HumanMessage(task)])
        messages = result.messages
        run.results.append(result)
        if on_turn is not None:
            on_turn(turn, instruction, result)
    run.seconds = time.perf_counter() - t0
    return run


def make_llm(method: str, max_tokens: int, store: bool | str = False) -> ChatAgentSpec:
    """The accelerated chat model with drafting ``method`` (``suffix`` or ``none``)."""
    spec = AgentSpec(name="editor", drafting=DraftingPolicy(method=method))  # type: ignore[arg-type]
    return ChatAgentSpec(agent_spec=spec, max_tokens=max_tokens, store=store,
                         return_token_ids=True)


def main() -> None:
    """Run the relay on one domain and print what the agent did and how fast."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--domain", default="subtitles")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--compare", action="store_true", help="also run without drafting")
    args = ap.parse_args()
    domains = {d.domain: d for d in load_delegate52(data_dir())}
    domain = domains[args.domain]

    def show(turn: int, instruction: str, result: ExecutorResult) -> None:
        calls = [c["name"] for m in result.ai_messages for c in m.tool_calls]
        print(f"turn {turn + 1}: {instruction[:70]}...\n  tool calls {calls}, "
              f"{result.stopped}, {result.tool_errors} tool errors, {result.speculative()}")

    fast = relay(make_llm("suffix", args.max_tokens), domain, args.turns, "d52-suffix", show)
    print("suffix drafting:", fast.totals(), f"{fast.seconds:.1f} s")
    print(f"--- {domain.seed_file} after the relay ---\n{fast.files[domain.seed_file]}")
    if args.compare:
        base = relay(make_llm("none", args.max_tokens), domain, args.turns, "d52-none")
        print("no drafting:   ", base.totals(), f"{base.seconds:.1f} s")
        print("token-identical:", base.token_ids() == fast.token_ids(),
              f"speed-up {base.totals()['engine_seconds'] / fast.totals()['engine_seconds']:.2f}x")


if __name__ == "__main__":
    main()
