"""A compact, online suffix index over token sequences (the SuffixDecoding data structure).

The index is a *generalised suffix automaton* (SAM) over many sequences (e.g. one per past
turn). A SAM state is a class of substrings that share their set of end positions
(``endpos``); every substring of every sequence lies in exactly one state, and the
automaton has at most ``2n`` states for ``n`` appended tokens, so memory is linear and, unlike
a depth-limited trie, does not grow with the depth. Appending a token is amortised O(1).

Counts. SuffixDecoding needs ``freq(w) = |endpos(w)|``. A new end position belongs to every
state on the suffix-link chain of the new prefix, so each append increments that chain. We
only need frequencies of strings of length ``<= cap = max_depth + max_draft`` (the matched
suffix plus the draft), so the walk starts at the state holding the prefix's length-``cap``
suffix (kept per sequence) instead of the whole prefix: at most ``cap + 1`` states, usually a
handful. Counts of states whose shortest string is longer than ``cap`` are never read. Each
counted state also records ``tim``: the index clock when its latest occurrence ended.

Speculation (``speculate``). For every suffix ``w`` of the context (``|w| <= max_depth``) that
occurs in the index *followed by a token* (longest first), greedily extend it with its most
frequent continuation: ``p(t | w) = freq(w t) / sum_u freq(w u)`` (continuation counts: an
occurrence at the very end of a sequence - e.g. the live context itself - has no next token and does
not dilute the probabilities). The cumulative product of these probabilities is the path
probability; a token is kept while it stays ``>= min_token_prob`` and the draft length is
``<= min(max_tokens, int(max_spec_factor * |w| + max_spec_offset))``. The score is the sum of
the kept tokens' path probabilities (the expected accepted length if the estimates are
calibrated); the draft of the highest score wins (ties: the longer match), as in
arctic-inference. Ties between equally frequent continuations go to the
one whose most recent occurrence was appended last (the latest version of an edited text).

Transitions are stored inline for states with at most one outgoing token (most of them in
copy-heavy text) and in a per-state dict otherwise: measured with tracemalloc, ~50-60 bytes
per token on agent edit sessions and ~190 on random tokens. Few dicts also keep GC cheap.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agentspec.errors import ConfigError

_NONE = -1  # state has no outgoing transition
_MULTI = -2  # state has >= 2 transitions, kept in SuffixIndex._multi[state]
_EPS = 1e-6  # tolerance of the length cap, as in arctic-inference


@dataclass(frozen=True)
class TreeSpeculation:
    """A token tree of the most probable continuations.

    Attributes:
        tokens: Token ids, parents always before children.
        parents: Index of each token's parent in ``tokens``; -1 for children of the root.
        probs: Path probability of each token.
        match_len: Length of the matched context suffix.
        score: Sum of ``probs``.
    """

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    match_len: int
    score: float


def spec_limit(match_len: int, max_tokens: int, factor: float, offset: float) -> int:
    """Longest draft allowed for a match: ``min(max_tokens, int(factor * len + offset))``."""
    return max(0, min(max_tokens, int(match_len * factor + offset + _EPS)))


class SuffixIndex:
    """Suffix automaton over many token sequences with occurrence counts.

    Args:
        max_depth: Longest context suffix matched by :meth:`speculate`.
        max_draft: Longest draft :meth:`speculate` returns. Frequencies are exact for strings
            of length ``<= max_depth + max_draft``, which is all speculation reads.

    Raises:
        ConfigError: ``max_depth`` or ``max_draft`` is below 1.
    """

    def __init__(self, max_depth: int = 64, max_draft: int = 64) -> None:
        if max_depth < 1:
            raise ConfigError(f"max_depth must be >= 1, got {max_depth!r}")
        if max_draft < 1:
            raise ConfigError(f"max_draft must be >= 1, got {max_draft!r}")
        self.max_depth = max_depth
        self.max_draft = max_draft
        self._cap = max_depth + max_draft
        # Per state (state 0 is the root, the empty string).
        self._len = array("i", [0])  # length of the longest string of the state
        self._link = array("i", [-1])  # suffix link
        self._cnt = array("i", [0])  # |endpos| (exact while the state's minlen <= cap)
        self._tim = array("q", [0])  # clock of the latest end position
        self._tok1 = array("i", [_NONE])  # the single outgoing token, or _NONE / _MULTI
        self._dst1 = array("i", [0])  # its target state
        self._multi: dict[int, dict[int, int]] = {}
        # Per sequence: [last state (whole prefix), length, state of the length-cap suffix].
        self._seqs: dict[int, list[int]] = {}
        self._clock = 0
        self._num_trans = 0

    # ----------------------------------------------------------------- properties
    @property
    def num_tokens(self) -> int:
        """Tokens appended over all sequences."""
        return self._clock

    @property
    def num_states(self) -> int:
        """Automaton states (at most ``2 * num_tokens``)."""
        return len(self._len)

    @property
    def num_sequences(self) -> int:
        """Sequences in the index."""
        return len(self._seqs)

    def seq_len(self, seq_id: int) -> int:
        """Tokens appended to ``seq_id`` so far (0 for an unknown sequence)."""
        rec = self._seqs.get(seq_id)
        return rec[1] if rec is not None else 0

    def memory_bytes(self) -> int:
        """Estimated bytes held (arrays exactly; dict transitions ~100 bytes each)."""
        arrays = (self._len, self._link, self._cnt, self._tim, self._tok1, self._dst1)
        flat = sum(a.itemsize * len(a) for a in arrays)
        multi = sum(len(d) for d in self._multi.values())
        return flat + 232 * len(self._multi) + 60 * multi

    # ----------------------------------------------------------------- transitions
    def _get(self, v: int, c: int) -> int:
        t = self._tok1[v]
        if t == c:
            return self._dst1[v]
        if t == _MULTI:
            return self._multi[v].get(c, _NONE)
        return _NONE

    def _set(self, v: int, c: int, x: int) -> None:
        t = self._tok1[v]
        if t == c:
            self._dst1[v] = x
        elif t == _NONE:
            self._tok1[v], self._dst1[v] = c, x
            self._num_trans += 1
        elif t == _MULTI:
            d = self._multi[v]
            self._num_trans += c not in d
            d[c] = x
        else:  # second transition: move both into a dict
            self._multi[v] = {t: self._dst1[v], c: x}
            self._tok1[v] = _MULTI
            self._num_trans += 1

    def children(self, v: int) -> list[tuple[int, int]]:
        """``(token, state)`` pairs of the transitions out of state ``v``."""
        t = self._tok1[v]
        if t >= 0:
            return [(t, self._dst1[v])]
        if t == _MULTI:
            return list(self._multi[v].items())
        return []

    def _new_state(self, length: int, link: int, like: int = -1) -> int:
        """Add a state; ``like`` copies transitions and counts (a clone)."""
        self._len.append(length)
        self._link.append(link)
        if like < 0:
            self._cnt.append(0)
            self._tim.append(0)
            self._tok1.append(_NONE)
            self._dst1.append(0)
            return len(self._len) - 1
        self._cnt.append(self._cnt[like])
        self._tim.append(self._tim[like])
        self._tok1.append(self._tok1[like])
        self._dst1.append(self._dst1[like])
        s = len(self._len) - 1
        if self._tok1[like] == _MULTI:
            self._multi[s] = dict(self._multi[like])
            self._num_trans += len(self._multi[s])
        elif self._tok1[like] >= 0:
            self._num_trans += 1
        return s

    def _clone(self, p: int, q: int, c: int) -> int:
        """Split ``q`` (reached from ``p`` by ``c``): the clone takes its strings of length
        ``<= len(p) + 1``; redirect ``c``-transitions of ``p``'s suffix chain to it."""
        clone = self._new_state(self._len[p] + 1, self._link[q], like=q)
        self._link[q] = clone
        while p != -1 and self._get(p, c) == q:
            self._set(p, c, clone)
            p = self._link[p]
        return clone

    def _extend(self, last: int, c: int) -> int:
        """Generalised-SAM extension of the prefix in state ``last`` by token ``c``; returns
        the state of the new prefix."""
        q = self._get(last, c)
        if q != _NONE:  # the new prefix already occurs (in another sequence)
            if self._len[q] == self._len[last] + 1:
                return q
            return self._clone(last, q, c)
        cur = self._new_state(self._len[last] + 1, 0)
        p = last
        while p != -1:
            q = self._get(p, c)
            if q != _NONE:
                break
            self._set(p, c, cur)
            p = self._link[p]
        if p != -1:
            self._link[cur] = q if self._len[p] + 1 == self._len[q] else self._clone(p, q, c)
        return cur

    # ----------------------------------------------------------------- building
    def append(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (created on first use).

        Raises:
            ConfigError: a token id is negative.
        """
        toks = [int(t) for t in tokens]
        if toks and min(toks) < 0:
            raise ConfigError(f"token ids must be >= 0, got {min(toks)}")
        rec = self._seqs.setdefault(seq_id, [0, 0, 0])
        last, n, dptr = rec
        cap, ln, link, cnt, tim = self._cap, self._len, self._link, self._cnt, self._tim
        for c in toks:
            last = self._extend(last, c)
            n += 1
            if n <= cap:
                dptr = last
            else:
                # dptr held the old length-cap suffix; splits may since have moved that string
                # into a clone, which is always inserted on dptr's suffix-link chain.
                while ln[link[dptr]] >= cap:
                    dptr = link[dptr]
                # The new length-cap suffix = (old length-(cap-1) suffix) + c.
                u = link[dptr] if ln[link[dptr]] == cap - 1 else dptr
                dptr = self._get(u, c)
            self._clock += 1
            now = self._clock
            v = dptr
            while v > 0:  # the new end position joins every state on the chain
                cnt[v] += 1
                tim[v] = now
                v = link[v]
        rec[0], rec[1], rec[2] = last, n, dptr

    # ----------------------------------------------------------------- querying
    def match(self, context: Sequence[int], max_depth: int | None = None) -> tuple[int, int]:
        """Longest suffix of ``context`` (``<= max_depth``) occurring with a continuation.

        Returns:
            ``(state, length)``; ``(0, 0)`` when no suffix matches.
        """
        depth = self.max_depth if max_depth is None else min(max_depth, self.max_depth)
        ln, link, tok1, multi, dst1 = self._len, self._link, self._tok1, self._multi, self._dst1
        v, ell = 0, 0
        for c in context[max(0, len(context) - depth) :]:
            while True:  # matching statistics: shorten via suffix links until c extends
                t = tok1[v]
                x = dst1[v] if t == c else (multi[v].get(c, -1) if t == _MULTI else -1)
                if x >= 0:
                    v, ell = x, ell + 1
                    break
                if v == 0:
                    ell = 0
                    break
                v = link[v]
                ell = ln[v]
        # Strings of one state share their right contexts, so if v has no outgoing token
        # none of its strings does; the next candidate is the longest string of link(v).
        while ell and tok1[v] == _NONE:
            v = link[v]
            ell = ln[v]
        return v, ell

    def longest_prefix(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of ``tokens`` that occurs somewhere in the index
        (a walk from the root: every substring of an indexed sequence is a path)."""
        v, n = 0, 0
        for c in tokens:
            v = self._get(v, c)
            if v == _NONE:
                break
            n += 1
        return n

    def _best_child(self, v: int) -> tuple[int, int, float]:
        """Most frequent continuation of state ``v`` (ties: most recent): (token, state, p)."""
        t = self._tok1[v]
        if t >= 0:
            return t, self._dst1[v], 1.0
        if t == _NONE:
            return -1, -1, 0.0
        cnt, tim = self._cnt, self._tim
        best_t, best_x, best_k, best_tim, total = -1, -1, 0, -1, 0
        for tok, x in self._multi[v].items():
            k = cnt[x]
            total += k
            if k > best_k or (k == best_k and tim[x] > best_tim):
                best_t, best_x, best_k, best_tim = tok, x, k, tim[x]
        return best_t, best_x, best_k / total

    def speculate(
        self,
        context: Sequence[int],
        max_tokens: int,
        max_depth: int = 64,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
    ) -> tuple[list[int], int, float]:
        """Best-scoring greedy continuation over the matching context suffixes.

        Args:
            context: Token ids; only the last ``max_depth`` are looked at.
            max_tokens: Most tokens drafted (also capped by the index's ``max_draft``).
            max_depth: Longest suffix matched (capped by the index's ``max_depth``).
            max_spec_factor: Draft length cap per matched token.
            max_spec_offset: Draft length cap added to ``factor * match_len``.
            min_token_prob: Stop once the path probability falls below this.

        Returns:
            ``(draft tokens, match length, score)``; ``([], 0, 0.0)`` without a match.
        """
        _, ell, out, score = self._best_match(
            context, max_tokens, max_depth, max_spec_factor, max_spec_offset, min_token_prob
        )
        return out, ell, score

    def _best_match(
        self,
        context: Sequence[int],
        max_tokens: int,
        max_depth: int,
        max_spec_factor: float,
        max_spec_offset: float,
        min_token_prob: float,
    ) -> tuple[int, int, list[int], float]:
        """The winning matched state: ``(state, match length, greedy draft, score)``; the
        longest match with an empty draft when no match drafts anything.

        Every match length competes, as in arctic-inference: a shorter suffix occurs more
        often, so its continuation statistics can be more confident than the longest
        match's (e.g. after an edit changed the last few tokens of a copied line). The
        strings of one automaton state share their continuations, so per state only its
        longest matched string matters (it earns the largest length cap), and walking the
        suffix links visits every distinct candidate from the longest match down.
        """
        v, ell = self.match(context, max_depth)
        cap = min(max_tokens, self.max_draft)
        best: tuple[int, int, list[int], float] = (v, ell, [], 0.0)
        ln, link, tok1 = self._len, self._link, self._tok1
        while ell > 0:
            limit = spec_limit(ell, cap, max_spec_factor, max_spec_offset)
            if limit <= best[3]:
                break  # score <= draft length <= limit: shorter matches cannot win
            if tok1[v] != _NONE:
                out, score = self._greedy_path(v, limit, min_token_prob)
                # A shorter match must win by more than rounding: equal scores computed
                # along different paths differ in the last bits, and ties go to the longer.
                if out and score > best[3] + _EPS:
                    best = (v, ell, out, score)
            v = link[v]
            ell = ln[v]
        return best

    def _greedy_path(self, v: int, limit: int, min_token_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent continuation from state ``v``: (tokens, score)."""
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit:
            tok, x, p = self._best_child(v)
            prob *= p
            if x < 0 or prob < min_token_prob:
                break
            out.append(tok)
            score += prob
            v = x
        return out, score

    def speculate_tree(
        self,
        context: Sequence[int],
        max_tokens: int,
        max_depth: int = 64,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
    ) -> TreeSpeculation:
        """Best-first token tree: repeatedly add the most probable unexpanded continuation.

        Same arguments as :meth:`speculate`, grown from the match :meth:`speculate` picks;
        ``max_tokens`` bounds the number of tree nodes.
        A chain equal to :meth:`speculate`'s draft is contained in the tree whenever the
        greedy path's probabilities stay the highest ones.
        """
        v, ell, _, _ = self._best_match(
            context, max_tokens, max_depth, max_spec_factor, max_spec_offset, min_token_prob
        )
        limit = spec_limit(ell, min(max_tokens, self.max_draft), max_spec_factor, max_spec_offset)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        # Heap of candidate nodes: (-path prob, -recency, insertion order, token, state,
        # parent index). Insertion order makes equal keys pop deterministically.
        heap: list[tuple[float, int, int, int, int, int]] = []
        order = 0

        def push(state: int, prob: float, parent: int) -> None:
            nonlocal order
            kids = self.children(state)
            total = sum(self._cnt[x] for _, x in kids)
            for tok, x in kids:
                p = prob * self._cnt[x] / total
                if p >= min_token_prob:
                    heapq.heappush(heap, (-p, -self._tim[x], order, tok, x, parent))
                    order += 1

        if ell > 0 and limit > 0:
            push(v, 1.0, -1)
        while heap and len(tokens) < limit:
            neg_p, _, _, tok, x, parent = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            probs.append(-neg_p)
            # Expand a node only while the tree can still take its children: a full tree's
            # last node may sit at depth ``limit``, and its children (strings of length up to
            # ``max_depth + max_draft + 1``) lie past the cap, where counts are not kept (a
            # state there may have count 0, so the children's total may be 0).
            if len(tokens) < limit:
                push(x, -neg_p, len(tokens) - 1)
        return TreeSpeculation(tokens, parents, probs, ell, sum(probs))
