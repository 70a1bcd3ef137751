"""SuffixDecoding as a drafter: a per-request suffix index plus a history index per scope.

Each decode step consults two :class:`~agentspec.drafters.suffix_tree.SuffixIndex` es:

* the **request index** over the current prompt and the tokens generated so far, built when
  a request starts (``ctx.step == 0`` or a context that no longer extends the indexed one)
  and extended in :meth:`SuffixDrafter.observe`;
* the **history index** of the request's scope over every token (prompt + output) of the
  scope's earlier requests, extended in :meth:`SuffixDrafter.finish`.

The draft with the higher score wins (tie: the longer match, then the request index).

Isolation: the scope key always contains the tenant, so a tenant's tokens are never drafted
for another tenant, and under ``scope="session"`` one session's tokens never for another
session. Requests without a :class:`~agentspec.types.SessionRef` use the request index only.

Persistence: with a ``store`` (see :class:`TurnStore`), finished turns are written with
``store.append_turn`` and a session's stored turns are loaded into its scope's history the
first time this process sees that session. Under agent / tenant scope, sessions this process
never sees are not loaded (the store is only read per session).
"""

from __future__ import annotations

import logging
import math
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentspec.drafters.suffix_tree import SuffixIndex
from agentspec.errors import AgentSpecError, ConfigError
from agentspec.types import Draft, DraftContext, SessionRef, VerifyResult

log = logging.getLogger(__name__)

SCOPES = ("session", "agent", "tenant")
_MAX_REQUESTS = 64  # live request indexes kept (requests that never call finish() age out)


class TurnStore(Protocol):
    """Persistent storage of finished turns (implemented by ``agentspec.store``)."""

    def load(self, ref: SessionRef) -> list[list[int]]:
        """Token ids of every stored turn of ``ref``'s session, oldest first."""
        ...

    def append_turn(self, ref: SessionRef, tokens: list[int]) -> None:
        """Persist one finished turn (prompt + output) of ``ref``'s session."""
        ...


