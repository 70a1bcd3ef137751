"""The copy ceiling: what a cache drafter could accept if it always picked the right copy.

At every step the ceiling drafts the longest continuation of the real answer (up to
``max_draft`` tokens) that occurs verbatim in the text the session cache could hold at that
moment:

* ``ceiling_session``: the request's context (prompt and tokens generated so far) and the
  session's earlier turns;
* ``ceiling_tenant``: the same plus every earlier run of the tenant (what the default's
  ``scope="tenant"`` history may read).

No cache drafter can accept more from copying (it drafts only what its indexes hold), so a
method's accepted length over the tenant ceiling is the share of the copyable text its
scoring finds; the gap is the drafter's choice among the continuations it holds, not
missing text. The ceiling does not need a matching context suffix to find a copy, so it
is an upper bound, not a drafter.

Text is indexed in a suffix automaton per scope (tenant, or tenant and session), one
sequence per chain of turns: a prompt that extends the chain's text (agents resend the
conversation) appends only its new tokens; one that does not (a truncated history) starts a
new sequence. Matches never span two sequences.
"""

from __future__ import annotations

from agentspec.drafters.oracle import OracleDrafter
from agentspec.drafters.suffix.automaton import SuffixIndex
from agentspec.errors import ConfigError
from agentspec.types import Draft, DraftContext

SCOPES = ("session", "tenant")


class CopyCeilingDrafter(OracleDrafter):
    """Drafts the longest copyable continuation of the known answer (module docstring):
    the oracle's draft (``add`` registers each prompt's answer), cut where the text the
    scope's cache could hold stops containing it.

    Args:
        scope: ``"session"`` or ``"tenant"``: the text the copies may come from.

    Raises:
        ConfigError: an unknown scope.
    """

    def __init__(self, scope: str = "tenant") -> None:
        if scope not in SCOPES:
            raise ConfigError(f"scope must be one of {SCOPES}, got {scope!r}")
        super().__init__()
        self.scope = scope
        self.name = f"ceiling_{scope}"
        # Per scope key: the index and its chains (indexed tokens per sequence id).
        self._indexes: dict[tuple[str, ...], SuffixIndex] = {}
        self._chains: dict[tuple[str, ...], list[list[int]]] = {}

    def _key(self, ctx: DraftContext) -> tuple[str, ...]:
        s = ctx.session
        if s is None:
            return ("request", str(ctx.request_id))
        return (s.tenant,) if self.scope == "tenant" else (s.tenant, s.session_id)

    def _index(self, ctx: DraftContext) -> SuffixIndex:
        """The scope's index, extended to hold every token of ``ctx``."""
        key = self._key(ctx)
        index = self._indexes.get(key)
        if index is None:
            # Only root walks are used: the counts' depth (1 + 1) keeps appends cheap.
            index = self._indexes[key] = SuffixIndex(max_depth=1, max_draft=1)
            self._chains[key] = []
        chains = self._chains[key]
        tokens = list(ctx.tokens)
        for seq, chain in enumerate(chains):
            n = len(chain)
            if len(tokens) >= n and tokens[:n] == chain:
                if len(tokens) > n:
                    index.append(seq, tokens[n:])
                    chain.extend(tokens[n:])
                return index
        index.append(len(chains), tokens)
        chains.append(tokens)
        return index

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """The longest copyable prefix of the answer's next ``max_tokens`` tokens."""
        index = self._index(ctx)  # the context is indexed whether or not it drafts
        want = super().propose(ctx, max_tokens).tokens
        toks = want[: index.longest_prefix(want)]
        return Draft(tokens=toks, score=float(len(toks)), source=self.name)

    def finish(self, ctx: DraftContext) -> None:
        """Index the finished turn (the next ``propose`` indexes committed tokens)."""
        self._index(ctx)
