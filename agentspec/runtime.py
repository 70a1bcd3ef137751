"""The runtime: one loaded model serving chat requests for many agents and sessions.

Both faces (the LangChain chat model and the OpenAI-compatible server) go through
:class:`Runtime`: it renders messages and tools with the chat template, picks the drafter
and verifier from the agent's :class:`~agentspec.spec.AgentSpec`, runs the engine under a
lock (the target holds one KV cache, so requests are served one at a time, in arrival
order), parses tool calls and persists each finished turn of a session in the session
store, whichever drafter decoded it (drafters only read the store).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentspec.chat.api import ChatResult, ToolChoice, chat_prompt_ids
from agentspec.chat.checks import check_stops
from agentspec.chat.formats import ToolFormat, choose_tool_format
from agentspec.chat.grammar import GrammarCompiler, GrammarConstraint
from agentspec.chat.grammar_sources import response_format_grammar
from agentspec.drafters.gate import DraftGate
from agentspec.engine import Generation, SpeculativeDecoder
from agentspec.factory import build_drafter, build_engine, build_gate
from agentspec.interfaces import Drafter, TurnStore
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.storage.health import CountingStore
from agentspec.storage.sessions import StoreConfig, persist_turn
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.targets.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES
from agentspec.tokens import eos_ids
from agentspec.types import SamplingParams, SessionRef

if TYPE_CHECKING:
    from agentspec.chat.api import ChatRuntime

log = logging.getLogger(__name__)

class Runtime:
    """A loaded model plus the drafters, verifiers and store that serve it.

    Args:
        target: The loaded model.
        store: Session store for persistence (``None``: caches live in memory only).
        default_spec: The policy of requests that name no agent spec.
    """

    def __init__(
        self,
        target: HFTarget,
        store: TurnStore | None = None,
        default_spec: AgentSpec | None = None,
        tool_format: str | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = target.tokenizer
        self.tool_format: ToolFormat = choose_tool_format(self.tokenizer, tool_format)
        # Tags that are special tokens (Mistral's [TOOL_CALLS]) survive decoding; other
        # special tokens (end of turn) do not.
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        self._keep = self.tool_format.keep_ids() & special
        self._drop = special - self._keep
        self.store = store
        # Drafters read and the runtime writes through one counter of the store's failures
        # (a turn that could not be stored or read is answered anyway, never silently).
        self.turns = CountingStore(store) if store is not None else None
        self.default_spec = default_spec or AgentSpec()
        self.lock = threading.RLock()
        self._drafters: dict[tuple[DraftingPolicy, bool], Drafter | None] = {}
        # One draft gate per drafting policy, as drafters: its per-tenant calibration spans
        # requests (a gate built per request would start every request knowing nothing).
        self._gates: dict[tuple[DraftingPolicy, bool], DraftGate | None] = {}
        self._grammars: GrammarCompiler | None = None
        self.eos_ids: list[int] = eos_ids(self.tokenizer)

    @property
    def store_errors(self) -> int:
        """Finished turns that could not be persisted (logged; see :attr:`turns`)."""
        return self.turns.count("append") if self.turns is not None else 0

    @classmethod
    def load(
        cls,
        model: str | None = None,
        dtype: str = "float32",
        store: str | Path | bool | None = True,
        default_spec: AgentSpec | None = None,
        store_config: StoreConfig | None = None,
        tool_format: str | None = None,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        prefix_spill_bytes: int = 0,
    ) -> Runtime:
        """Load a model and open the session store.

        Args:
            model: A shipped model's name (default: the embedded one; see
                ``agentspec models``) or a local Hugging Face folder.
            dtype: ``float32`` (exact) or ``bfloat16``.
            store: ``True`` for the default SQLite file under ``AGENTSPEC_HOME``, a path, or
                ``False``/``None`` for no persistence. A corrupt file is moved aside and the
                store starts empty (logged), so serving never fails because of it.
            store_config: The store's limits and per-tenant quotas
                (:class:`agentspec.storage.sessions.StoreConfig`; default limits when ``None``).
            tool_format: The model's tool-call format (default: chosen from its chat
                template, see :func:`agentspec.chat.formats.choose_tool_format`).
            prefix_cache_bytes: Memory for prompt prefixes' KV reused across a tenant's
                requests (``docs/prefix-cache.md``); 0 disables prefix reuse.
            prefix_spill_bytes: Disk for copies of that KV under ``AGENTSPEC_HOME`` (reused
                after a restart); 0 keeps it in memory only.
        """
        from agentspec.storage.sessions import open_store

        target = HFTarget.load(TargetConfig(model=model, dtype=dtype,
                                            prefix_cache_bytes=prefix_cache_bytes,
                                            prefix_spill_bytes=prefix_spill_bytes))
        return cls(target, open_store(store, store_config), default_spec, tool_format)

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids -> text without special tokens (tool-call tags that are special
        tokens of the vocabulary are kept: the parser needs them)."""
        if not self._keep:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
        kept = [int(t) for t in ids if int(t) not in self._drop]
        return str(self.tokenizer.decode(kept, skip_special_tokens=False))

    def drafter_for(self, spec: AgentSpec) -> Drafter | None:
        """The (shared, stateful) drafter serving ``spec``'s drafting policy."""
        # Keyed by the whole (frozen) drafting policy (every field may shape the drafter)
        # and by whether it drafts trees (which also depends on the verifier).
        key = (spec.drafting, spec.tree_drafts)
        if key not in self._drafters:
            self._drafters[key] = build_drafter(spec, self.target, self.turns)
        return self._drafters[key]

    def gate_for(self, spec: AgentSpec) -> DraftGate | None:
        """The (shared) draft gate of ``spec``'s drafting policy (``None``: ungated)."""
        key = (spec.drafting, spec.tree_drafts)
        if key not in self._gates:
            self._gates[key] = build_gate(spec, self.target, self.drafter_for(spec))
        return self._gates[key]

    def engine_for(self, spec: AgentSpec) -> SpeculativeDecoder:
        """A decoder configured by ``spec``; its drafter and draft gate are the runtime's,
        shared across calls (their state spans requests)."""
        return build_engine(spec, self.target, self.drafter_for(spec), decode=self.decode,
                            eos_token_ids=self.eos_ids, gate=self.gate_for(spec))

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

    @property
    def grammars(self) -> GrammarCompiler:
        """The model's grammar compiler (its token trie is built on the first grammar)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler.from_hf(self.tokenizer, self.target.vocab_size)
        return self._grammars

    def constraint_for(
        self,
        tools: Sequence[dict[str, Any]] | None,
        tool_choice: ToolChoice,
        response_format: Any,
        spec: AgentSpec,
    ) -> GrammarConstraint | None:
        """The request's grammar (``None``: unconstrained): a forced tool call, else the
        ``response_format``, else (``spec.constrained_tool_calls``) valid calls under auto.

        Raises:
            GrammarError: a bad ``response_format``, tool schema or ``tool_choice``.
        """
        forced = tool_choice not in (None, "auto", "none")
        grammar = None
        fmt = self.tool_format
        if forced and spec.constrained_tool_calls:
            grammar = fmt.grammar(tools, tool_choice)
        if grammar is None and not forced:
            grammar = response_format_grammar(response_format)
        if grammar is None and not forced and spec.constrained_tool_calls:
            grammar = fmt.grammar(tools, tool_choice)
        return self.grammars.constraint(grammar) if grammar is not None else None

    def stream_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        tool_choice: ToolChoice = None,
        session: SessionRef | None = None,
        spec: AgentSpec | None = None,
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        sampling: SamplingParams | None = None,
        result: list[ChatResult] | None = None,
        assistant_prefix: str = "",
        response_format: Any = None,
        cancel: threading.Event | None = None,
    ) -> Generator[str, None, None]:
        """Yield text deltas; append the final :class:`ChatResult` to ``result``.

        ``assistant_prefix`` is text that opens the answer (part of the prompt; the deltas
        and the result's text start with it), before any call ``tool_choice`` forces. The
        model lock is held while the generator runs (requests are served one at a time);
        closing the generator early releases it. ``response_format`` (OpenAI's
        ``json_object`` / ``json_schema``) and tool calls are grammar-constrained, see
        :meth:`constraint_for`. ``cancel``, once set, stops the request between prefill
        chunks or decode steps with :class:`~agentspec.errors.Cancelled` (nothing stored),
        so a caller on another thread need not wait for the next delta.
        """
        spec = spec or self.default_spec
        check_stops(stop)  # before any work: a long stop costs every decode step
        sampling = sampling or spec.verifier.sampling()
        constraint = self.constraint_for(tools, tool_choice, response_format, spec)
        # Under a tool grammar the grammar writes the call's opening; no forced prefix.
        choice = "auto" if constraint is not None and tool_choice != "none" else tool_choice
        prompt, prefix = self.prompt_ids(messages, tools, choice, assistant_prefix)
        if tools and tool_choice != "none":
            # The format's own stops (the fallback's closing tag: the agent runs the tool).
            stop = [*stop, *self.tool_format.stop]
        with self.lock:
            engine = self.engine_for(spec)
            if prefix:
                yield prefix
            done: list[Generation] = []
            yield from engine.stream(prompt, max_tokens, stop, sampling, session, result=done,
                                     constraint=constraint, cancel=cancel)
            gen = done[0]
            # The runtime owns persistence: every finished turn of a session is stored,
            # whichever drafter decoded it (none, prompt lookup, the session cache, ...).
            # Under the lock, after the drafter's finish: a session cache meeting the
            # session for the first time has loaded its stored turns without this one.
            # A one-off request's turn is not: no later request can name its session.
            stored: bool | None = None
            if session is not None and not session.ephemeral and self.turns is not None:
                stored = persist_turn(self.turns, session, [*prompt, *gen.tokens])
            # This request's prompt KV goes to the prefix store now, outside every request's
            # timed path (the next request may be another tenant's).
            self.target.retire()
        if result is not None:
            out = ChatResult.build(
                prefix + gen.text, tools if tool_choice != "none" else None, gen.finish_reason,
                len(prompt), gen.tokens, gen.stats, self.tool_format,
            )
            out.stored = stored
            result.append(out)

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """Complete a chat (see :meth:`stream_chat` for the arguments)."""
        out: list[ChatResult] = []
        for _ in self.stream_chat(messages, tools, result=out, **kwargs):
            pass
        return out[0]


if TYPE_CHECKING:

    def _is_chat_runtime(rt: Runtime) -> ChatRuntime:
        return rt  # mypy checks that Runtime implements the adapters' contract
