"""SuffixDecoding as a drafter: a request index plus a hierarchy of history indexes.

Each decode step drafts from every index the request may see and keeps the draft with the
highest score (its expected accepted length: the sum of the draft tokens' path
probabilities; ties go to the narrower index):

* the **request** index over the current prompt and the tokens generated so far, created
  when a request starts and extended in :meth:`SuffixDrafter.observe`;
* the **session** index over the session's earlier turns;
* the **agent** index over every session of the request's agent (same tenant);
* the **tenant** index over every session of the tenant.

``SuffixConfig.scope`` is the widest level a request reads (``"session"``: request and
session; ``"agent"``: + agent; ``"tenant"``: all four). Whatever the scope, every key holds
the tenant, so a tenant's tokens are never drafted for another tenant. Requests without a
:class:`~agentspec.types.SessionRef` use the request index only. When two levels hold the
same turns (a tenant with one agent) only the narrower one is searched.

A finished turn adds to the history only what the session's previous turn did not already
hold (agents resend the conversation: the new tool results and the new answer), plus
``max_depth`` tokens before them so their start is matched in context.

Requests are keyed by ``DraftContext.request_id`` when the caller sets one (the engine,
vLLM): concurrent requests of one session keep separate indexes. Without an id the
request is keyed by its session and a new one is recognised from ``step == 0`` or a
context that no longer extends the indexed one (the pre-lifecycle behaviour).

Persistence: with a ``store`` (see :class:`TurnStore`), finished turns are written with
``store.append_turn`` and a session's stored turns are loaded into its indexes the first
time this process sees that session. Sessions this process never sees are not loaded into
the agent / tenant indexes (the store is only read per session).

The indexes live in arctic-inference's C++ suffix tree when it is installed and in the
pure-Python suffix automaton otherwise (:mod:`agentspec.drafters.suffix_backends`).
"""

from __future__ import annotations

import logging
import math
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentspec.drafters.suffix_backends import BACKENDS, Tree, new_tree, resolve_backend
from agentspec.errors import AgentSpecError, ConfigError
from agentspec.types import Draft, DraftContext, SessionRef, VerifyResult

log = logging.getLogger(__name__)

