"""Where ``agentspec drive`` gets its sessions: logged agent runs, or the live tool agent.

A driven session hands out one prompt per assistant turn. A logged run's prompts are fixed
by its log (the history holds the *logged* answers, whatever the model wrote). The tool
agent is live: every turn appends the model's own previous answer and the scripted tool
result, as an agent framework would, so the next prompt starts with the previous prompt and
the model's answer (as far as the chat template writes the answer back as the model wrote
it: the call markup is re-rendered from the parsed call) and that KV is reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agentspec.chat.formats import format_for
from agentspec.errors import BenchmarkError
from agentspec.types import SessionRef
from workflows.replay.logs import ReplaySession
from workflows.workloads.tool_agent import ToolAgentWorkload, ToolSession

#: Where the sessions come from: the logged runs given as ``traces``, or the tool agent.
WORKLOADS = ("traces", "tool_agent")


@dataclass(frozen=True)
class DrivenTurn:
    """One assistant turn of a driven session, as token ids and as a chat request.

    Attributes:
        prompt: The rendered prompt (what the engine-level path feeds).
        messages: The history an agent framework sends a chat API for this turn.
        tools: The tool schemas it sends with them.
        prefix: Text that opens the answer (the tool agent's forced opening).
    """

    prompt: list[int]
    messages: tuple[dict[str, Any], ...] = ()
    tools: list[dict[str, Any]] | None = None
    prefix: str = ""


class DrivenSession(Protocol):
    """One live session of a driven bench."""

    @property
    def name(self) -> str:
        """The session's name in reports."""
        ...

    @property
    def ref(self) -> SessionRef:
        """The session the requests belong to (the bench gives each variant a tenant)."""
        ...

    def next_turn(self, last_output: Sequence[int] | None) -> DrivenTurn | None:
        """The next assistant turn, given the tokens the model wrote on the previous one
        (``None`` on the first turn); ``None`` when the session is over."""
        ...


@dataclass(frozen=True)
class LoggedRequest:
    """One driven turn: the logged prompt as token ids (no chat rendering, no tools).

    The vLLM bench's ``run_concurrent`` sends ``prompt_ids`` as they are; the other fields
    are those of a workload request (no stop strings: the answer ends at EOS or
    ``max_tokens``).
    """

    prompt_ids: list[int]
    max_tokens: int
    turn_index: int
    messages: tuple[dict[str, Any], ...] = ()
    tools: None = None
    stop: tuple[str, ...] = ()
    prefix: str = ""


@dataclass
class LoggedSession:
    """A logged run as a chain of its selected turns; the answers do not change the next
    prompt (the logged history goes on with the logged answer).

    ``agentspec drive`` asks it for prompts (:meth:`next_prompt`), the vLLM bench for
    requests (:meth:`next_request`).

    Attributes:
        session: The tokenised run.
        turn_indices: Its selected turns, in order.
        max_tokens: Budget of every answer (in the requests).
        served: Turns handed out so far.
    """

    session: ReplaySession
    turn_indices: list[int]
    max_tokens: int = 64
    served: int = field(default=0)

    @property
    def name(self) -> str:
        return self.session.name

    @property
    def ref(self) -> SessionRef:
        return self.session.ref

    def _next_turn(self) -> int | None:
        """The next selected turn's index (advancing), or ``None`` after the last."""
        if self.served >= len(self.turn_indices):
            return None
        self.served += 1
        return self.turn_indices[self.served - 1]

    def next_turn(self, last_output: Sequence[int] | None) -> DrivenTurn | None:
        i = self._next_turn()
        if i is None:
            return None
        turn = self.session.turns[i]
        return DrivenTurn(turn.prompt, turn.messages, self.session.tools)

    def next_request(self, last: str | None) -> LoggedRequest | None:
        """The next logged turn as a request (``last``, the model's previous answer, is not
        used), or ``None`` after the last."""
        del last
        i = self._next_turn()
        if i is None:
            return None
        return LoggedRequest(list(self.session.turns[i].prompt), self.max_tokens, i)


def logged_sessions(selected: Sequence[tuple[ReplaySession, int]],
                    max_tokens: int = 64) -> list[LoggedSession]:
    """Group :func:`~workflows.bench.driven.driven_turns`' ``(run, turn)`` pairs by run,
    keeping file order."""
    out: list[LoggedSession] = []
    for run, i in selected:
        if not out or out[-1].session is not run:
            out.append(LoggedSession(run, [], max_tokens))
        out[-1].turn_indices.append(i)
    return out


@dataclass
class ToolAgentSession:
    """A live tool-agent session: the model's answers go into its own history.

    Args:
        session: The scripted session (task, planned calls, fake tools).
        tokenizer: Renders each request with the model's chat template and tool format.
        max_prompt: The session ends before a prompt whose tokens plus ``max_tokens`` would
            not fit.
        max_tokens: The answer budget of every turn.
    """

    session: ToolSession
    tokenizer: Any
    max_prompt: int
    max_tokens: int
    ref: SessionRef = field(init=False)
    _prefix: str | None = None
    _done: bool = False

    def __post_init__(self) -> None:
        self.ref = SessionRef(self.session.session_id)

    @property
    def name(self) -> str:
        return self.session.session_id

    def next_turn(self, last_output: Sequence[int] | None) -> DrivenTurn | None:
        if self._done:
            return None
        text = None
        if last_output is not None:
            # The output as the framework shows it back: the opening the prompt held, then
            # the decoded answer (the session strips its call markup itself).
            body = self.tokenizer.decode(list(last_output), skip_special_tokens=True)
            text = (self._prefix or "") + str(body)
        req = self.session.next_request(text)
        if req is None:
            self._done = True
            return None
        prompt = req.prompt_ids(self.tokenizer)
        if len(prompt) + self.max_tokens > self.max_prompt:
            self._done = True
            return None
        self._prefix = req.prefix
        return DrivenTurn(prompt, tuple(req.messages), list(req.tools) if req.tools else None,
                          req.prefix)


def tool_agent_sessions(tokenizer: Any, max_prompt: int, max_tokens: int,
                        num_sessions: int = 16, data_dir: str | Path | None = None,
                        ) -> list[ToolAgentSession]:
    """The tool agent's sessions (seeded, the model's tool format), every planned turn."""
    wl = ToolAgentWorkload(data_dir, num_sessions=num_sessions,
                           tool_format=format_for(tokenizer))
    return [ToolAgentSession(s, tokenizer, max_prompt, max_tokens)
            for s in wl.sessions(None, turns=1_000)]


def check_workload(name: str) -> str:
    """``name`` if it is one of :data:`WORKLOADS`.

    Raises:
        BenchmarkError: an unknown workload.
    """
    if name not in WORKLOADS:
        raise BenchmarkError(f"unknown driven workload {name!r}; choose from "
                             f"{', '.join(WORKLOADS)}")
    return name
