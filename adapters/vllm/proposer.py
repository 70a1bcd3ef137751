"""agentspec's session-scoped suffix cache as a vLLM ``custom_class`` proposer.

Use it with::

    LLM(model, speculative_config={
        "method": "custom_class",
        "model": "adapters.vllm.proposer.AgentSpecProposer",
        "num_speculative_tokens": 32,
    })

(:func:`adapters.vllm.backend.speculative_config` builds this dict from an
:class:`~agentspec.spec.AgentSpec`). vLLM 0.32 builds the class with the ``VllmConfig`` in
every worker that samples, and after each step calls ``propose(sampled_token_ids,
num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``: row ``i`` of ``token_ids_cpu``
holds request ``i``'s prompt and committed output (its first ``num_tokens_no_spec[i]``
entries), and the return value is one list of draft token ids per row (empty: no draft).
vLLM verifies the drafts itself, so the output is vLLM's own decoding whatever is proposed.

Drafting is :class:`~agentspec.drafters.suffix.drafter.SuffixDrafter` (the same suffix index
and session history as the embedded engine): a request index over the current prompt and
output, and a history index per session over every earlier turn, prompt and output.

Sessions. The proposer reads the row's vLLM request id from the model runner's input batch
(the object that built it; see :func:`_find_runner`) and decodes the session from it
(:mod:`adapters.vllm.request_ids`). Each tracked request has its own request index, keyed by
its vLLM request id (``DraftContext.request_id``), so two in-flight requests of one session
never rebuild or drop each other's state. A request that leaves the batch is finished: its tokens
join its session's history (a request vLLM preempts leaves the batch too: its tokens so
far join the history, and it resumes with a fresh request index; drafting stays
correct, the history holds that prefix twice). Requests without a session draft from
their own tokens only.
Without a runner (another vLLM version) rows are tracked by content, without sessions.

Settings come from the environment, which vLLM passes on to its worker processes:
``AGENTSPEC_VLLM_SCOPE`` (``session`` / ``agent`` / ``tenant``), ``AGENTSPEC_VLLM_MIN_SCORE``
(the payoff gate: a draft whose suffix-tree score — its expected accepted length — is below
this is not sent, so the step costs no verification work; default 0) and
``AGENTSPEC_VLLM_STORE`` (a SQLite session store to persist and reload turns; default none)
and ``AGENTSPEC_VLLM_PAYOFF=cost_aware`` (the learned payoff predictor cuts each draft to
its predicted useful length, or withholds it, and calibrates itself from each draft's
full-length label, which the row's later committed tokens decide; see
:mod:`adapters.vllm.payoff_gate`; ``AGENTSPEC_VLLM_COST_PER_TOKEN`` or
``AGENTSPEC_VLLM_COST_CURVE`` prices the drafts) and
``AGENTSPEC_VLLM_STATS`` (a JSON file the proposer's counters, ``propose_ms_per_step``
included, are written to every 8 steps: how a benchmark reads them from vLLM's worker)
and ``AGENTSPEC_VLLM_SPEC_OFFSET`` (tokens a draft may run past ``max_spec_factor`` times
its match length; default: the session cache's own, 8) and ``AGENTSPEC_VLLM_OUTPUTS=1``
(also draft from the scope's answers alone, which every answer joins as vLLM generates it:
requests in flight draft from each other's answers, as in arctic's global tree).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from adapters.vllm import envs
from adapters.vllm.payoff_gate import PayoffGate
from adapters.vllm.request_ids import decode_request_id
from agentspec.drafters.suffix.drafter import SuffixConfig, SuffixDrafter
from agentspec.errors import ConfigError
from agentspec.factory import suffix_config
from agentspec.interfaces import TurnStore
from agentspec.payoff.labels import ShadowLabels
from agentspec.requests import REQUESTS, Slot
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.storage.sessions import persist_turn
from agentspec.types import DraftContext, SessionRef, state_key

log = logging.getLogger(__name__)

# The variables this module reads (declared, with their defaults, in adapters/vllm/envs.py).
ENV_SCOPE, ENV_MIN_SCORE, ENV_STORE = envs.SCOPE, envs.MIN_SCORE, envs.STORE
ENV_STATS, ENV_SPEC_OFFSET, ENV_OUTPUTS = envs.STATS, envs.SPEC_OFFSET, envs.OUTPUTS
_DUMP_EVERY = 8  # propose calls between stats dumps (~1 s of CPU engine steps; ~0.1 ms each)
_ANON_TENANT = "vllm-anonymous"  # request-only scope of requests without a session


@dataclass
class _BatchRequest:
    """One request the proposer is drafting for."""

    ref: SessionRef
    anonymous: bool
    tokens: list[int]
    prompt_len: int
    rid: str  # unique per tracked request: the drafter keys its request index by it
    step: int = 0
    last_draft: int = 0  # tokens proposed at the previous step
    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=8))
    # The payoff gate's drafts awaiting their full-length label (its online calibration).
    labels: ShadowLabels = field(default_factory=ShadowLabels)


@dataclass
class ProposerStats:
    """Counters of one proposer (per worker process).

    Attributes:
        calls: ``propose`` calls.
        drafts: Rows that received a non-empty draft.
        draft_tokens: Tokens proposed.
        gated: Drafts withheld by the payoff gate (score threshold or predictor).
        accepted: Draft tokens vLLM accepted (from the next step's sampled tokens).
        finished: Requests whose tokens joined a session history.
        sessions: Distinct sessions seen.
        propose_s: Seconds spent inside ``propose`` (all rows of all steps).
        max_rows: Most rows drafted for in one step (the batch's concurrency).
    """

    calls: int = 0
    propose_s: float = 0.0
    max_rows: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    gated: int = 0
    accepted: int = 0
    finished: int = 0
    sessions: set[str] = field(default_factory=set)


def _find_runner(max_depth: int = 8) -> Any | None:
    """The vLLM model runner whose ``__init__`` is constructing the caller, if any.

    vLLM 0.32 calls ``create_custom_proposer(vllm_config)`` from ``GPUModelRunner.__init__``
    (also the CPU runner's base) and passes only the config; the runner's ``input_batch``
    is what maps batch rows to request ids, so the proposer keeps a reference to it.
    """
    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__name__.endswith("ModelRunner"):
            return owner
    return None


def _config_from_env(num_speculative_tokens: int) -> tuple[SuffixConfig, float]:
    """The drafter settings and payoff-gate threshold from the environment."""
    scope = envs.read(ENV_SCOPE, SuffixConfig.scope)
    raw = envs.read(ENV_MIN_SCORE, "0")
    try:
        min_score = float(raw)
    except ValueError:
        raise ConfigError(f"{ENV_MIN_SCORE} must be a number, got {raw!r}") from None
    if min_score < 0:
        raise ConfigError(f"{ENV_MIN_SCORE} must be >= 0, got {raw!r}")
    # The one factory maps the policy to the drafter's settings, as for agentspec's engine.
    try:
        spec = AgentSpec(drafting=DraftingPolicy(
            method="suffix", scope=scope, max_draft=num_speculative_tokens))  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(f"{ENV_SCOPE}={scope!r} / num_speculative_tokens="
                          f"{num_speculative_tokens}: {exc}") from None
    config = replace(suffix_config(spec), tree=False)  # vLLM verifies one chain per request
    offset = envs.read(ENV_SPEC_OFFSET)
    if offset is not None:
        try:
            config = replace(config, max_spec_offset=float(offset))
        except ValueError:
            raise ConfigError(f"{ENV_SPEC_OFFSET} must be a number, got {offset!r}") from None
    outputs = envs.read(ENV_OUTPUTS)
    if outputs is not None:
        if outputs not in ("0", "1"):
            raise ConfigError(f"{ENV_OUTPUTS} must be 0 or 1, got {outputs!r}")
        config = replace(config, use_outputs=outputs == "1")
    return config, min_score


class AgentSpecProposer:
    """vLLM ``custom_class`` proposer drafting from agentspec's session suffix cache.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (``speculative_config.num_speculative_tokens``
            caps each draft; ``model_config.max_model_len`` bounds the context).
        runner: The model runner (found automatically when vLLM builds the class).
        store: A session store (``load`` / ``append_turn``); default from
            ``AGENTSPEC_VLLM_STORE``.
    """

    def __init__(self, vllm_config: Any, runner: Any | None = None,
                 store: TurnStore | None = None) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        config, self.min_score = _config_from_env(self.k)
        if store is None and envs.read(ENV_STORE):
            from agentspec.storage.sessions import SessionStore

            store = SessionStore.open_or_recover(envs.read(ENV_STORE))
        self.store = store
        self.drafter = SuffixDrafter(config, store=store)
        self.gate = PayoffGate.from_env(vllm_config)
        self.runner = runner if runner is not None else _find_runner()
        if self.runner is None:
            log.warning("agentspec proposer: no model runner found; drafting without sessions")
        self.stats = ProposerStats()
        raw = envs.read(ENV_STATS)
        self.stats_path = Path(raw) if raw else None
        # The requests in vLLM's batch, in the one home of per-request state under
        # ("vllm", vLLM's id): a request's lifecycle follows its batch membership.
        self._live: Slot[_BatchRequest] = REQUESTS.slot("vllm")
        self._anon = 0
        self._serial = 0  # distinguishes a vLLM request id reused after it finished

    # ------------------------------------------------------------------ vLLM interface
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load (vLLM calls this on every drafter)."""

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: Any,
        token_ids_cpu: Any,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Draft token ids for every row of the batch.

        Args:
            sampled_token_ids: Tokens committed to each row in this step (empty for rows
                still in a chunked prefill, which get no draft).
            num_tokens_no_spec: Per row, tokens held in ``token_ids_cpu`` (prompt +
                committed output).
            token_ids_cpu: ``[max_num_reqs, max_model_len]`` token ids.
            slot_mappings: Unused (KV slots of the step).

        Returns:
            One draft (list of token ids, possibly empty) per row.
        """
        t0 = time.perf_counter()
        drafts = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        self.stats.propose_s += time.perf_counter() - t0
        self.stats.max_rows = max(self.stats.max_rows, len(sampled_token_ids))
        if self.stats_path is not None and self.stats.calls % _DUMP_EVERY == 0:
            self.dump_stats()
        return drafts

    def _propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: Any,
                 token_ids_cpu: Any) -> list[list[int]]:
        self.stats.calls += 1
        req_ids = self._req_ids(len(sampled_token_ids))
        self._finish_departed(set(req_ids))
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            limit = min(self.k, self.max_model_len - n - 1)
            if not len(sampled) or limit < 1:
                drafts.append([])
                continue
            live = self._sync(req_ids[i], token_ids_cpu[i], n, len(sampled), i)
            accepted = 0
            if live.last_draft:
                # vLLM committed the accepted draft tokens plus one of its own.
                accepted = min(len(sampled) - 1, live.last_draft)
                live.recent.append((live.last_draft, accepted))
                self.stats.accepted += accepted
            if self.gate is not None:
                # The step is verified and its tokens committed: the gate learns from it
                # and labels the earlier drafts they decide (its online calibration).
                self.gate.observe(live.tokens, live.labels, live.last_draft, accepted)
            ctx = DraftContext(live.tokens, live.prompt_len, live.ref, live.step, live.rid)
            live.step += 1
            draft = self.drafter.propose(ctx, limit)
            tokens = [int(t) for t in draft.tokens[:limit]]
            keep = len(tokens)
            if tokens and draft.score < self.min_score:
                keep = 0
            elif tokens and self.gate is not None:
                keep = self.gate.length(live.tokens, live.prompt_len, draft, list(live.recent),
                                        live.labels)
            if tokens and keep == 0:
                self.stats.gated += 1
            tokens = tokens[:keep]
            if tokens:
                self.stats.drafts += 1
                self.stats.draft_tokens += len(tokens)
            live.last_draft = len(tokens)
            drafts.append(tokens)
        return drafts

    # ------------------------------------------------------------------ bookkeeping
    def finish_all(self) -> None:
        """Finish every tracked request (adds them to their sessions' histories)."""
        self._finish_departed(set())
        if self.stats_path is not None:
            self.dump_stats()

    def stats_dict(self) -> dict[str, Any]:
        """The counters as JSON-able values (``propose_ms_per_step`` included)."""
        st = self.stats
        out = {k: v for k, v in vars(st).items() if k != "sessions"}
        out["sessions"] = len(st.sessions)
        out["propose_ms_per_step"] = 1e3 * st.propose_s / st.calls if st.calls else 0.0
        return out

    def dump_stats(self) -> None:
        """Write :meth:`stats_dict` to ``AGENTSPEC_VLLM_STATS`` (the proposer lives in
        vLLM's worker process: a benchmark reads its numbers from this file)."""
        if self.stats_path is None:
            return
        tmp = self.stats_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.stats_dict()))
        tmp.replace(self.stats_path)

    def _req_ids(self, rows: int) -> list[str]:
        """The request id of each row (``row<i>`` when no runner is known)."""
        batch = getattr(self.runner, "input_batch", None)
        ids = list(getattr(batch, "req_ids", []) or [])[:rows] if batch is not None else []
        if len(ids) < rows or any(r is None for r in ids):
            return [f"row{i}" for i in range(rows)]
        return [str(r) for r in ids]

    def _prompt_len(self, row: int, n: int, sampled: int) -> int:
        """Prompt tokens of a row (from the input batch; else everything before this step)."""
        batch = getattr(self.runner, "input_batch", None)
        counts = getattr(batch, "num_prompt_tokens", None)
        if counts is not None:
            try:
                return min(int(counts[row]), n)
            except (IndexError, TypeError, ValueError):
                pass
        return max(0, n - sampled)

    def _sync(self, rid: str, row: Any, n: int, sampled: int, index: int) -> _BatchRequest:
        """The tracked request of a row, created or extended to its ``n`` tokens."""
        live = self._live.get(("vllm", rid))
        if live is not None and rid.startswith("row"):
            # No request ids: a row whose tokens no longer extend ours is a new request.
            m = min(len(live.tokens), n)
            if m == 0 or [int(t) for t in row[max(0, m - 8) : m]] != live.tokens[m - 8 : m]:
                self._finish(rid)
                live = None
        if live is None or n < len(live.tokens):
            if live is not None:
                self._finish(rid)
            ref = decode_request_id(rid)
            anonymous = ref is None
            if ref is None:
                self._anon += 1
                ref = SessionRef(f"request-{self._anon}", tenant=_ANON_TENANT)
            else:
                self.stats.sessions.add(f"{ref.tenant}/{ref.agent}/{ref.session_id}")
            self._serial += 1
            live = _BatchRequest(ref, anonymous, [int(t) for t in row[:n]],
                         self._prompt_len(index, n, sampled), f"{rid}#{self._serial}")
            self._live.put(("vllm", rid), live)
        elif n > len(live.tokens):
            # Extend in place: the drafter sees the same list object and checks only the seam.
            live.tokens.extend(int(t) for t in row[len(live.tokens) : n])
        return live

    def _finish_departed(self, present: set[str]) -> None:
        """Finish tracked requests that are no longer in the batch."""
        for key, _ in list(self._live.items()):
            if key[1] not in present:  # type: ignore[index]
                self._finish(key[1])  # type: ignore[index]

    def _finish(self, rid: str) -> None:
        """Add a request to its session history (or drop a session-less request's index)."""
        live = self._live.pop(("vllm", rid))
        if live is None:  # forgotten by the home (more live requests than it keeps)
            return
        # The drafter's (and any part's) state of this request ends with its membership.
        try:
            self._end(live)
        finally:
            REQUESTS.end(state_key(live.rid))

    def _end(self, live: _BatchRequest) -> None:
        """Add a finished request to its session history (or drop a session-less one)."""
        if live.anonymous:
            self.drafter.stop_request(DraftContext(live.tokens, live.prompt_len, live.ref,
                                                   live.step, live.rid))
            self.drafter.forget(live.ref)
            return
        self.drafter.finish(DraftContext(live.tokens, live.prompt_len, live.ref, live.step,
                                         live.rid))
        # The proposer owns the request lifecycle on vLLM: it persists the finished turn
        # (the drafter only reads the store), after the drafter's finish as the runtime does.
        if self.store is not None:
            persist_turn(self.store, live.ref, live.tokens)
        self.stats.finished += 1