SCOPES = ("session", "agent", "tenant")
_MAX_REQUESTS = 256  # live request indexes kept (requests that never finish age out)


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
        scope: The widest history a request reads: ``"session"``, ``"agent"`` or
            ``"tenant"`` (always within its tenant; see the module docstring).
        max_scope_tokens: Tokens kept per history index; the oldest turns are dropped.
        max_scopes: History indexes kept in memory (least recently used are dropped; they
            are reloaded from the store, if any, when needed again).
        use_request_index: Consult the per-request index.
        use_history: Consult (and fill) the history indexes.
        tree: Draft a small token tree (the most probable continuations, best first, at
            most ``max_tokens`` nodes) instead of one chain; the engine verifies its
            branches in one batched forward (greedy requests only).
        backend: ``"auto"`` (arctic-inference's C++ tree when installed), ``"arctic"`` or
            ``"python"``.
    """

    max_depth: int = 64
    max_spec_factor: float = 2.0
    max_spec_offset: float = 8.0
    min_token_prob: float = 0.1
    max_tokens: int = 32
    scope: str = "tenant"
    max_scope_tokens: int = 1_048_576
    max_scopes: int = 256
    use_request_index: bool = True
    use_history: bool = True
    tree: bool = False
    backend: str = "auto"

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
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


def scope_key(ref: SessionRef, scope: str) -> tuple[str, ...]:
    """The history index of one level for a session; the tenant is always part of it."""
    if scope == "session":
        return ("session", ref.tenant, ref.session_id)
    if scope == "agent":
        return ("agent", ref.tenant, ref.agent)
    return ("tenant", ref.tenant)


def visible_keys(ref: SessionRef, scope: str) -> list[tuple[str, ...]]:
    """Every history index a request of ``ref`` may read under ``scope``, narrowest first."""
    return [scope_key(ref, level) for level in SCOPES[: SCOPES.index(scope) + 1]]


def novel_start(prev: Sequence[int], cur: Sequence[int]) -> int:
    """Length of the common prefix of a session's previous turn and its next one."""
    n = min(len(prev), len(cur))
    i = 0
    while i < n and prev[i] == cur[i]:
        i += 1
    return i


class _Request:
    """One live request: its index and how many of its tokens the index holds."""

    def __init__(self, tokens: Sequence[int], ctx: DraftContext, tree: Tree) -> None:
        self.tree = tree
        self.n = len(tokens)
        self.prompt_len = ctx.prompt_len
        self.session = ctx.session
        self.last = int(tokens[-1]) if self.n else -1
        self.ref: Sequence[int] = ctx.tokens  # the caller's list (identity: same request)
        self.tree.extend(0, [int(t) for t in tokens])

    def extend(self, tokens: Sequence[int]) -> None:
        """Index committed tokens of this request."""
        new = [int(t) for t in tokens]
        if new:
            self.tree.extend(0, new)
            self.n += len(new)
            self.last = new[-1]

    def continues(self, ctx: DraftContext) -> bool:
        """Without a request id: does ``ctx`` extend what this index holds? (The seam is
        checked; the caller's list object is trusted, as the engine grows it in place.)"""
        toks = ctx.tokens
        if ctx.prompt_len != self.prompt_len or len(toks) < self.n:
            return False
        if self.n and int(toks[self.n - 1]) != self.last:
            return False
        if toks is not self.ref:
            if not isinstance(toks, list) or len(toks) != self.n:
                return False
            self.ref = toks
        return True


class _Pool:
    """One history index and the turns it holds (oldest first, for eviction)."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.turns: deque[tuple[str, int, int]] = deque()  # (session id, seq id, tokens)
        self.tokens = 0
        self.sessions: set[str] = set()  # sessions whose stored turns are loaded

    def add(self, session_id: str, seq_id: int, tokens: list[int], budget: int) -> None:
        """Index one turn's new tokens; drop the oldest turns above ``budget`` tokens."""
        self.tree.extend(seq_id, tokens)
        self.turns.append((session_id, seq_id, len(tokens)))
        self.tokens += len(tokens)
        while self.tokens > budget and len(self.turns) > 1:
            _, sid, n = self.turns.popleft()
            self.tree.remove(sid)
            self.tokens -= n

    def drop_session(self, session_id: str) -> None:
        """Remove every turn of one session."""
        for _, sid, n in [t for t in self.turns if t[0] == session_id]:
            self.tree.remove(sid)
            self.tokens -= n
        self.turns = deque(t for t in self.turns if t[0] != session_id)
        self.sessions.discard(session_id)


class SuffixDrafter:
    """SuffixDecoding drafter over a request index and a scope hierarchy (module docstring).

    Args:
        config: Settings; defaults suit agent workloads.
        store: Optional persistent turn store (``load`` / ``append_turn``).

    Attributes:
        last_origin: Which index produced the latest draft: ``"request"``, ``"session"``,
            ``"agent"``, ``"tenant"`` or ``"none"``.
    """

    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None, store: TurnStore | None = None) -> None:
        self.config = config or SuffixConfig()
        self.store = store
        self.backend = resolve_backend(self.config.backend)
        self.last_origin = "none"
        self.store_errors = 0
        self._requests: OrderedDict[Hashable, _Request] = OrderedDict()
        self._pools: OrderedDict[tuple[str, ...], _Pool] = OrderedDict()
        self._last_turn: dict[tuple[str, str], Sequence[int]] = {}  # (tenant, session) -> tokens
        self._seq = 0
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- request lifecycle
    def start_request(self, ctx: DraftContext) -> None:
        """Begin a request: index ``ctx.tokens`` (replaces a live request of the same key)."""
        with self._lock:
            self._start(ctx)

    def stop_request(self, ctx: DraftContext) -> None:
        """End a request without adding it to any history (aborted, or not worth keeping)."""
        with self._lock:
            self._requests.pop(_request_key(ctx), None)

    # ----------------------------------------------------------------- Drafter protocol
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Draft up to ``min(max_tokens, config.max_tokens)`` tokens from the best index."""
        cfg = self.config
        limit = min(max_tokens, cfg.max_tokens)
        if limit < 1:
            return Draft(source=self.name)
        toks = ctx.tokens[-cfg.max_depth :]
        window = toks if isinstance(toks, list) else [int(t) for t in toks]
        args = (limit, cfg.max_spec_factor, cfg.max_spec_offset, cfg.min_token_prob, cfg.tree)
        best: tuple[list[int], int, float, list[int] | None] = ([], 0, 0.0, None)
        origin = "none"
        with self._lock:
            if cfg.use_request_index:
                best = self._sync(ctx).tree.speculate(window, *args)
                origin = "request" if best[0] else "none"
            if cfg.use_history and ctx.session is not None:
                seen = -1
                for level, pool in self._pools_for(ctx.session):
                    if len(pool.turns) == seen:
                        continue  # same turns as the narrower level (nested): same draft
                    seen = len(pool.turns)
                    if not seen:
                        continue
                    cand = pool.tree.speculate(window, *args)
                    if cand[0] and cand[2] > best[2]:
                        best, origin = cand, level
        self.last_origin = origin
        return Draft(tokens=list(best[0]), parents=list(best[3]) if best[3] else None,
                     score=best[2], match_len=best[1], source=self.name)

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Append the committed tokens to the request index."""
        if not self.config.use_request_index:
            return
        with self._lock:
            req = self._requests.get(_request_key(ctx))
            # Only extend the index of this very request, and only when it is in sync.
            if req is not None and req.n == len(ctx.tokens):
                req.extend(result.tokens)

    def finish(self, ctx: DraftContext) -> None:
        """End the request; add its new tokens to the history indexes (and the store)."""
        with self._lock:
            self._requests.pop(_request_key(ctx), None)
            if ctx.session is None:
                return
            tokens = [int(t) for t in ctx.tokens]
            if self.config.use_history:
                # Stored turns are loaded first, so this one is not counted twice when it
                # is also written to the store below.
                pools = [p for _, p in self._pools_for(ctx.session)]
                prev: Sequence[int] = self._last_turn.get(
                    (ctx.session.tenant, ctx.session.session_id), [])
                for pool in pools:
                    self._index_turn(pool, ctx.session.session_id, prev, tokens)
                self._last_turn[(ctx.session.tenant, ctx.session.session_id)] = array("i", tokens)
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
        """Remove a session's tokens from memory (its requests and every history index).

        The store, if any, is not touched; delete the session there as well.
        """
        with self._lock:
            for key in [k for k, r in self._requests.items() if r.session == ref]:
                del self._requests[key]
            self._last_turn.pop((ref.tenant, ref.session_id), None)
            for key in visible_keys(ref, "tenant"):
                pool = self._pools.get(key)
                if pool is None:
                    continue
                if key[0] == "session":
                    del self._pools[key]
                else:
                    pool.drop_session(ref.session_id)

    def stats(self) -> dict[str, Any]:
        """Cached tokens per index, index count and the memory held."""
        with self._lock:
            pools = {
                "/".join(key): {"tokens": p.tokens, "turns": len(p.turns),
                                "memory_bytes": p.tree.memory_bytes()}
                for key, p in self._pools.items()
            }
            req_mem = sum(r.tree.memory_bytes() for r in self._requests.values())
            req_tokens = sum(r.n for r in self._requests.values())
            cached = sum(p.tokens for k, p in self._pools.items() if k[0] == "session")
            memory = req_mem + sum(p["memory_bytes"] for p in pools.values())
            indexed = req_tokens + sum(p.tokens for p in self._pools.values())
            return {
                "scope": self.config.scope,
                "backend": self.backend,
                "scopes": pools,
                "indexes": len(self._pools) + len(self._requests),
                "active_requests": len(self._requests),
                "cached_tokens": cached,
                "memory_bytes": memory,
                "bytes_per_indexed_token": memory / indexed if indexed else 0.0,
            }

    # ----------------------------------------------------------------- internals
    def _start(self, ctx: DraftContext) -> _Request:
        cfg = self.config
        req = _Request(ctx.tokens, ctx, new_tree(self.backend, cfg.max_depth, cfg.max_tokens))
        key = _request_key(ctx)
        self._requests[key] = req
        self._requests.move_to_end(key)
        while len(self._requests) > _MAX_REQUESTS:
            self._requests.popitem(last=False)
        return req

    def _sync(self, ctx: DraftContext) -> _Request:
        """The request index of ``ctx``, holding exactly ``ctx.tokens``."""
        req = self._requests.get(_request_key(ctx))
        if req is None:
            return self._start(ctx)
        if ctx.request_id is None:
            if ctx.step == 0 or not req.continues(ctx):
                return self._start(ctx)
        elif len(ctx.tokens) < req.n:  # a preempted request restarting: rebuild
            return self._start(ctx)
        if len(ctx.tokens) > req.n:
            req.extend(ctx.tokens[req.n :])
        return req

    def _pools_for(self, ref: SessionRef) -> list[tuple[str, _Pool]]:
        """``(level, index)`` of every history ``ref`` may read, narrowest first; the
        session's stored turns are loaded (one ``store.load``) into those that lack them."""
        cfg = self.config
        out: list[tuple[str, _Pool]] = []
        missing: list[_Pool] = []
        for key in visible_keys(ref, cfg.scope):
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = _Pool(new_tree(self.backend, cfg.max_depth,
                                                         cfg.max_tokens))
            self._pools.move_to_end(key)
            if ref.session_id not in pool.sessions:
                pool.sessions.add(ref.session_id)
                missing.append(pool)
            out.append((key[0], pool))
        while len(self._pools) > cfg.max_scopes:
            self._pools.popitem(last=False)
        if missing and self.store is not None:
            prev: list[int] = []
            for turn in self.store.load(ref):
                cur = [int(t) for t in turn]
                for pool in missing:
                    self._index_turn(pool, ref.session_id, prev, cur)
                prev = cur
            if prev:
                self._last_turn[(ref.tenant, ref.session_id)] = array("i", prev)
        return out

    def _index_turn(self, pool: _Pool, session_id: str, prev: Sequence[int],
                    tokens: list[int]) -> None:
        """Add the part of ``tokens`` the session's previous turn did not hold."""
        start = max(0, novel_start(prev, tokens) - self.config.max_depth)
        new = tokens[start:][-self.config.max_scope_tokens :]
        if new:
            self._seq = (self._seq + 1) & 0x7FFFFFFF
            pool.add(session_id, self._seq, new, self.config.max_scope_tokens)


def _request_key(ctx: DraftContext) -> Hashable:
    """Requests are keyed by their id when they have one, else by their session."""
    return ("id", ctx.request_id) if ctx.request_id is not None else ("session", ctx.session)
