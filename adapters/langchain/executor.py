"""A tool-calling agent loop: call the model, run its tool calls, feed the results back.

:class:`ToolCallingExecutor` works with any LangChain chat model that implements
``bind_tools`` and is built for :class:`~adapters.langchain.ChatAgentSpec`: every model
call of a run carries the same session id, so the suffix cache drafts each turn from
everything the run has already read and written (tool schemas, file contents, earlier
calls). A tool that raises, an unknown tool and a malformed call all come back to the model
as error ``ToolMessage`` s it can react to; none of them ends the run.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.tools import BaseTool, StructuredTool

from adapters.langchain.messages import ToolSchemaError
from agentspec.errors import ConfigError
from agentspec.types import check_id

ToolChoicePolicy = str | dict[str, Any] | Callable[[int], Any] | None


@dataclass
class ExecutorResult:
    """The outcome of one run.

    Attributes:
        messages: The whole transcript: the input, every model reply and tool result.
        output: The final answer's text ("" when the run hit the step limit).
        stopped: ``"final_answer"`` or ``"step_limit"``.
        steps: Model calls made.
        tool_errors: Tool results returned to the model as errors.
        session_id: The session (cache scope) every call of the run used.
    """

    messages: list[BaseMessage]
    output: str
    stopped: Literal["final_answer", "step_limit"]
    steps: int
    tool_errors: int
    session_id: str
    ai_messages: list[AIMessage] = field(default_factory=list)

    def speculative(self) -> dict[str, float]:
        """Totals of the run's speculative decoding numbers (models that report them)."""
        tokens = forwards = 0
        seconds = 0.0
        for msg in self.ai_messages:
            spec = msg.response_metadata.get("speculative") or {}
            tokens += int(spec.get("generated_tokens", 0))
            forwards += int(spec.get("forwards", 0))
            seconds += float((spec.get("seconds") or {}).get("total", 0.0))
        return {
            "generated_tokens": tokens, "forwards": forwards, "seconds": round(seconds, 4),
            "forwards_per_1k": round(1000.0 * forwards / tokens, 1) if tokens else 0.0,
            "tokens_per_s": round(tokens / seconds, 3) if seconds else 0.0,
        }


def _as_tool(obj: Any) -> BaseTool:
    if isinstance(obj, BaseTool):
        return obj
    if callable(obj) and not isinstance(obj, type):
        return StructuredTool.from_function(obj)
    raise ToolSchemaError(
        f"executor tools must be LangChain tools or functions it can run, got "
        f"{type(obj).__name__}; schemas alone (dicts, pydantic models) cannot be executed"
    )


