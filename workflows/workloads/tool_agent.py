"""Tool-using agent sessions: the same tool schemas on every request, JSON tool results.

A session is a task (read a file and summarise it, compare two cities' weather, ...) with a
scripted plan of tool calls. Turn 1 sends the system prompt and the user task; every later
turn appends the model's previous output as an assistant message and the deterministic JSON
result of the planned call as a ``tool`` message. That is the repeated structure real
agents produce: identical tool schemas, growing transcripts, file contents and JSON that the
model reads and quotes.

The environment is scripted: it answers the planned call whatever the model asked for, so
every method sees the same kind of tool results (a 135M model rarely names the right file).
The assistant message is stored OpenAI-style: the output's text in ``content`` (its own
tool-call markup removed) and the planned call in ``tool_calls``, which the prompt renderer
writes back in the model's tool format, so the transcript shows exactly the call that was
answered. :meth:`ToolSession.turn_metrics` reports whether the output held a well-formed
tool call and whether it named the planned tool. Tool outputs are fakes computed from the
call's arguments (file contents come from the DELEGATE-52 fixture).

The workload speaks the model's tool format (``tool_format=``, which the benches take from
the model's tokenizer): the system prompt spells the call syntax only where the chat
template does not teach it (:attr:`ToolFormat.template_instructs`), and calls are found
by the format's parser. The default, the fallback format (SmolLM2's), gives the prompt and
transcripts this workload always had.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

from agentspec.chat.formats import FORMATS, ToolFormat, check_format_name
from agentspec.chat.formats.fallback import FallbackFormat
from agentspec.errors import BenchmarkError
from workflows.workloads.base import Message, WorkloadRequest
from workflows.workloads.datasets import data_dir as resolve_data_dir
from workflows.workloads.datasets import load_delegate52
from workflows.workloads.tools import (
    TOOLS,
    FakeTools,
    parse_tool_call,
    strip_tool_calls,
)


def system_prompt(fmt: ToolFormat | None = None) -> str:
    """The agent's system prompt for a model in tool format ``fmt`` (default: fallback).

    The call-syntax sentence is the format's own example call, and is left out where the
    chat template already teaches the syntax (Hermes/Qwen2.5, Llama 3.x, Mistral).
    """
    fmt = fmt or FallbackFormat()
    syntax = "" if fmt.template_instructs else (
        f"To call a tool, reply with exactly one line: {fmt.call_example()}. ")
    return ("You are an agent that completes tasks with tools. " + syntax
            + "Tool results come back as JSON in tool messages. When the task is done, "
            "answer the user in plain text.")


#: The prompt of the fallback format (SmolLM2's), the workload's default.
SYSTEM_PROMPT = system_prompt()

Call = tuple[str, dict[str, Any]]
_CITIES = ("Lisbon", "Oslo", "Nairobi", "Montreal", "Kyoto", "Santiago", "Reykjavik", "Perth")
_TOPICS = (
    "speculative decoding for LLM agents",
    "suffix trees for text compression",
    "KV cache eviction policies",
    "tool-calling benchmarks",
    "lossless document editing with LLMs",
)


class ToolSession:
    """One scripted tool-using conversation.

    Args:
        session_id: Id of the session.
        task: The user's request.
        plan: Builds the tool calls in order, given the fake tools (later calls may use
            earlier results).
        tools: The fake tool implementations.
        turns: Most requests (1 + number of tool results shown).
        max_tokens: Generation budget per request.
        fmt: The model's tool format (default: the fallback's ``<tool_call>`` syntax).
    """

    def __init__(
        self,
        session_id: str,
        task: str,
        plan: list[Call],
        tools: FakeTools,
        turns: int,
        max_tokens: int,
        fmt: ToolFormat | None = None,
    ) -> None:
        self.session_id = session_id
        self.task = task
        self.plan = plan
        self._tools = tools
        self.turns = min(turns, len(plan) + 1)  # requests this session will make
        self._max_tokens = max_tokens
        self._fmt = fmt  # parse/strip read the fallback by their own rules (tools.py)
        self._messages: list[Message] = [
            {"role": "system", "content": system_prompt(fmt)},
            {"role": "user", "content": task},
        ]
        self._turn = 0

    def next_request(self, last_output: str | None) -> WorkloadRequest | None:
        """Append the previous output and the planned tool's result; ``None`` when done."""
        if self._turn >= self.turns:
            return None
        if self._turn > 0:
            name, args = self.plan[self._turn - 1]
            call_id = f"call_{self._turn}"
            self._messages.append(
                {
                    "role": "assistant",
                    "content": strip_tool_calls(last_output or "", self._fmt),
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": json.dumps(args)},
                        }
                    ],
                }
            )
            result = self._tools.call(name, args)
            self._messages.append(
                {"role": "tool", "tool_call_id": call_id, "name": name,
                 "content": json.dumps(result, ensure_ascii=False)}
            )
        self._turn += 1
        planned = self.plan[self._turn - 1][0] if self._turn <= len(self.plan) else None
        return WorkloadRequest(
            messages=copy.deepcopy(self._messages),
            max_tokens=self._max_tokens,
            tools=copy.deepcopy(TOOLS),
            meta={"turn": self._turn, "planned_tool": planned},
        )

    def turn_metrics(self, request: WorkloadRequest, output: str) -> dict[str, Any]:
        """Whether the output held a tool call, and whether it was the planned one.

        Returns:
            ``tool_call_parsed``, ``tool_name``, ``planned_tool``, ``matches_plan``
            (the planned tool was called, or no tool was due and none was called) and
            ``output_chars``.
        """
        call = parse_tool_call(output, self._fmt)
        planned = request.meta.get("planned_tool")
        name = call[0] if call else None
        return {
            "tool_call_parsed": call is not None,
            "tool_name": name,
            "planned_tool": planned,
            "matches_plan": name == planned,
            "output_chars": len(output),
        }