@dataclass(frozen=True)
class SuffixConfig:
    """Settings of :class:`SuffixDrafter`.

    Attributes:
        max_depth: Longest context suffix matched against an index.
        max_spec_factor: Draft length cap per matched token. Agent outputs copy long spans
            (documents, tool results), so a long match earns a longer draft than in chat.
        max_spec_offset: Tokens added to the cap, so short but confident matches still draft.
        min_token_prob: A draft stops when its path probability falls below this.
        max_tokens: Most tokens per draft (the engine may ask for fewer).
        scope: Who shares a history index: ``"session"`` (tenant + session id),
            ``"agent"`` (tenant + agent) or ``"tenant"``.
        max_scope_tokens: Tokens kept per history index. When exceeded, the oldest turns are
            dropped down to 3/4 of this and the index is rebuilt (amortised O(1) per token).
        max_scopes: History indexes kept in memory (when full, the least recently used
            index of the tenant holding the most is dropped; it is reloaded from the
            store, if any, when needed again).
        use_request_index: Consult the per-request index.
        use_history: Consult (and fill) the history indexes.
        tree: Draft a small token tree (the most probable continuations, best first, at
            most ``max_tokens`` nodes) instead of one chain; the engine verifies its
            branches in one batched forward (greedy requests only).
    """

    max_depth: int = 64
    max_spec_factor: float = 2.0
    max_spec_offset: float = 8.0
    min_token_prob: float = 0.1
    max_tokens: int = 32
    scope: str = "session"
    max_scope_tokens: int = 262_144
    max_scopes: int = 256
    use_request_index: bool = True
    use_history: bool = True
    tree: bool = False

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_tokens", "max_scope_tokens", "max_scopes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not (math.isfinite(self.max_spec_factor) and self.max_spec_factor >= 0):
            raise ConfigError(f"max_spec_factor must be >= 0, got {self.max_spec_factor!r}")
        if not math.isfinite(self.max_spec_offset):
            raise ConfigError(f"max_spec_offset must be finite, got {self.max_spec_offset!r}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ConfigError(f"min_token_prob must be in [0, 1], got {self.min_token_prob!r}")
        if self.scope not in SCOPES:
            raise ConfigError(f"scope must be one of {SCOPES}, got {self.scope!r}")


def scope_key(ref: SessionRef, scope: str) -> tuple[str, ...]:
    """The history index a session reads and writes; the tenant is always part of it."""
    if scope == "session":
        return ("session", ref.tenant, ref.session_id)
    if scope == "agent":
        return ("agent", ref.tenant, ref.agent)
    return ("tenant", ref.tenant)


class _Request:
    """The request index and a mirror of the tokens it holds (to detect a new request)."""

    def __init__(self, tokens: Sequence[int], prompt_len: int, cfg: SuffixConfig) -> None:
        self.index = SuffixIndex(cfg.max_depth, cfg.max_tokens)
        self.tokens: list[int] = [int(t) for t in tokens]
        self.ref: Sequence[int] = tokens  # the caller's object: unchanged identity = same request
        self.prompt_len = prompt_len
        self.index.append(0, self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Index committed tokens of this request."""
        new = [int(t) for t in tokens]
        self.tokens.extend(new)
        self.index.append(0, new)

    def continues(self, ctx: DraftContext) -> bool:
        """True when ``ctx.tokens`` starts with every token indexed so far."""
        toks, n = ctx.tokens, len(self.tokens)
        if ctx.prompt_len != self.prompt_len or len(toks) < n:
            return False
        if toks is self.ref:  # the engine's own list, grown in place: check the seam only
            return n == 0 or toks[n - 1] == self.tokens[-1]
        if [int(t) for t in toks[:n]] != self.tokens:
            return False
        self.ref = toks
        return True


class _Scope:
    """A history index plus the turns it holds (kept to rebuild it after eviction)."""

    def __init__(self, cfg: SuffixConfig) -> None:
        self.cfg = cfg
        self.index = SuffixIndex(cfg.max_depth, cfg.max_tokens)
        self.turns: deque[tuple[str, array[int]]] = deque()  # (session id, tokens)
        self.tokens = 0
        self.sessions: set[str] = set()  # sessions whose stored turns are loaded
        self._next_seq = 0

    def add_turn(self, session_id: str, tokens: Sequence[int]) -> None:
        """Index one finished turn (its last ``max_scope_tokens`` tokens at most)."""
        turn = array("i", tokens[-self.cfg.max_scope_tokens :])
        self.turns.append((session_id, turn))
        self.tokens += len(turn)
        if self.tokens > self.cfg.max_scope_tokens:
            # Drop to 3/4 of the budget so the O(budget) rebuild happens at most once per
            # budget/4 new tokens: amortised, each token is indexed at most ~4 extra times.
            while self.tokens > 3 * self.cfg.max_scope_tokens // 4 and len(self.turns) > 1:
                self.tokens -= len(self.turns.popleft()[1])
            self.rebuild()
        else:
            self.index.append(self._next_seq, turn)
            self._next_seq += 1

    def drop_session(self, session_id: str) -> None:
        """Remove every turn of one session (the automaton cannot delete: rebuild)."""
        self.turns = deque(t for t in self.turns if t[0] != session_id)
        self.tokens = sum(len(t[1]) for t in self.turns)
        self.sessions.discard(session_id)
        self.rebuild()

    def rebuild(self) -> None:
        """Re-index the retained turns from scratch."""
        self.index = SuffixIndex(self.cfg.max_depth, self.cfg.max_tokens)
        for i, (_, turn) in enumerate(self.turns):
            self.index.append(i, turn)
        self._next_seq = len(self.turns)


class SuffixDrafter:
    """SuffixDecoding drafter with session-scoped history (see the module docstring).

    Args:
        config: Settings; defaults suit agent workloads.
        store: Optional persistent turn store (``load`` / ``append_turn``).

    Attributes:
        last_origin: Which index produced the latest draft: ``"request"``, ``"history"``
            or ``"none"``.
    """

    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None, store: TurnStore | None = None) -> None:
        self.config = config or SuffixConfig()
        self.store = store
        self.last_origin = "none"
        self.store_errors = 0
        self._requests: OrderedDict[SessionRef | None, _Request] = OrderedDict()
        self._scopes: OrderedDict[tuple[str, ...], _Scope] = OrderedDict()
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- Drafter protocol
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Draft up to ``min(max_tokens, config.max_tokens)`` tokens from the best index."""
        cfg = self.config
        limit = min(max_tokens, cfg.max_tokens)
        if limit < 1:
            return Draft(source=self.name)
        toks = ctx.tokens[-cfg.max_depth :]
        window = toks if isinstance(toks, list) else [int(t) for t in toks]
        args = (limit, cfg.max_depth, cfg.max_spec_factor, cfg.max_spec_offset,
                cfg.min_token_prob)
        best: tuple[list[int], int, float, list[int] | None] = ([], 0, 0.0, None)
        origin = "none"
        with self._lock:
            if cfg.use_request_index:
                best = self._speculate(self._request(ctx).index, window, args)
                origin = "request" if best[0] else "none"
            if cfg.use_history and ctx.session is not None:
                hist = self._speculate(self._scope(ctx.session).index, window, args)
                if hist[0] and (hist[2], hist[1]) > (best[2], best[1]):
                    best, origin = hist, "history"
        self.last_origin = origin
        return Draft(tokens=best[0], parents=best[3], score=best[2], match_len=best[1],
                     source=self.name)

    def _speculate(
        self, index: SuffixIndex, window: list[int], args: tuple[int, int, float, float, float]
    ) -> tuple[list[int], int, float, list[int] | None]:
        """One index's draft: ``(tokens, match length, score, parents or None)``."""
        if not self.config.tree:
            toks, ell, score = index.speculate(window, *args)
            return toks, ell, score, None
        tree = index.speculate_tree(window, *args)
        return tree.tokens, tree.match_len, tree.score, tree.parents

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Append the committed tokens to the request index (checked again at ``propose``)."""
        if not self.config.use_request_index:
            return
        with self._lock:
            req = self._requests.get(ctx.session)
            # Only extend the index of this very request, and only when it is in sync.
            if req is not None and len(req.tokens) == len(ctx.tokens) and req.continues(ctx):
                req.extend(result.tokens)

    def finish(self, ctx: DraftContext) -> None:
        """Drop the request index; add the whole request to its scope's history (and store)."""
        with self._lock:
            self._requests.pop(ctx.session, None)
            if ctx.session is None:
                return
            tokens = [int(t) for t in ctx.tokens]
            if self.config.use_history:
                # _scope() loads the session's stored turns first, so this turn is not
                # counted twice when it is also written to the store below.
                self._scope(ctx.session).add_turn(ctx.session.session_id, tokens)
            if self.store is not None:
                try:
                    self.store.append_turn(ctx.session, tokens)
                except AgentSpecError as exc:
                    # The answer is already produced: losing the persisted turn (an
                    # oversized session, a busy or damaged store) must not lose the answer.
                    self.store_errors += 1
                    log.warning("turn of session %s not persisted: %s", ctx.session, exc)

    # ----------------------------------------------------------------- management
    def forget(self, ref: SessionRef) -> None:
        """Remove a session's tokens from memory (request and history indexes).

        The store, if any, is not touched; delete the session there as well.
        """
        with self._lock:
            self._requests.pop(ref, None)
            key = scope_key(ref, self.config.scope)
            scope = self._scopes.get(key)
            if scope is None:
                return
            if self.config.scope == "session":
                del self._scopes[key]
            else:
                scope.drop_session(ref.session_id)

    def stats(self) -> dict[str, Any]:
        """Cached tokens per scope, index count and an estimate of the memory held."""
        with self._lock:
            scopes = {
                "/".join(key): {
                    "tokens": s.tokens,
                    "turns": len(s.turns),
                    "states": s.index.num_states,
                    "memory_bytes": s.index.memory_bytes() + 4 * s.tokens,
                }
                for key, s in self._scopes.items()
            }
            req_mem = sum(r.index.memory_bytes() + 8 * len(r.tokens)
                          for r in self._requests.values())
            return {
                "scope": self.config.scope,
                "scopes": scopes,
                "indexes": len(self._scopes) + len(self._requests),
                "active_requests": len(self._requests),
                "cached_tokens": sum(s.tokens for s in self._scopes.values()),
                "memory_bytes": req_mem + sum(s["memory_bytes"] for s in scopes.values()),
            }

    # ----------------------------------------------------------------- internals
    def _request(self, ctx: DraftContext) -> _Request:
        """The request index of ``ctx``, synced to ``ctx.tokens`` (rebuilt for a new one)."""
        req = self._requests.get(ctx.session)
        if req is None or ctx.step == 0 or not req.continues(ctx):
            req = _Request(ctx.tokens, ctx.prompt_len, self.config)
            self._requests[ctx.session] = req
            while len(self._requests) > _MAX_REQUESTS:
                self._requests.popitem(last=False)
        elif len(ctx.tokens) > len(req.tokens):
            req.extend(ctx.tokens[len(req.tokens) :])
        self._requests.move_to_end(ctx.session)
        return req

    def _evict_scope(self, keep: tuple[str, ...]) -> None:
        """Drop the least recently used index of the tenant holding the most indexes.

        A per-tenant LRU: one tenant opening many sessions evicts its own indexes, not
        every other tenant's (``key[1]`` is the tenant in every scope key).
        """
        counts: dict[str, int] = {}
        for key in self._scopes:
            counts[key[1]] = counts.get(key[1], 0) + 1
        heavy = max(counts, key=lambda t: (counts[t], t == keep[1]))
        victim = next((k for k in self._scopes if k[1] == heavy and k != keep), None)
        if victim is None:  # only ``keep`` in that tenant: the global LRU end goes
            victim = next(k for k in self._scopes if k != keep)
        del self._scopes[victim]

    def _scope(self, ref: SessionRef) -> _Scope:
        """The history index of ``ref``'s scope, loading the session's stored turns once."""
        key = scope_key(ref, self.config.scope)
        scope = self._scopes.get(key)
        if scope is None:
            scope = self._scopes[key] = _Scope(self.config)
            while len(self._scopes) > self.config.max_scopes:
                self._evict_scope(key)
        self._scopes.move_to_end(key)
        if ref.session_id not in scope.sessions:
            scope.sessions.add(ref.session_id)
            if self.store is not None:
                for turn in self.store.load(ref):
                    scope.add_turn(ref.session_id, turn)
        return scope
