"""One chat turn as a request: everything a runtime needs to answer it.

:class:`ChatTurn` is the one request type of a chat completion. Both runtimes take it
(:meth:`agentspec.chat.base.BaseChatRuntime.stream_turn`: agentspec's engine and the vLLM
backend), and the faces build it: the OpenAI-compatible server's job wraps one, as does
the LangChain adapter's request, beside what only they need (a tenant's queue, a deadline,
retries). The keyword form ``runtime.chat(messages, tools, max_tokens=...)`` builds one
from its keywords, so the field names below are also the keywords of ``chat`` and
``stream_chat``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentspec.spec import AgentSpec
from agentspec.types import SamplingParams, SessionRef

__all__ = ["ChatTurn", "ToolChoice"]

#: OpenAI's ``tool_choice``: ``None``/``"auto"`` (the model decides), ``"none"`` (no call),
#: ``"required"``/``"any"`` (some call) or a tool's name (``"name"`` or
#: ``{"type": "function", "function": {"name": ...}}``).
ToolChoice = str | dict[str, Any] | None


@dataclass(frozen=True)
class ChatTurn:
    """One chat completion request.

    Frozen: a face that needs a variant (the server adds the running request's ``cancel``
    event) makes one with :func:`dataclasses.replace`.

    Attributes:
        messages: Chat messages (role/content dicts, tool calls and results included).
        tools: OpenAI tool schemas rendered into the prompt (``None``: no tools).
        tool_choice: See :data:`ToolChoice`; a forced call is written into the answer's
            opening, or constrained by a grammar under ``spec.constrained_tool_calls``.
        session: Cache scope of the turn (``None``: a one-off request, never stored).
        spec: The agent's drafting and verification policy (``None``: the runtime's
            default spec).
        max_tokens: Most tokens to generate.
        stop: Stop strings; the answer ends before the first one.
        sampling: Sampling settings (``None``: the spec's verifier's).
        assistant_prefix: Text that opens the answer (part of the prompt; the deltas and
            the result's text start with it), before any call ``tool_choice`` forces.
        response_format: OpenAI's ``response_format`` (``json_object`` / ``json_schema``
            constrain the answer to a grammar; ``None``: free text).
        cancel: Set from another thread to stop the turn with
            :class:`~agentspec.errors.Cancelled` at the runtime's next check (agentspec's
            runtime checks between prefill chunks and decode steps; a runtime may check it
            only per delta). Nothing of a cancelled turn is stored.
    """

    messages: Sequence[dict[str, Any]]
    tools: Sequence[dict[str, Any]] | None = None
    tool_choice: ToolChoice = None
    session: SessionRef | None = None
    spec: AgentSpec | None = None
    max_tokens: int = 256
    stop: Sequence[str] = ()
    sampling: SamplingParams | None = None
    assistant_prefix: str = ""
    response_format: Any = None
    cancel: threading.Event | None = field(default=None, compare=False)

    @property
    def tools_active(self) -> bool:
        """Tools are bound and calls may be made (``tool_choice="none"`` makes none: the
        tools leave the prompt and the answer is not parsed for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def parsed_tools(self) -> Sequence[dict[str, Any]] | None:
        """The tools the answer is parsed against (``None`` under ``tool_choice="none"``)."""
        return self.tools if self.tool_choice != "none" else None