def _summarize_file(rng: random.Random, t: FakeTools) -> tuple[str, list[Call]]:
    path = rng.choice(sorted(t.files))
    stem = path.rsplit(".", 1)[0]
    head = [ln for ln in t.files[path].splitlines() if ln.strip()][:3]
    task = f"Read `{path}` and save a three-line summary of it to `notes/{stem}.md`. " \
        "Then tell me in one sentence what the file contains."
    return task, [("read_file", {"path": path}),
                  ("write_file", {"path": f"notes/{stem}.md", "content": "\n".join(head)})]


def _weather_compare(rng: random.Random, t: FakeTools) -> tuple[str, list[Call]]:
    a, b = rng.sample(_CITIES, 2)
    unit = rng.choice(("celsius", "fahrenheit"))
    high_a = t.call("get_weather", {"city": a, "unit": unit})["forecast"][0]["high"]
    high_b = t.call("get_weather", {"city": b, "unit": unit})["forecast"][0]["high"]
    task = f"I'm flying from {a} to {b} tomorrow. How much warmer or colder will it be? " \
        f"Give the difference in {unit}."
    return task, [("get_weather", {"city": a, "unit": unit}),
                  ("get_weather", {"city": b, "unit": unit}),
                  ("calculator", {"expression": f"{high_b} - {high_a}"})]


def _research(rng: random.Random, t: FakeTools) -> tuple[str, list[Call]]:
    topic = rng.choice(_TOPICS)
    first = t.call("search", {"query": topic, "max_results": 3})["results"]
    links = "\n".join(f"- [{r['title']}]({r['url']})" for r in first)
    task = f"Find recent work on {topic} and save the most relevant links to `reading_list.md`."
    return task, [("search", {"query": topic, "max_results": 3}),
                  ("search", {"query": f"{topic} benchmark results", "max_results": 3}),
                  ("write_file", {"path": "reading_list.md", "content": links})]


