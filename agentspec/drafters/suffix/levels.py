"""The parts of the session cache below the drafter: which indexes a request may read,
the live request index, the history indexes and the per-tenant score calibration.

See :mod:`agentspec.drafters.suffix.drafter` for how they fit together.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from agentspec.drafters.suffix.index import Speculation, Tree
from agentspec.lru import LRU
from agentspec.payoff.estimators import DecayedRatios
from agentspec.tokens import common_prefix
from agentspec.types import DraftContext, SessionRef

SCOPES = ("session", "agent", "tenant")


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


class RequestIndex:
    """One live request: its index and how many of its tokens the index holds."""

    def __init__(self, tokens: Sequence[int], ctx: DraftContext, tree: Tree) -> None:
        self.tree = tree
        self.n = len(tokens)
        self.prompt_len = ctx.prompt_len
        self.session = ctx.session
        self.last = int(tokens[-1]) if self.n else -1
        self.ref: Sequence[int] = ctx.tokens  # the caller's list (identity: same request)
        self.cands: list[tuple[str, Speculation]] = []  # last step's drafts, to calibrate
        self.out: tuple[Pool, int] | None = None  # (outputs index, this request's sequence)
        self.out_n = 0
        self.pools: list[tuple[str, Pool]] = []  # the history indexes it reads
        self.carried = False  # its prompt extends the session's previous turn
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


class Calibration:
    """Per index level, how the drafts' scores compare with what the target accepted.

    Every candidate draft of a step (not just the one sent) is checked against the tokens
    the step committed, so each level's score is calibrated on every step for free. The
    sums decay (half-life ~70 steps) so the calibration follows the workload.
    """

    DECAY = 0.99
    PRIOR = 4.0  # pseudo-steps where accepted == score (ratio 1 before any evidence)

    def __init__(self) -> None:
        # The decayed sums [Σ accepted, Σ score] per cell (the draft gate's calibration
        # keeps the same sums: one class, one formula).
        self.cells: DecayedRatios[tuple[str, int]] = DecayedRatios()

    @staticmethod
    def key(level: str, match_len: int) -> tuple[str, int]:
        """Calibration cell: the level and the match length's power-of-two bucket (a
        one-token match and a 40-token match of one index are not equally reliable)."""
        return level, min(match_len, 64).bit_length()

    def ratio(self, level: str, match_len: int) -> float:
        """Accepted tokens per unit of score at ``level`` for matches of this length."""
        return self.cells.ratio(self.key(level, match_len), self.PRIOR)

    def learn(self, cands: Sequence[tuple[str, Speculation]], committed: Sequence[int]) -> None:
        """Score each candidate against the committed tokens (a prefix of the truth)."""
        for level, spec in cands:
            if spec.parents is not None:
                continue  # tree drafts: the chosen branch is unknown here
            n = common_prefix(spec.tokens, committed)
            self.cells.learn(self.key(level, spec.match_len), n, spec.score, self.DECAY)


# Most tokens a read of a history index moves from its pending turns into its tree: a
# level that starts being read with a long backlog (a tenant's second agent appears) is
# built over several steps (~0.16 s each at ~2.5 us per token) instead of in one stall.
FLUSH_TOKENS = 1 << 16

#: Session ids one history index remembers as loaded from the store (LRU beyond it).
MAX_LOADED_SESSIONS = 16_384


class Pool:
    """One history index and the turns it holds (oldest first, for eviction).

    Turns can be recorded lazily (``add(..., lazy=True)``): they wait in ``pending`` and
    reach the tree when the index is read (:meth:`ready`) or when a later turn is added
    eagerly. A level no request reads is then never built: the session level of a session
    whose requests all extend their previous turn, or a tenant level holding exactly its one
    agent's turns (the drafter reads the narrower of two levels with the same turns).
    Pending turns are always the newest ones, in order, so the tree receives the same
    sequence of turns either way.
    """

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.turns: deque[tuple[str, int, int]] = deque()  # (session id, seq id, tokens)
        self.tokens = 0
        # Sessions whose stored turns are loaded, oldest first; bounded (MAX_LOADED_SESSIONS):
        # a tenant opening session after session must not grow it forever. A session
        # forgotten here and seen again reloads its turns (a duplicate in the tree: it
        # shifts counts, never a verified token).
        self.sessions: LRU[str, None] = LRU(MAX_LOADED_SESSIONS)
        self.pending: deque[tuple[int, list[int]]] = deque()  # (seq id, tokens), oldest first
        self.pending_tokens = 0

    def add(self, session_id: str, seq_id: int, tokens: list[int], budget: int,
            lazy: bool = False) -> None:
        """Record one turn's new tokens (indexed now unless ``lazy``); drop the oldest turns
        above ``budget`` tokens."""
        self.pending.append((seq_id, tokens))
        self.pending_tokens += len(tokens)
        self.turns.append((session_id, seq_id, len(tokens)))
        self.tokens += len(tokens)
        if not lazy:
            self.ready()
        self.trim(budget)

    def trim(self, budget: int) -> None:
        """Drop the oldest turns while the index holds more than ``budget`` tokens (the
        newest turn always stays)."""
        while self.tokens > budget and len(self.turns) > 1:
            _, sid, n = self.turns.popleft()
            self._discard(sid, n)
            self.tokens -= n

    def ready(self, limit: int = FLUSH_TOKENS) -> Tree:
        """The tree, after indexing pending turns (oldest first, up to ``limit`` tokens;
        a single longer turn is indexed whole)."""
        done = 0
        while self.pending and done < limit:
            seq_id, tokens = self.pending.popleft()
            self.tree.extend(seq_id, tokens)
            self.pending_tokens -= len(tokens)
            done += len(tokens)
        return self.tree

    def memory_bytes(self) -> int:
        """The tree's size plus the pending turns' token lists (8 bytes per token)."""
        return self.tree.memory_bytes() + 8 * self.pending_tokens

    def _discard(self, seq_id: int, n: int) -> None:
        """Forget one turn: out of the tree, or out of ``pending`` if never indexed."""
        for i, (sid, _) in enumerate(self.pending):
            if sid == seq_id:
                del self.pending[i]
                self.pending_tokens -= n
                return
        self.tree.remove(seq_id)

    def drop_session(self, session_id: str) -> None:
        """Remove every turn of one session."""
        for _, sid, n in [t for t in self.turns if t[0] == session_id]:
            self._discard(sid, n)
            self.tokens -= n
        self.turns = deque(t for t in self.turns if t[0] != session_id)
        self.sessions.pop(session_id)

    def mark_loaded(self, session_id: str) -> None:
        """Note that ``session_id``'s stored turns are in this index (bounded LRU)."""
        self.sessions.put(session_id, None)


def lazy_levels(pools: list[tuple[str, Pool]]) -> list[bool]:
    """Which history levels a finished turn is added to lazily (see :class:`Pool`).

    Finishing a turn indexes its new tokens once per level: on agent logs, with long tool
    results per turn, that cost more than all the drafting steps of the turn together.
    Two levels are usually not read:

    * the session level, read only by a request that does not extend its session's
      previous turn (one that does carries that turn's index, which holds the session);
    * a level holding the same turns as the narrower one (a tenant with one agent): the
      drafter reads only the narrower.

    Reads build a lazy level, so this changes when indexing is paid, not what is drafted
    (except while a backlog above ``FLUSH_TOKENS`` is still being built, read by read).
    """
    lazy, narrower = [], -1
    for level, pool in pools:
        if level == "session":
            lazy.append(True)
            continue
        lazy.append(len(pool.turns) == narrower)
        narrower = len(pool.turns)
    return lazy
