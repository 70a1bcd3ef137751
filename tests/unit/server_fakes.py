"""A scripted stand-in for :class:`agentspec.runtime.Runtime` for the server's unit tests.

It has the runtime's ``stream_turn`` signature and behaviour (deltas, then a final
ChatResult as the stream's ``result``, tool-call parsing, errors raised on the first
``next``) without loading a model. Replies:

* ``CALL <name> <json>``: a well-formed tool call;
* ``BAD``: a malformed tool call;
* ``LONG``: raises PromptTooLongError;
* ``WAIT``: blocks until ``release`` is set, at most ``wait_s`` seconds (queue tests);
* ``PREFILL``: a long prefill that checks ``cancel`` as HFTarget does between chunks: blocks
  until the event is set, then raises :class:`~agentspec.errors.Cancelled`;
* anything else: ``You said: <text>``, one character per "token".

With a ``store`` (a :class:`~agentspec.storage.sessions.SessionStore`), a finished generation of a
session appends its turn (the reply's code points as "token ids") before the result is
handed over, as the real engine does: a generation closed early stores nothing. ``delay``
seconds pass before each delta (deadline tests); its ``tokenizer`` counts one token per
character.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Sequence
from typing import Any

from agentspec.chat.api import ChatResult
from agentspec.chat.formats.fallback import FallbackFormat
from agentspec.chat.stream import ResultStream
from agentspec.chat.tool_calls import parse_tool_calls, tool_names
from agentspec.chat.turn import ChatTurn
from agentspec.errors import Cancelled, ConfigError, PromptTooLongError
from agentspec.spec import AgentSpec
from agentspec.storage.health import CountingStore
from agentspec.storage.sessions import persist_turn
from agentspec.types import RequestStats, StepStats


class FakeTarget:
    """Only the name is read by the server."""

    name = "fake-model"


class CharTokenizer:
    """One token per character (the fake's replies are streamed per character)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Code points as token ids."""
        return [ord(c) for c in text]


class FakeRuntime:
    """Records every call; see the module docstring for the replies."""

    def __init__(self, store: Any | None = None) -> None:
        self.target = FakeTarget()
        self.store = store
        self.turns = CountingStore(store) if store is not None else None
        self.default_spec = AgentSpec()
        self.calls: list[dict[str, Any]] = []
        self.release = threading.Event()
        self.lock = threading.RLock()
        self.tool_format = FallbackFormat()  # the replies' <tool_call> markup
        self.tokenizer = CharTokenizer()
        self.delay = 0.0
        self.wait_s = 10.0

    def reply(self, messages: Sequence[dict[str, Any]], tool_choice: Any) -> str:
        """The scripted text for a conversation."""
        last = str(messages[-1].get("content") or "")
        if last == "LONG":
            raise PromptTooLongError("prompt of 9000 tokens exceeds the context window of 8192")
        if last == "WAIT":
            self.release.wait(self.wait_s)
        if last.startswith("CALL "):
            _, name, args = last.split(" ", 2)
            return f'Let me check.\n<tool_call>{{"name": "{name}", "arguments": {args}}}'
        if last == "BAD":
            return '<tool_call>{"name": "get_weather", "arguments": {"city": '
        return f"You said: {last}"

    def stream_turn(self, turn: ChatTurn) -> ResultStream[ChatResult]:
        """The reply in 3-character deltas, then the ChatResult (the stream's ``result``)."""
        return ResultStream(self._steps(turn))

    def _steps(self, turn: ChatTurn) -> Generator[str, None, ChatResult]:
        messages, tools, tool_choice = turn.messages, turn.tools, turn.tool_choice
        session, max_tokens, stop = turn.session, turn.max_tokens, turn.stop
        response_format, cancel = turn.response_format, turn.cancel
        spec = turn.spec or self.default_spec
        self.calls.append({"messages": list(messages), "tools": tools, "session": session,
                           "tool_choice": tool_choice, "spec": spec, "max_tokens": max_tokens,
                           "stop": list(stop), "response_format": response_format})
        if spec.verifier.temperature > 0:
            raise ConfigError(f"verifier mode='lossless' with temperature="
                              f"{spec.verifier.temperature} is not supported yet")
        if tool_choice not in (None, "auto", "none", "required") and not tools:
            raise ConfigError(f"tool_choice {tool_choice!r} names no bound tool")
        with self.lock:
            if str(messages[-1].get("content") or "") == "PREFILL":
                if cancel is None or not cancel.wait(10):
                    raise AssertionError("PREFILL needs a cancel event that gets set")
                raise Cancelled("the request was cancelled during its prefill")
            text = self.reply(messages, tool_choice)
            finish = "stop"
            cuts = [text.find(s) for s in stop if s in text]
            if cuts:
                text = text[: min(cuts)]
            if len(text) > max_tokens:
                text, finish = text[:max_tokens], "length"
            for i in range(0, len(text), 3):
                if self.delay:
                    time.sleep(self.delay)
                yield text[i : i + 3]
        parsed = parse_tool_calls(text, tool_names(list(tools)) if tools else None)
        if parsed.tool_calls and finish == "stop":
            finish = "tool_calls"
        stats = RequestStats(prompt_tokens=10, cached_prompt_tokens=4,
                             generated_tokens=len(text), forwards=2,
                             steps=[StepStats("suffix", 4, 3, 4, 0.0, 0.0),
                                    StepStats("suffix", 2, 0, 1, 0.0, 0.0),
                                    StepStats("none", 0, 0, 1, 0.0, 0.0)])
        stored = None
        # As the runtime: a one-off request is not stored; a failure is counted, not raised.
        if self.turns is not None and session is not None and not session.ephemeral:
            stored = persist_turn(self.turns, session, [ord(c) for c in text])
        return ChatResult(text, parsed.content, parsed.tool_calls, parsed.invalid_tool_calls,
                          finish, 10, len(text), stats, list(range(len(text))), stored=stored)
