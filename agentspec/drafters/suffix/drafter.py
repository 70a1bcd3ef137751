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

Persistence: the drafter only reads the ``store`` (see :class:`TurnStore`): a session's
stored turns are loaded into its indexes the first time this process sees that session.
Whoever owns the request lifecycle writes every finished turn, whichever drafter ran
(:class:`agentspec.runtime.Runtime`, the vLLM proposer, through
:func:`agentspec.storage.sessions.persist_turn`). Sessions this process never sees are not
loaded into the agent / tenant indexes (the store is only read per session).

The indexes live in arctic-inference's C++ suffix tree when it is installed and in the
pure-Python suffix automaton otherwise (:mod:`agentspec.drafters.suffix.index`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from agentspec.drafters.suffix.config import SuffixConfig
from agentspec.drafters.suffix.draft_tree import merge_trees
from agentspec.drafters.suffix.index import (
    Speculation,
    new_tree,
    resolve_backend,
)
from agentspec.drafters.suffix.levels import (
    SCOPES,
    Calibration,
    Pool,
    RequestIndex,
    lazy_levels,
    scope_key,
    visible_keys,
)
from agentspec.errors import AgentSpecError
from agentspec.interfaces import TurnStore
from agentspec.lru import LRU
from agentspec.requests import REQUESTS, Slot
from agentspec.tokens import common_prefix
from agentspec.types import Draft, DraftContext, SessionRef, VerifyResult

__all__ = ["SCOPES", "SuffixConfig", "SuffixDrafter", "TurnStore", "scope_key",
           "visible_keys"]

log = logging.getLogger(__name__)

# Finished request indexes kept for their session's next request, in tokens (~150 MB with
# the C++ tree at ~290 bytes per token), and latest turns kept to find a turn's new tokens
# (8 bytes per token: the token objects are shared with the caller's lists).
_CARRY_TOKENS = 1 << 19
_LAST_TURN_TOKENS = 1 << 22


def _request_tokens(req: RequestIndex) -> int:
    return req.n


def _neg_score(spec: Speculation) -> float:
    return -spec.score


class SuffixDrafter:
    """SuffixDecoding drafter over a request index and a scope hierarchy (module docstring).

    Args:
        config: Settings; defaults suit agent workloads.
        store: Optional persistent turn store, read here (``load``), written by the owner
            of the request lifecycle.

    Attributes:
        last_origin: Which index produced the latest draft of any request (a diagnostic:
            nothing reads it back): ``"request"``, ``"session"``, ``"agent"``,
            ``"tenant"``, ``"outputs"``, ``"tree"`` (several merged into one tree draft)
            or ``"none"``.
    """

    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None, store: TurnStore | None = None) -> None:
        self.config = config or SuffixConfig()
        self.store = store
        self.backend = resolve_backend(self.config.backend)
        self.last_origin = "none"
        self.requests_started = 0  # request indexes built or carried (lifecycle starts)
        # Each live request's index, in the one home of per-request state (agentspec.requests).
        self._requests: Slot[RequestIndex] = REQUESTS.slot("suffix")
        # History indexes by scope key, least recently used first (bounded by
        # config.max_scopes with a per-tenant rule: _evict_pool).
        self._pools: LRU[tuple[str, ...], Pool] = LRU()
        # Per (tenant, session): the tokens of its latest finished turn and, while the next
        # request has not started, that turn's request index (agents resend the
        # conversation, so the next prompt usually extends it: the index is carried over
        # and extended instead of rebuilt from a 30k-token prompt).
        # Both bounded by tokens (the latest turn is kept whatever its length).
        self._last_turn: LRU[tuple[str, str], list[int]] = LRU(
            max_weight=_LAST_TURN_TOKENS, weight=len, min_items=1)
        self._carry: LRU[tuple[str, str], RequestIndex] = LRU(
            max_weight=_CARRY_TOKENS, weight=_request_tokens)
        self._calib: dict[str, Calibration] = {}
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
            self._requests.pop(ctx.state_key)

    # ----------------------------------------------------------------- Drafter protocol
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Draft up to ``min(max_tokens, config.max_tokens)`` tokens from the best index."""
        cfg = self.config
        limit = min(max_tokens, cfg.max_tokens)
        if limit < 1:
            return Draft(source=self.name)
        toks = ctx.tokens[-cfg.max_depth :]
        window = toks if isinstance(toks, list) else [int(t) for t in toks]
        # A tree draft merges every index's tree of up to ``limit`` nodes and keeps the best
        # ``limit`` (offering fewer per index loses accepted length on agent logs).
        args = (limit, cfg.max_spec_factor, cfg.max_spec_offset, cfg.min_token_prob, cfg.tree)
        cands: list[tuple[str, Speculation]] = []  # non-empty drafts, narrowest index first
        req: RequestIndex | None = None
        with self._lock:
            if cfg.use_request_index:
                req = self._sync(ctx)
                spec = req.tree.speculate(window[-cfg.request_window :], *args)
                if spec.tokens:
                    cands.append(("request", spec))
            if cfg.use_history and ctx.session is not None:
                pools = req.pools if req is not None else self._visible(ctx.session, False)
                seen = -1
                for level, pool in pools:
                    if len(pool.turns) == seen:
                        continue  # same turns as the narrower level (nested): same draft
                    seen = len(pool.turns)
                    if not seen:
                        continue
                    spec = pool.ready().speculate(window, *args)
                    if spec.tokens:
                        cands.append((level, spec))
                if cfg.use_outputs and req is not None and req.out is not None:
                    spec = req.out[0].tree.speculate(window, *args)
                    if spec.tokens:
                        cands.append(("outputs", spec))
            best = Speculation([], 0, 0.0)
            origin = "none"
            if len(cands) == 1:
                origin, best = cands[0]
            elif cands and cfg.tree:
                best, origin = self._merged(cands, limit), "tree"
            elif cands:
                calib, value = self._calibration(ctx), 0.0
                for level, spec in cands:
                    # The expected accepted length: the index's own estimate (its score),
                    # scaled by how that level's estimates have turned out for this tenant.
                    v = spec.score * calib.ratio(level, spec.match_len)
                    if v > value:
                        best, origin, value = spec, level, v
                if req is not None and cfg.calibrate:
                    req.cands = cands
        self.last_origin = origin
        # Both backends return fresh lists (no copy needed) and valid trees (parents
        # before children: arctic's speculation, the merge), so no check is needed either.
        return Draft.trusted(best.tokens, best.parents or None, best.score, best.match_len,
                             self.name)

    @staticmethod
    def _merged(cands: list[tuple[str, Speculation]], limit: int) -> Speculation:
        """Every index's draft tree merged into one (:func:`merge_trees`), the index with
        the highest score (its expected accepted length) first, so its continuation is the
        merged tree's first branch. Nodes are weighed by their path probabilities alone:
        per-level calibration learns from chains (a tree's accepted branch is not known to
        the drafter), and replayed on agent logs weighing by it changed nothing."""
        # A stable sort: on equal scores the narrowest index stays first.
        specs = sorted([spec for _, spec in cands], key=_neg_score)
        toks, parents, score = merge_trees(
            [(1.0, s.tokens, s.parents or [], s.probs or []) for s in specs], limit)
        return Speculation(toks, max([s.match_len for s in specs]), score, parents)

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        """Append the committed tokens to the request index."""
        if not self.config.use_request_index:
            return
        with self._lock:
            req = self._requests.get(ctx.state_key)
            # Only extend the index of this very request, and only when it is in sync.
            if req is not None and req.n == len(ctx.tokens):
                if req.cands:
                    self._calibration(ctx).learn(req.cands, result.tokens)
                    req.cands = []
                self._commit(req, result.tokens)

    def finish(self, ctx: DraftContext) -> None:
        """End the request; add its new tokens to the history indexes (the caller
        persists the turn: see the module docstring)."""
        with self._lock:
            req = self._requests.pop(ctx.state_key)
            if ctx.session is None:
                return
            tokens = [int(t) for t in ctx.tokens]
            if req is not None and req.n < len(tokens):
                req.extend(tokens[req.n :])
            if req is not None:
                self._close_outputs(req, ctx.session.session_id)
            if self.config.use_history:
                # Stored turns are loaded first, so this one is not counted twice when it
                # is also written to the store below.
                pools = self._pools_for(ctx.session)
                skey = (ctx.session.tenant, ctx.session.session_id)
                new = self._novel(self._last_turn.get(skey, []), tokens)
                for pool, lazy in zip([p for _, p in pools], lazy_levels(pools), strict=True):
                    self._index_new(pool, ctx.session.session_id, new, lazy)
            self._remember(ctx.session, tokens, req)

    # ----------------------------------------------------------------- management
    def forget(self, ref: SessionRef) -> None:
        """Remove a session's tokens from memory (its requests and every history index).

        The store, if any, is not touched; delete the session there as well.
        """
        with self._lock:
            for key in [k for k, r in self._requests.items() if r.session == ref]:
                self._requests.pop(key)
            self._last_turn.pop((ref.tenant, ref.session_id))
            self._carry.pop((ref.tenant, ref.session_id))
            for key in visible_keys(ref, "tenant"):
                pool = self._pools.get(key)
                if pool is None:
                    continue
                if key[0] == "session":
                    self._pools.pop(key)
                else:
                    pool.drop_session(ref.session_id)

    def stats(self) -> dict[str, Any]:
        """Cached tokens per index, index count and the memory held."""
        with self._lock:
            pools = {
                "/".join(key): {"tokens": p.tokens, "turns": len(p.turns),
                                "pending_tokens": p.pending_tokens,
                                "memory_bytes": p.memory_bytes()}
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
    def _start(self, ctx: DraftContext) -> RequestIndex:
        cfg = self.config
        self.requests_started += 1
        req = self._carried(ctx) or RequestIndex(
            ctx.tokens, ctx, new_tree(self.backend, cfg.max_depth, cfg.max_tokens))
        self._attach_outputs(ctx, req)
        if ctx.session is not None and cfg.use_history:
            req.pools = self._visible(ctx.session, req.carried)
        key = ctx.state_key
        self._requests.put(key, req)
        return req

    def _attach_outputs(self, ctx: DraftContext, req: RequestIndex) -> None:
        """Give a new request a sequence in its scope's outputs index (the answers alone,
        as arctic's global tree: what the model writes, not what tools return)."""
        cfg = self.config
        if not (cfg.use_outputs and cfg.use_history and ctx.session is not None):
            return
        key = ("outputs", *scope_key(ctx.session, cfg.scope)[1:])
        pool = self._pools.get(key)
        if pool is None:
            pool = Pool(new_tree(self.backend, cfg.max_depth, cfg.max_tokens))
            self._pools.put(key, pool)
        self._seq = (self._seq + 1) & 0x7FFFFFFF
        req.out, req.out_n = (pool, self._seq), 0

    def _close_outputs(self, req: RequestIndex, session_id: str) -> None:
        """Account a finished request's answer in its outputs index (for eviction)."""
        if req.out is None:
            return
        pool, seq = req.out
        req.out = None
        pool.turns.append((session_id, seq, req.out_n))
        pool.trim(self.config.max_scope_tokens)

    def _sync(self, ctx: DraftContext) -> RequestIndex:
        """The request index of ``ctx``, holding exactly ``ctx.tokens``."""
        req = self._requests.get(ctx.state_key)
        if req is None:
            return self._start(ctx)
        if ctx.request_id is None:
            if ctx.step == 0 or not req.continues(ctx):
                return self._start(ctx)
        elif len(ctx.tokens) < req.n:  # a preempted request restarting: rebuild
            return self._start(ctx)
        if len(ctx.tokens) > req.n:  # committed without an observe call (vLLM's proposer)
            self._commit(req, ctx.tokens[req.n :])
        return req

    @staticmethod
    def _commit(req: RequestIndex, tokens: Sequence[int]) -> None:
        """Index generated tokens: in the request index, and in the outputs index too when
        the request has one (its answer joins it as it is generated, as in arctic's global
        tree: concurrent requests draft from each other's answers)."""
        req.extend(tokens)
        if req.out is not None:
            pool, seq = req.out
            pool.tree.extend(seq, [int(t) for t in tokens])
            pool.tokens += len(tokens)
            req.out_n += len(tokens)

    def _visible(self, ref: SessionRef, carried: bool) -> list[tuple[str, Pool]]:
        """The history indexes a request of ``ref`` drafts from. A request whose prompt
        extends its session's previous turn holds all of that session's history in its
        own index already, so the session level is left out."""
        pools = self._pools_for(ref)
        return pools[1:] if carried else pools

    def _evict_pool(self, keep: set[tuple[str, ...]]) -> None:
        """Drop the least recently used index of the tenant holding the most indexes.

        A per-tenant LRU: one tenant opening many sessions evicts its own indexes, not
        every other tenant's (``key[1]`` is the tenant in every pool key). Evicted session
        history is reloaded from the store, if any, when needed again.
        """
        counts: dict[str, int] = {}
        for key in self._pools:
            counts[key[1]] = counts.get(key[1], 0) + 1
        heavy = max(counts, key=lambda t: counts[t])
        victim = next((k for k in self._pools if k[1] == heavy and k not in keep), None)
        if victim is None:  # only indexes this request reads in that tenant: global LRU end
            victim = next((k for k in self._pools if k not in keep), next(iter(self._pools)))
        self._pools.pop(victim)

    def _pools_for(self, ref: SessionRef) -> list[tuple[str, Pool]]:
        """``(level, index)`` of every history ``ref`` may read, narrowest first; the
        session's stored turns are loaded (one ``store.load``) into those that lack them."""
        cfg = self.config
        out: list[tuple[str, Pool]] = []
        missing: list[Pool] = []
        for key in visible_keys(ref, cfg.scope):
            pool = self._pools.get(key)
            if pool is None:
                pool = Pool(new_tree(self.backend, cfg.max_depth, cfg.max_tokens))
                self._pools.put(key, pool)
            self._pools.touch(key)
            # A one-off request's session was never stored: nothing to load or remember.
            if not ref.ephemeral and ref.session_id not in pool.sessions:
                missing.append(pool)
            out.append((key[0], pool))
        keep = set(visible_keys(ref, cfg.scope))
        while len(self._pools) > cfg.max_scopes:
            self._evict_pool(keep)
        if missing and self.store is not None:
            try:
                stored = self.store.load(ref)
            except AgentSpecError as exc:
                # Draft without the stored history (slower, never wrong); the session stays
                # unloaded, so its next request reads the store again.
                log.warning("stored turns of session %s not loaded: %s", ref, exc)
                return out
            for pool in missing:
                pool.mark_loaded(ref.session_id)
            prev: list[int] = []
            for turn in stored:
                cur = [int(t) for t in turn]
                new = self._novel(prev, cur)
                for pool in missing:  # built when read (this request reads some now)
                    self._index_new(pool, ref.session_id, new, lazy=True)
                prev = cur
            if prev and (ref.tenant, ref.session_id) not in self._last_turn:
                self._remember(ref, prev, None)
        return out

    def _calibration(self, ctx: DraftContext) -> Calibration:
        """The tenant's calibration of each level's scores (kept per tenant: nothing,
        not even aggregate statistics, crosses tenants)."""
        tenant = ctx.session.tenant if ctx.session is not None else ""
        cal = self._calib.get(tenant)
        if cal is None:
            cal = self._calib[tenant] = Calibration()
        return cal

    def _novel(self, prev: Sequence[int], tokens: list[int]) -> list[int]:
        """What a turn adds to its session's previous one, with ``max_depth`` tokens of
        left context so its start is matched in context."""
        start = max(0, common_prefix(prev, tokens) - self.config.max_depth)
        return tokens[start:][-self.config.max_scope_tokens :]

    def _index_new(self, pool: Pool, session_id: str, new: list[int], lazy: bool) -> None:
        """Add a turn's new tokens to one history index (``lazy``: when it is next read)."""
        if new:
            self._seq = (self._seq + 1) & 0x7FFFFFFF
            pool.add(session_id, self._seq, new, self.config.max_scope_tokens, lazy)

    def _remember(self, ref: SessionRef, tokens: list[int], req: RequestIndex | None) -> None:
        """Keep a session's latest turn (and its index, to carry into the next request)."""
        key = (ref.tenant, ref.session_id)
        self._last_turn.put(key, tokens)
        self._carry.pop(key)
        if req is not None and req.n == len(tokens):
            self._carry.put(key, req)

    def _carried(self, ctx: DraftContext) -> RequestIndex | None:
        """The session's previous request index when ``ctx.tokens`` extends its tokens."""
        if ctx.session is None:
            return None
        key = (ctx.session.tenant, ctx.session.session_id)
        req = self._carry.pop(key)
        prev = self._last_turn.get(key)
        if req is None or prev is None or len(ctx.tokens) < len(prev):
            return None
        if list(ctx.tokens[: len(prev)]) != prev:
            return None
        req.prompt_len, req.ref, req.carried = ctx.prompt_len, ctx.tokens, True
        req.extend(ctx.tokens[req.n :])
        return req