def _file_stats(rng: random.Random, t: FakeTools) -> tuple[str, list[Call]]:
    path = rng.choice(sorted(t.files))
    lines = t.files[path].split("\n")
    blank = sum(1 for ln in lines if not ln.strip())
    task = f"How many lines does `{path}` have, and what percentage of them are blank? " \
        "Use the calculator for the percentage."
    return task, [("read_file", {"path": path}),
                  ("calculator", {"expression": f"{blank} / {len(lines)} * 100"})]


def _backup_edit(rng: random.Random, t: FakeTools) -> tuple[str, list[Call]]:
    path = rng.choice(sorted(t.files))
    content = t.files[path]
    task = f"Back up `{path}` as `{path}.bak`, then add a first line `# reviewed` to the " \
        "original file and save it."
    return task, [("read_file", {"path": path}),
                  ("write_file", {"path": f"{path}.bak", "content": content}),
                  ("write_file", {"path": path, "content": "# reviewed\n" + content})]


def _umbrella(rng: random.Random, t: FakeTools) -> tuple[str, list[Call]]:
    city = rng.choice(_CITIES)
    task = f"Should I pack an umbrella for {city} this weekend? Check the 3-day forecast " \
        "and look for any weather warnings."
    return task, [("get_weather", {"city": city, "unit": "celsius", "days": 3}),
                  ("search", {"query": f"{city} weather warning", "max_results": 2})]


TASK_KINDS: dict[str, Callable[[random.Random, FakeTools], tuple[str, list[Call]]]] = {
    "summarize_file": _summarize_file,
    "weather_compare": _weather_compare,
    "research": _research,
    "file_stats": _file_stats,
    "backup_edit": _backup_edit,
    "umbrella": _umbrella,
}


class ToolAgentWorkload:
    """Seeded multi-turn tool-using sessions (5-8 by default 6).

    Args:
        data_dir: Data folder for file contents (``None``: ``$AGENTSPEC_DATA`` or the
            packaged fixture).
        num_sessions: Number of sessions (1-16).
        seed: Seed of the task and argument choices.
        max_tokens: Generation budget per request.
        tool_format: The model's tool format, bound (``runtime.tool_format``,
            ``format_for(tokenizer)``) or by name (default: the fallback).

    Raises:
        BenchmarkError: ``num_sessions`` out of range.
        ConfigError: an unknown ``tool_format`` name.
    """

    name = "tool_agent"

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        num_sessions: int = 6,
        seed: int = 0,
        max_tokens: int = 192,
        tool_format: ToolFormat | str | None = None,
    ) -> None:
        if isinstance(tool_format, str):
            tool_format = FORMATS[check_format_name(tool_format)]()
        self.tool_format = tool_format
        if not 1 <= num_sessions <= 16:
            raise BenchmarkError(f"num_sessions must be in [1, 16], got {num_sessions}")
        domains = load_delegate52(resolve_data_dir(data_dir))
        self.files = {d.seed_file: d.seed_excerpt for d in domains}
        self.num_sessions = num_sessions
        self.seed = seed
        self.max_tokens = max_tokens

    def sessions(self, limit: int | None, turns: int) -> Iterator[ToolSession]:
        """Fresh sessions, identical for the same seed (at most ``limit``, ``turns`` each).

        Raises:
            BenchmarkError: ``turns`` < 1 or ``limit`` < 0.
        """
        if turns < 1 or (limit is not None and limit < 0):
            raise BenchmarkError(f"need turns >= 1 and limit >= 0, got {turns=} {limit=}")
        rng = random.Random(self.seed)
        kinds = list(TASK_KINDS)
        rng.shuffle(kinds)  # every kind appears once before any repeats
        count = self.num_sessions if limit is None else min(limit, self.num_sessions)
        for i in range(count):
            kind = kinds[i % len(kinds)]
            tools = FakeTools(self.files)
            task, plan = TASK_KINDS[kind](rng, tools)
            session_id = re.sub(r"[^A-Za-z0-9_.:@-]", "-", f"tool_agent-{i}-{kind}")
            yield ToolSession(session_id, task, plan, tools, turns, self.max_tokens,
                              self.tool_format)
