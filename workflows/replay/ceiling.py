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

A cache drafter does need one: it continues an occurrence of the context's last tokens.
``ceiling_match<k>`` (:class:`MatchedCopyCeilingDrafter`) is the tenant ceiling restricted
to copies that follow an occurrence of the context's last ``k`` tokens, the occurrence
chosen by an oracle. It bounds every drafter that needs ``k`` tokens of matched context,
however well it scores its candidates: with ``k = 1`` the oracle picks among every
occurrence of the last token (thousands, for a newline), with ``k = 2`` among those of the
last two tokens.

Text is indexed in a suffix automaton per scope (tenant, or tenant and session), one
sequence per chain of turns: a prompt that extends the chain's text (agents resend the
conversation) appends only its new tokens; one that does not (a truncated history) starts a
new sequence. Matches never span two sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agentspec.drafters.oracle import OracleDrafter
from agentspec.drafters.suffix.automaton import SuffixIndex
from agentspec.errors import ConfigError
from agentspec.types import Draft, DraftContext

SCOPES = ("session", "tenant")
# k tokens -> every (chain, position) they end just before
_Grams = dict[tuple[int, ...], list[tuple[int, int]]]
#: Method-name prefix of :class:`MatchedCopyCeilingDrafter` (``ceiling_match2``: ``k = 2``).
MATCH_PREFIX = "ceiling_match"


def _scope_key(ctx: DraftContext, scope: str) -> tuple[str, ...]:
    """Whose text a request may copy from: its tenant's, or its session's within the tenant
    (``scope``); a request without a session copies only from itself."""
    s = ctx.session
    if s is None:
        return ("request", str(ctx.request_id))
    return (s.tenant,) if scope == "tenant" else (s.tenant, s.session_id)


class _Chains:
    """The text one scope's cache could hold, as chains of turns (module docstring): a
    context that extends a chain appends its new tokens to it, any other starts a chain.
    ``on_new(seq, chain, start)`` is told of every append: tokens ``start:`` of chain
    ``seq``."""

    def __init__(self, on_new: Callable[[int, list[int], int], None]) -> None:
        self.chains: list[list[int]] = []
        self._on_new = on_new

    def extend_to(self, tokens: Sequence[int]) -> int:
        """The chain that ``tokens`` extends (created if none), holding all of them."""
        toks = list(tokens)
        for seq, chain in enumerate(self.chains):
            n = len(chain)
            if len(toks) >= n and toks[:n] == chain:
                if len(toks) > n:
                    chain.extend(toks[n:])
                    self._on_new(seq, chain, n)
                return seq
        self.chains.append(toks)
        self._on_new(len(self.chains) - 1, toks, 0)
        return len(self.chains) - 1


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
        # Per scope key: the index and the chains of turns it holds.
        self._texts: dict[tuple[str, ...], tuple[SuffixIndex, _Chains]] = {}

    def _index(self, ctx: DraftContext) -> SuffixIndex:
        """The scope's index, extended to hold every token of ``ctx``."""
        key = _scope_key(ctx, self.scope)
        text = self._texts.get(key)
        if text is None:
            # Only root walks are used: the counts' depth (1 + 1) keeps appends cheap.
            index = SuffixIndex(max_depth=1, max_draft=1)
            text = self._texts[key] = (
                index, _Chains(lambda seq, chain, start: index.append(seq, chain[start:])))
        text[1].extend_to(ctx.tokens)
        return text[0]

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """The longest copyable prefix of the answer's next ``max_tokens`` tokens."""
        index = self._index(ctx)  # the context is indexed whether or not it drafts
        want = super().propose(ctx, max_tokens).tokens
        toks = want[: index.longest_prefix(want)]
        return Draft(tokens=toks, score=float(len(toks)), source=self.name)

    def finish(self, ctx: DraftContext) -> None:
        """Index the finished turn (the next ``propose`` indexes committed tokens)."""
        self._index(ctx)


class MatchedCopyCeilingDrafter(OracleDrafter):
    """The tenant copy ceiling restricted to copies that follow an occurrence of the
    context's last ``k`` tokens (module docstring): the bound of every cache drafter that
    continues a matched context of ``k`` tokens, whatever its choice among them.

    Args:
        k: Matched context tokens a copy must follow (>= 1).

    Raises:
        ConfigError: ``k < 1``.
    """

    def __init__(self, k: int = 2) -> None:
        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k!r}")
        super().__init__()
        self.k = k
        self.name = f"{MATCH_PREFIX}{k}"
        # Per tenant: the chains, and every position by the k tokens ending before it
        # (k-gram -> [(chain, position)]): the copies a k-token context can continue.
        self._texts: dict[tuple[str, ...], tuple[_Chains, _Grams]] = {}

    def _text(self, ctx: DraftContext) -> tuple[_Chains, _Grams]:
        """The tenant's chains and k-gram positions, extended to hold ``ctx``."""
        key = _scope_key(ctx, "tenant")
        text = self._texts.get(key)
        if text is None:
            grams: _Grams = {}
            k = self.k

            def on_new(seq: int, chain: list[int], start: int) -> None:
                for pos in range(max(k, start), len(chain)):
                    grams.setdefault(tuple(chain[pos - k : pos]), []).append((seq, pos))

            text = self._texts[key] = (_Chains(on_new), grams)
        text[0].extend_to(ctx.tokens)
        return text

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """The longest copy of the answer's next ``max_tokens`` tokens that follows an
        occurrence of the context's last ``k`` tokens."""
        chains, grams = self._text(ctx)
        want = super().propose(ctx, max_tokens).tokens
        n = len(ctx.tokens)
        best = 0
        if want and n >= self.k:
            for seq, pos in grams.get(tuple(ctx.tokens[n - self.k :]), ()):
                chain = chains.chains[seq]
                # The request's own chain ends at the context: only committed tokens copy.
                end = min(len(chain), pos + len(want))
                length = 0
                while pos + length < end and chain[pos + length] == want[length]:
                    length += 1
                if length > best:
                    best = length
                    if best == len(want):
                        break
        toks = want[:best]
        return Draft(tokens=toks, score=float(len(toks)), source=self.name)

    def finish(self, ctx: DraftContext) -> None:
        """Index the finished turn (the next ``propose`` indexes committed tokens)."""
        self._text(ctx)