class ToolCallingExecutor:
    """Runs a tool-using agent to a final answer or a step limit, in one session.

    Args:
        model: A chat model with ``bind_tools`` (``ChatAgentSpec`` for acceleration).
        tools: LangChain tools or plain functions (wrapped with ``StructuredTool``).
        max_steps: Most model calls per run.
        session_id: The run's cache scope; a fresh stable id per executor when omitted.
        system_prompt: Prepended as a ``SystemMessage`` when the input has none.
        tool_choice: ``tool_choice`` of every call, or a function of the step index
            (0-based) returning it, e.g. ``lambda step: "any" if step < 3 else None`` to
            make a small model act before it answers.

    Raises:
        ToolSchemaError: a tool that cannot be run, or two tools with one name.
        ConfigError: ``max_steps < 1`` or an invalid session id.
    """

    def __init__(
        self,
        model: BaseChatModel,
        tools: Sequence[BaseTool | Callable[..., Any]],
        *,
        max_steps: int = 8,
        session_id: str | None = None,
        system_prompt: str | None = None,
        tool_choice: ToolChoicePolicy = None,
    ) -> None:
        if max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {max_steps}")
        self.model = model
        self.tools: dict[str, BaseTool] = {}
        for t in tools:
            tool = _as_tool(t)
            if tool.name in self.tools:
                raise ToolSchemaError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self.max_steps = max_steps
        # One id for every call of every run of this executor: its cache keeps growing.
        self.session_id = check_id("session", session_id or f"executor-{uuid.uuid4().hex[:16]}")
        self.system_prompt = system_prompt
        self.tool_choice = tool_choice
        self._bound: dict[str, Runnable[Any, Any]] = {}

    # -- pieces ---------------------------------------------------------------------------

    def _model_for(self, step: int) -> Runnable[Any, Any]:
        choice = self.tool_choice(step) if callable(self.tool_choice) else self.tool_choice
        key = json.dumps(choice, sort_keys=True)
        if key not in self._bound:
            self._bound[key] = self.model.bind_tools(
                list(self.tools.values()), tool_choice=choice  # type: ignore[arg-type]
            )
        return self._bound[key]

    def _start(self, task: str | Sequence[BaseMessage]) -> list[BaseMessage]:
        messages: list[BaseMessage] = (
            [HumanMessage(task)] if isinstance(task, str) else list(task)
        )
        if self.system_prompt and not any(isinstance(m, SystemMessage) for m in messages):
            messages.insert(0, SystemMessage(self.system_prompt))
        return messages

    def _config(self, config: RunnableConfig | None) -> RunnableConfig:
        cfg: RunnableConfig = dict(config or {})  # type: ignore[assignment]
        cfg["configurable"] = {**(cfg.get("configurable") or {}), "session_id": self.session_id}
        return cfg

    @staticmethod
    def _error(call_id: str | None, name: str | None, text: str) -> ToolMessage:
        return ToolMessage(f"Error: {text}", tool_call_id=call_id or "invalid",
                           name=name, status="error")

    @staticmethod
    def _content(value: Any) -> str:
        if isinstance(value, ToolMessage):
            return str(value.content)
        if isinstance(value, str):
            return value
        return json.dumps(value, ensure_ascii=False, default=str)

    def _invalid_results(self, reply: AIMessage) -> list[ToolMessage]:
        return [
            self._error(bad.get("id"), bad.get("name"),
                        f"the tool call could not be read ({bad.get('error')}). Call the tool "
                        "again with its name and a JSON object of arguments.")
            for bad in reply.invalid_tool_calls
        ]

    def _finish(self, messages: list[BaseMessage], ais: list[AIMessage], errors: int,
                final: AIMessage | None) -> ExecutorResult:
        output = final.text if final is not None else ""
        stopped: Literal["final_answer", "step_limit"] = (
            "final_answer" if final is not None else "step_limit"
        )
        return ExecutorResult(messages, output, stopped, len(ais), errors, self.session_id, ais)

    # -- runs -----------------------------------------------------------------------------

    def invoke(
        self, task: str | Sequence[BaseMessage], config: RunnableConfig | None = None
    ) -> ExecutorResult:
        """Run the agent loop on ``task`` (a user request or a message list)."""
        messages, ais, errors = self._start(task), [], 0
        cfg = self._config(config)
        for step in range(self.max_steps):
            reply = self._model_for(step).invoke(messages, config=cfg)
            messages.append(reply)
            ais.append(reply)
            if not reply.tool_calls and not reply.invalid_tool_calls:
                return self._finish(messages, ais, errors, reply)
            for call in reply.tool_calls:
                result = self._run_tool(call, cfg)
                errors += result.status == "error"
                messages.append(result)
            bad = self._invalid_results(reply)
            errors += len(bad)
            messages.extend(bad)
        return self._finish(messages, ais, errors, None)

    async def ainvoke(
        self, task: str | Sequence[BaseMessage], config: RunnableConfig | None = None
    ) -> ExecutorResult:
        """Async :meth:`invoke` (model and tools are awaited)."""
        messages, ais, errors = self._start(task), [], 0
        cfg = self._config(config)
        for step in range(self.max_steps):
            reply = await self._model_for(step).ainvoke(messages, config=cfg)
            messages.append(reply)
            ais.append(reply)
            if not reply.tool_calls and not reply.invalid_tool_calls:
                return self._finish(messages, ais, errors, reply)
            for call in reply.tool_calls:
                result = await self._arun_tool(call, cfg)
                errors += result.status == "error"
                messages.append(result)
            bad = self._invalid_results(reply)
            errors += len(bad)
            messages.extend(bad)
        return self._finish(messages, ais, errors, None)

    def _run_tool(self, call: dict[str, Any], cfg: RunnableConfig) -> ToolMessage:
        tool = self.tools.get(call["name"])
        if tool is None:
            return self._error(call.get("id"), call["name"],
                               f"unknown tool {call['name']!r}; available: {sorted(self.tools)}")
        try:
            value = tool.invoke(call["args"], config=cfg)
        except Exception as exc:  # a tool's failure is the model's problem to handle
            return self._error(call.get("id"), tool.name, f"{type(exc).__name__}: {exc}")
        return ToolMessage(self._content(value), tool_call_id=call.get("id") or "",
                           name=tool.name)

    async def _arun_tool(self, call: dict[str, Any], cfg: RunnableConfig) -> ToolMessage:
        tool = self.tools.get(call["name"])
        if tool is None:
            return self._error(call.get("id"), call["name"],
                               f"unknown tool {call['name']!r}; available: {sorted(self.tools)}")
        try:
            value = await tool.ainvoke(call["args"], config=cfg)
        except Exception as exc:  # a tool's failure is the model's problem to handle
            return self._error(call.get("id"), tool.name, f"{type(exc).__name__}: {exc}")
        return ToolMessage(self._content(value), tool_call_id=call.get("id") or "",
                           name=tool.name)
