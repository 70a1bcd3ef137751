"""The steps of a chat turn that every runtime shares; a runtime supplies only its decode.

A turn is answered the same way whichever engine decodes it: pick the spec and sampling,
build the request's grammar (a forced tool call, a ``response_format``, valid calls under
``auto``), render the prompt in the model's tool format with the answer's opening (the
caller's ``assistant_prefix``, then any call the grammar does not write itself), add the
format's stop strings, then, under the runtime's lock, hand the opening out as the first
delta and stream the decode, and finally parse the whole answer into a
:class:`~agentspec.chat.api.ChatResult`. :class:`BaseChatRuntime` holds those steps once;
:class:`agentspec.runtime.Runtime` (the speculative engine) and
``adapters.vllm.VLLMRuntime`` (a vLLM engine) implement only the hooks: checks of their
own, how a grammar is expressed for their engine, and the decode itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from agentspec.chat.api import ChatResult, ChatStream, chat_prompt_ids
from agentspec.chat.formats import ToolFormat, forces_call
from agentspec.chat.stream import ResultStream
from agentspec.chat.turn import ChatTurn, ToolChoice
from agentspec.spec import AgentSpec
from agentspec.types import RequestStats, SamplingParams

__all__ = ["BaseChatRuntime", "Decoded", "TurnPlan"]

G = TypeVar("G")  # how a runtime expresses a request's grammar to its engine


@dataclass(frozen=True)
class TurnPlan(Generic[G]):
    """A turn resolved into what its decode needs.

    Attributes:
        turn: The request.
        spec: Its agent spec (the runtime's default when the turn names none).
        sampling: Its sampling settings (the spec's verifier's when the turn has none).
        grammar: The runtime's form of the request's grammar (``None``: unconstrained).
        prompt: Rendered prompt token ids, the answer's opening included.
        stop: The turn's stop strings plus, with tools active, the tool format's own.
    """

    turn: ChatTurn
    spec: AgentSpec
    sampling: SamplingParams
    grammar: G | None
    prompt: list[int]
    stop: Sequence[str]


@dataclass
class Decoded:
    """What a runtime's decode produced (the opening not included).

    Attributes:
        text: The generated text (tool-call tags kept), cut before any stop string.
        tokens: Generated token ids.
        finish_reason: ``stop`` or ``length``.
        stats: The request's speculative decoding numbers.
        stored: Whether the turn reached the session store (``None``: not stored here).
    """

    text: str
    tokens: list[int]
    finish_reason: str
    stats: RequestStats = field(default_factory=RequestStats)
    stored: bool | None = None


class BaseChatRuntime(ABC, Generic[G]):
    """A loaded model answering chat turns: the shared steps of every turn.

    Subclasses set ``tokenizer``, ``tool_format`` and ``default_spec``, expose the
    ``lock`` their model's requests are served under, and implement :meth:`grammar_for`
    and :meth:`begin_decode` (and :meth:`check_turn` for checks of their own).
    """

    tokenizer: Any
    tool_format: ToolFormat
    default_spec: AgentSpec

    @property
    @abstractmethod
    def lock(self) -> AbstractContextManager[Any]:
        """Held while a turn decodes (one request at a time on the model)."""

    # ------------------------------------------------------------------ the faces
    def stream_turn(self, turn: ChatTurn) -> ChatStream:
        """Stream ``turn``: iterate for its text deltas, then read ``.result``.

        Nothing runs until the first delta is asked for. The lock is held from then until
        the stream ends; closing it early releases the lock and stores nothing (on the
        thread that iterates it).
        """
        return ResultStream(self._steps(turn))

    def stream_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        **fields: Any,
    ) -> ChatStream:
        """:meth:`stream_turn` of the :class:`~agentspec.chat.turn.ChatTurn` the keywords
        name (``tool_choice=``, ``session=``, ``spec=``, ``max_tokens=``, ``stop=``,
        ``sampling=``, ``assistant_prefix=``, ``response_format=``, ``cancel=``)."""
        return self.stream_turn(ChatTurn(messages, tools, **fields))

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        **fields: Any,
    ) -> ChatResult:
        """Complete a chat (the keywords of :meth:`stream_chat`)."""
        return self.stream_turn(ChatTurn(messages, tools, **fields)).drain()

    def prompt_ids(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: ToolChoice = None,
        assistant_prefix: str = "",
    ) -> tuple[list[int], str]:
        """Rendered prompt token ids and the text that opens the assistant turn
        (``assistant_prefix``, then any forced tool call; see :func:`chat_prompt_ids`)."""
        return chat_prompt_ids(self.tokenizer, messages, tools, tool_choice, assistant_prefix,
                               self.tool_format)

    # ------------------------------------------------------------------ the hooks
    def check_turn(self, turn: ChatTurn, spec: AgentSpec) -> None:
        """Refuse what this runtime cannot serve, before any work (default: nothing).

        Raises:
            AgentSpecError: a subclass naming the bad value.
        """

    @abstractmethod
    def grammar_for(self, turn: ChatTurn, spec: AgentSpec) -> G | None:
        """The turn's grammar in this engine's form (``None``: unconstrained): a forced
        tool call, else the ``response_format``, else (``spec.constrained_tool_calls``)
        valid calls under ``auto``.

        Raises:
            GrammarError: a bad ``response_format``, tool schema or ``tool_choice``.
        """

    @abstractmethod
    def begin_decode(self, plan: TurnPlan[G]) -> Generator[str, None, Decoded]:
        """Start decoding ``plan`` (called under :attr:`lock`, before the opening is
        handed out): work that may fail before any output is done here, eagerly; the
        returned generator yields the text deltas of the generated part and returns it."""

    # ------------------------------------------------------------------ the skeleton
    def _steps(self, turn: ChatTurn) -> Generator[str, None, ChatResult]:
        """The turn: plan it, decode it under the lock, parse the answer."""
        spec = turn.spec or self.default_spec
        self.check_turn(turn, spec)
        sampling = turn.sampling or spec.verifier.sampling()
        grammar = self.grammar_for(turn, spec)
        # A grammar that forces a call writes the call's opening itself: no forced prefix.
        choice = "auto" if grammar is not None and forces_call(turn.tool_choice) \
            else turn.tool_choice
        prompt, prefix = self.prompt_ids(turn.messages, turn.tools, choice,
                                         turn.assistant_prefix)
        stop = turn.stop
        if turn.tools_active:
            # The format's own stops (the fallback's closing tag: the agent runs the tool).
            stop = [*stop, *self.tool_format.stop]
        plan = TurnPlan(turn, spec, sampling, grammar, prompt, stop)
        with self.lock:
            decode = self.begin_decode(plan)
            if prefix:
                yield prefix
            done = yield from decode
        result = ChatResult.build(prefix + done.text, turn.parsed_tools, done.finish_reason,
                                  len(prompt), done.tokens, done.stats, self.tool_format)
        result.stored = done.stored
        return result
