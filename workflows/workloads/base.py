"""What a workload is: sessions of chat requests whose next turn may depend on the model's
previous output (a DELEGATE-52 relay feeds each output back as the next document).

Every method in a benchmark replays fresh copies of the same sessions, so lossless methods
see identical prompts turn after turn and their outputs can be compared token by token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentspec.chat.api import chat_prompt_ids

Message = dict[str, Any]  # {"role": "system"|"user"|"assistant"|"tool", "content": str, ...}


@dataclass(frozen=True)
class WorkloadRequest:
    """One model call of a session.

    Attributes:
        messages: Chat messages (rendered with the model's chat template).
        max_tokens: Most tokens to generate.
        stop: Stop strings.
        tools: OpenAI-style tool schemas rendered into the prompt, or ``None``.
        meta: Workload-specific data carried into the per-turn records (e.g. edit name).
        prefix: Text that opens the assistant turn (e.g. a file's opening fence). It is
            part of the prompt, and the turn's output text starts with it when it is fed
            back to the session.
    """

    messages: list[Message]
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    prefix: str = ""

    def prompt_ids(self, tokenizer: Any) -> list[int]:
        """The rendered prompt: chat template, tools, then the assistant prefix's tokens."""
        return chat_prompt_ids(tokenizer, self.messages, self.tools, None, self.prefix)[0]


class Session(Protocol):
    """A scripted multi-turn conversation."""

    session_id: str

    def next_request(self, last_output: str | None) -> WorkloadRequest | None:
        """The next request given the previous turn's output text (``None`` before the
        first turn); ``None`` when the session is over."""
        ...

    def turn_metrics(self, request: WorkloadRequest, output: str) -> dict[str, Any]:
        """Workload-specific quality numbers for one turn (e.g. tests passed)."""
        ...


class Workload(Protocol):
    """A named family of sessions."""

    name: str

    def sessions(self, limit: int | None, turns: int) -> Iterable[Session]:
        """Fresh sessions (at most ``limit``; each at most ``turns`` requests)."""
        ...


class ScriptedSession:
    """A session whose requests do not depend on the outputs (fixed prompts).

    Args:
        session_id: Id of the session.
        requests: The requests in order.
    """

    def __init__(self, session_id: str, requests: list[WorkloadRequest]) -> None:
        self.session_id = session_id
        self._requests = list(requests)
        self._i = 0

    def next_request(self, last_output: str | None) -> WorkloadRequest | None:
        """The next fixed request."""
        if self._i >= len(self._requests):
            return None
        self._i += 1
        return self._requests[self._i - 1]

    def turn_metrics(self, request: WorkloadRequest, output: str) -> dict[str, Any]:
        """No quality metric for fixed prompts."""
        return {}
