"""The runtime: one loaded model serving chat requests for many agents and sessions.

Both faces (the LangChain chat model and the OpenAI-compatible server) go through
:class:`Runtime`. The steps every chat turn shares (rendering with the chat template,
stop strings, the answer's opening, parsing tool calls) are
:class:`~agentspec.chat.base.BaseChatRuntime`'s; this runtime adds its decode: it picks the
drafter and verifier from the agent's :class:`~agentspec.spec.AgentSpec`, runs the engine
under its target's lock (the target holds one KV cache, so requests are served one at a
time, in arrival order, whichever runtime over that target they come through) and
persists each finished turn of a session in the session store, whichever drafter decoded
it (drafters only read the store).
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentspec.chat.api import ToolChoice
from agentspec.chat.base import BaseChatRuntime, Decoded, TurnPlan
from agentspec.chat.checks import check_stops
from agentspec.chat.formats import ToolFormat, choose_tool_format, forces_call
from agentspec.chat.grammar import GrammarCompiler, GrammarConstraint
from agentspec.chat.grammar_sources import response_format_grammar
from agentspec.chat.turn import ChatTurn
from agentspec.drafters.gate import DraftGate
from agentspec.engine import SpeculativeDecoder
from agentspec.factory import build_drafter, build_engine, build_gate
from agentspec.interfaces import Drafter, TurnStore
from agentspec.lru import LRU
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.storage.health import CountingStore
from agentspec.storage.sessions import StoreConfig, persist_turn
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.tokens import eos_ids

if TYPE_CHECKING:
    from agentspec.chat.api import ChatRuntime

log = logging.getLogger(__name__)

_MAX_ENGINES = 32  # distinct agent specs whose engines a runtime keeps


class Runtime(BaseChatRuntime[GrammarConstraint]):
    """A loaded model plus the drafters, verifiers and store that serve it.

    ``chat`` / ``stream_chat`` / ``stream_turn`` are
    :class:`~agentspec.chat.base.BaseChatRuntime`'s; a turn's decode is
    :meth:`begin_decode`.

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
        self._drafters: dict[tuple[DraftingPolicy, bool], Drafter | None] = {}
        # One draft gate per drafting policy, as drafters: its per-tenant calibration spans
        # requests (a gate built per request would start every request knowing nothing).
        self._gates: dict[tuple[DraftingPolicy, bool], DraftGate | None] = {}
        # One engine per agent spec: an engine holds no request's state (that lives in
        # agentspec.requests), so it lives as long as its parts and asks them what they can
        # do once. Bounded: callers may pass many distinct specs.
        self._engines: LRU[AgentSpec, SpeculativeDecoder] = LRU(_MAX_ENGINES)
        self._grammars: GrammarCompiler | None = None
        self.eos_ids: list[int] = eos_ids(self.tokenizer)

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The target's lock (one KV cache): held while a request decodes on it, so every
        runtime over one target serves its requests one at a time."""
        return self.target.lock

    @property
    def store_errors(self) -> int:
        """Finished turns that could not be persisted (logged; see :attr:`turns`)."""
        return self.turns.count("append") if self.turns is not None else 0

    @classmethod
    def load(
        cls,
        model: str | None = None,
        dtype: str = "auto",
        store: str | Path | bool | None = True,
        default_spec: AgentSpec | None = None,
        store_config: StoreConfig | None = None,
        tool_format: str | None = None,
        prefix_cache_bytes: int | None = None,
        prefix_spill_bytes: int = 0,
        device: str = "auto",
    ) -> Runtime:
        """Load a model and open the session store.

        Args:
            model: A shipped model's name (default: the embedded one; see
                ``agentspec models``) or a local Hugging Face folder.
            dtype: ``auto`` (the default: ``w8a16`` on a CPU with the int8 product, else
                ``float32``; see :class:`~agentspec.targets.target_config.TargetConfig`),
                ``float32`` (the reference, by name), ``bfloat16``, ``int8``, ``w8a8`` or
                ``w8a16`` (CPU only), each exact against plain decoding in that precision.
                ``runtime.target.dtype`` is the precision chosen.
            store: ``True`` for the default SQLite file under ``AGENTSPEC_HOME``, a path, or
                ``False``/``None`` for no persistence. A corrupt file is moved aside and the
                store starts empty (logged), so serving never fails because of it.
            store_config: The store's limits and per-tenant quotas
                (:class:`agentspec.storage.sessions.StoreConfig`; default limits when ``None``).
            tool_format: The model's tool-call format (default: chosen from its chat
                template, see :func:`agentspec.chat.formats.choose_tool_format`).
            prefix_cache_bytes: Memory for prompt prefixes' KV reused across a tenant's
                requests (``docs/prefix-cache.md``); 0 disables prefix reuse; ``None`` (the
                default) sizes it from the memory available on the model's device.
            prefix_spill_bytes: Disk for copies of that KV under ``AGENTSPEC_HOME`` (reused
                after a restart); 0 keeps it in memory only.
            device: ``auto`` (CUDA when available, else the CPU), ``cpu`` or ``cuda``.

        Raises:
            DeviceUnavailableError: ``device="cuda"`` on a machine without CUDA.
        """
        from agentspec.storage.sessions import open_store

        target = HFTarget.load(TargetConfig(model=model, dtype=dtype, device=device,
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

    def set_drafter(self, spec: AgentSpec, drafter: Drafter | None,
                    gate: DraftGate | None = None) -> None:
        """Serve ``spec``'s drafting policy with your own ``drafter`` (any
        :class:`~agentspec.interfaces.Drafter`; verification stays the spec's, so output is
        unchanged) and ``gate`` (``None``: every draft verified as drafted). Engines built
        for the policy before are dropped."""
        key = (spec.drafting, spec.tree_drafts)
        self._drafters[key], self._gates[key] = drafter, gate
        for cached in [s for s, _ in self._engines.items()
                       if (s.drafting, s.tree_drafts) == key]:
            self._engines.pop(cached)

    def gate_for(self, spec: AgentSpec) -> DraftGate | None:
        """The (shared) draft gate of ``spec``'s drafting policy (``None``: ungated)."""
        key = (spec.drafting, spec.tree_drafts)
        if key not in self._gates:
            self._gates[key] = build_gate(spec, self.target, self.drafter_for(spec))
        return self._gates[key]

    def engine_for(self, spec: AgentSpec) -> SpeculativeDecoder:
        """The decoder configured by ``spec``, kept for the next request of the same spec;
        its drafter and draft gate are the runtime's, shared by every spec of the same
        drafting policy (their state spans requests)."""
        return self._engines.get_or_put(spec, lambda: build_engine(
            spec, self.target, self.drafter_for(spec), decode=self.decode,
            eos_token_ids=self.eos_ids, gate=self.gate_for(spec)))

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
        forced = forces_call(tool_choice)
        grammar = None
        fmt = self.tool_format
        if forced and spec.constrained_tool_calls:
            grammar = fmt.grammar(tools, tool_choice)
        if grammar is None and not forced:
            grammar = response_format_grammar(response_format)
        if grammar is None and not forced and spec.constrained_tool_calls:
            grammar = fmt.grammar(tools, tool_choice)
        return self.grammars.constraint(grammar) if grammar is not None else None

    # ------------------------------------------------------------------ the turn's hooks
    def check_turn(self, turn: ChatTurn, spec: AgentSpec) -> None:
        """Bound the stop strings before any work: a long stop costs every decode step."""
        check_stops(turn.stop)

    def grammar_for(self, turn: ChatTurn, spec: AgentSpec) -> GrammarConstraint | None:
        """The turn's grammar constraint (see :meth:`constraint_for`)."""
        return self.constraint_for(turn.tools, turn.tool_choice, turn.response_format, spec)

    def begin_decode(self, plan: TurnPlan[GrammarConstraint]) -> Generator[str, None, Decoded]:
        """The speculative engine of the turn's spec (its drafter and draft gate shared
        across requests), built now; the returned generator decodes, then persists the
        turn and retires the target's KV, still under the lock.

        ``cancel`` stops the request between prefill chunks or decode steps with
        :class:`~agentspec.errors.Cancelled` (nothing stored).
        """
        return self._decode(self.engine_for(plan.spec), plan)

    def _decode(
        self, engine: SpeculativeDecoder, plan: TurnPlan[GrammarConstraint]
    ) -> Generator[str, None, Decoded]:
        turn = plan.turn
        gen = yield from engine.stream(plan.prompt, turn.max_tokens, plan.stop, plan.sampling,
                                       turn.session, constraint=plan.grammar,
                                       cancel=turn.cancel)
        # The runtime owns persistence: every finished turn of a session is stored,
        # whichever drafter decoded it (none, prompt lookup, the session cache, ...).
        # Under the lock, after the drafter's finish: a session cache meeting the
        # session for the first time has loaded its stored turns without this one.
        # A one-off request's turn is not: no later request can name its session.
        session = turn.session
        stored: bool | None = None
        if session is not None and not session.ephemeral and self.turns is not None:
            stored = persist_turn(self.turns, session, [*plan.prompt, *gen.tokens])
        # This request's prompt KV goes to the prefix store now, outside every request's
        # timed path (the next request may be another tenant's).
        self.target.retire()
        return Decoded(gen.text, gen.tokens, gen.finish_reason, gen.stats, stored)


if TYPE_CHECKING:

    def _is_chat_runtime(rt: Runtime) -> ChatRuntime:
        return rt  # mypy checks that Runtime implements the adapters' contract
