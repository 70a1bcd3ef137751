"""SuffixIndex against a brute-force reference, and SuffixDrafter's request/history cycle."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from agentspec.drafters.suffix.automaton import SuffixIndex, spec_limit
from agentspec.drafters.suffix.drafter import SuffixConfig, SuffixDrafter, scope_key
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError
from agentspec.storage.sessions import persist_turn
from agentspec.types import DraftContext, SessionRef, VerifyResult


class BruteIndex:
    """Reference semantics: scan every occurrence of every string."""

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}
        self.times: dict[int, list[int]] = {}  # append clock of every token
        self.clock = 0

    def append(self, sid: int, toks: Sequence[int]) -> None:
        for t in toks:
            self.clock += 1
            self.seqs.setdefault(sid, []).append(t)
            self.times.setdefault(sid, []).append(self.clock)

    def continuations(self, w: list[int]) -> tuple[dict[int, int], dict[int, int]]:
        """Count and latest clock of each token following an occurrence of ``w``."""
        counts: dict[int, int] = {}
        last: dict[int, int] = {}
        for sid, s in self.seqs.items():
            for i in range(len(s) - len(w)):
                if s[i : i + len(w)] == w:
                    t, clock = s[i + len(w)], self.times[sid][i + len(w)]
                    counts[t] = counts.get(t, 0) + 1
                    last[t] = max(last.get(t, 0), clock)
        return counts, last

    def path_prob(self, w: list[int], path: list[int]) -> float:
        prob = 1.0
        for t in path:
            counts, _ = self.continuations(w)
            prob *= counts.get(t, 0) / max(1, sum(counts.values()))
            w = [*w, t]
        return prob

    def speculate(
        self, ctx: list[int], max_tokens: int, depth: int, factor: float, offset: float,
        min_prob: float,
    ) -> tuple[list[int], int, float]:
        window = ctx[max(0, len(ctx) - depth) :]
        best: tuple[list[int], int, float] = ([], 0, 0.0)
        for n in range(len(window), 0, -1):  # every match length; ties keep the longer
            if not self.continuations(window[-n:])[0]:
                continue
            if best[1] == 0:
                best = ([], n, 0.0)  # no draft at all: the longest match is reported
            out: list[int] = []
            w, prob, score = window[-n:], 1.0, 0.0
            while len(out) < spec_limit(n, max_tokens, factor, offset):
                counts, last = self.continuations(w)
                if not counts:
                    break
                top = max(counts, key=lambda t: (counts[t], last[t]))  # ties: most recent
                prob *= counts[top] / sum(counts.values())
                if prob < min_prob:
                    break
                out.append(top)
                score += prob
                w = [*w, top]
            if out and score > best[2] + 1e-6:
                best = (out, n, score)
        return best


def _random_case(rng: random.Random) -> tuple[SuffixIndex, BruteIndex, int, int]:
    depth, draft = rng.randint(1, 6), rng.randint(1, 6)
    idx, ref = SuffixIndex(depth, draft), BruteIndex()
    for _ in range(rng.randint(1, 25)):  # interleaved appends to a few sequences
        sid = rng.randrange(4)
        toks = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randint(0, 9))]
        idx.append(sid, toks)
        ref.append(sid, toks)
    return idx, ref, depth, draft


def test_speculate_matches_brute_force() -> None:
    rng = random.Random(1234)
    for _ in range(250):
        idx, ref, depth, draft = _random_case(rng)
        seqs = list(ref.seqs.values())
        for _ in range(4):
            if rng.random() < 0.5 and seqs:  # a prefix of an indexed sequence, maybe edited
                s = rng.choice(seqs)
                ctx = s[: rng.randint(0, len(s))] + [rng.randrange(5)] * rng.randint(0, 1)
            else:
                ctx = [rng.randrange(5) for _ in range(rng.randint(0, 12))]
            f, o = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 1.0, 4.0])
            mp = rng.choice([0.0, 0.1, 0.3, 0.6])
            got = idx.speculate(ctx, draft, depth, f, o, mp)
            want = ref.speculate(ctx, draft, depth, f, o, mp)
            assert got[1] == want[1], (ctx, ref.seqs)  # winning match length: exact
            assert got[0] == want[0], (ctx, ref.seqs)  # deterministic tie-breaking
            assert got[2] == pytest.approx(want[2])


def test_index_properties_and_tree() -> None:
    rng = random.Random(99)
    for _ in range(120):
        idx, ref, depth, draft = _random_case(rng)
        assert idx.num_states <= max(2, 2 * idx.num_tokens)
        assert idx.num_tokens == sum(len(s) for s in ref.seqs.values())
        ctx = [rng.randrange(5) for _ in range(rng.randint(1, 10))]
        chain, n, _ = idx.speculate(ctx, draft, depth, 2.0, 2.0, 0.05)
        tree = idx.speculate_tree(ctx, draft, depth, 2.0, 2.0, 0.05)
        assert tree.match_len == n
        assert len(tree.tokens) <= spec_limit(n, draft, 2.0, 2.0)
        assert tree.probs == sorted(tree.probs, reverse=True)  # best-first order
        if chain:
            assert tree.tokens[0] == chain[0]
        w = ctx[-n:] if n else []
        for i, p in enumerate(tree.parents):
            assert -1 <= p < i
            path, j = [], i
            while j != -1:
                path.append(tree.tokens[j])
                j = tree.parents[j]
            assert tree.probs[i] == pytest.approx(ref.path_prob(w, path[::-1]))
            assert tree.probs[i] >= 0.05


def test_longest_prefix_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(200):
        idx, ref, _, _ = _random_case(rng)
        for _ in range(4):
            pat = [rng.randrange(5) for _ in range(rng.randint(0, 10))]
            want = max((n for n in range(len(pat) + 1)
                        if n == 0 or any(s[i : i + n] == pat[:n] for s in ref.seqs.values()
                                         for i in range(len(s) - n + 1))), default=0)
            assert idx.longest_prefix(pat) == want, (pat, ref.seqs)


def test_edge_cases() -> None:
    idx = SuffixIndex()
    assert idx.speculate([1, 2, 3], 8) == ([], 0, 0.0)
    idx.append(7, [1, 2, 3, 4])
    assert idx.speculate([], 8) == ([], 0, 0.0)
    assert idx.speculate([9], 8) == ([], 0, 0.0)
    assert idx.speculate([1, 2], 0) == ([], 2, 0.0)
    assert idx.speculate([1, 2, 3, 4], 8)[1] == 0  # occurs only at the end: no continuation
    assert idx.speculate([2], 8, max_spec_offset=5.0) == ([3, 4], 1, 2.0)
    assert idx.seq_len(7) == 4 and idx.num_sequences == 1
    with pytest.raises(ConfigError, match="-3"):
        idx.append(0, [1, -3])
    with pytest.raises(ConfigError, match="max_depth"):
        SuffixIndex(max_depth=0)
    with pytest.raises(ConfigError, match="max_draft"):
        SuffixIndex(max_draft=0)


def test_recency_breaks_ties() -> None:
    idx = SuffixIndex()
    idx.append(0, [5, 6, 1, 9, 5, 6, 2, 9])  # "5 6" followed once by 1, later once by 2
    assert idx.speculate([5, 6], 1)[0] == [2]
    idx.append(1, [5, 6, 1])  # now 1 is the more frequent continuation
    assert idx.speculate([5, 6], 1)[0] == [1]


# --------------------------------------------------------------------- the drafter
DOC = random.Random(7).sample(range(100, 1100), 300)  # a "document" of distinct tokens
HISTORY = {"session", "agent", "tenant"}  # last_origin of a draft from a history index


def _run(drafter: SuffixDrafter, prompt: list[int], output: list[int],
         ref: SessionRef | None) -> tuple[int, list[str]]:
    """Greedy-verify ``output`` token by token as the engine does; return (steps, origins)."""
    context, steps, origins = list(prompt), 0, []
    while len(context) - len(prompt) < len(output):
        ctx = DraftContext(context, len(prompt), ref, steps)
        draft = drafter.propose(ctx, 16)
        origins.append(drafter.last_origin)
        truth = output[len(context) - len(prompt) :]
        acc = 0
        while acc < min(len(draft.tokens), len(truth) - 1) and draft.tokens[acc] == truth[acc]:
            acc += 1
        block = truth[: acc + 1]
        drafter.observe(ctx, VerifyResult(block, acc))
        context.extend(block)
        steps += 1
    drafter.finish(DraftContext(context, len(prompt), ref, steps))
    return steps, origins


def test_request_then_history_cycle() -> None:
    drafter = SuffixDrafter()
    ref = SessionRef("s1", tenant="acme", agent="editor")
    steps, origins = _run(drafter, [1, 2, *DOC, 3], DOC, ref)  # copy of the prompt
    assert steps < len(DOC) / 8 and "request" in origins
    steps, origins = _run(drafter, [4, 5, 6], DOC, ref)  # not in the prompt: from history
    assert steps < len(DOC) / 8 and HISTORY & set(origins)
    stats = drafter.stats()
    assert stats["cached_tokens"] == (len(DOC) + 3 + len(DOC)) + (3 + len(DOC))
    assert stats["active_requests"] == 0 and stats["memory_bytes"] > 0
    drafter.forget(ref)
    assert drafter.stats()["cached_tokens"] == 0
    steps, _ = _run(drafter, [4, 5, 6], DOC, ref)
    assert steps == len(DOC)


def test_request_window_bounds_the_request_match_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request index is matched on the last ``request_window`` tokens (its own suffix
    always matches, so a longer window only costs time), history indexes on ``max_depth``;
    on a copy workload both windows draft alike."""
    from agentspec.drafters.suffix import index as suffix_backends

    lengths: list[int] = []
    for cls in (suffix_backends.ArcticTree, suffix_backends.PyTree):
        original = cls.speculate

        def spy(self, window, *args, _original=original):  # type: ignore[no-untyped-def]
            lengths.append(len(window))
            return _original(self, window, *args)

        monkeypatch.setattr(cls, "speculate", spy)
    ref = SessionRef("s1", tenant="acme")
    results, seen = [], []
    for window in (8, 64):
        drafter = SuffixDrafter(SuffixConfig(request_window=window))
        _run(drafter, [9, 9, *DOC, 3], DOC, ref)  # the second request also reads history
        results.append(_run(drafter, [1, 2, *DOC, 4], DOC, ref))
        seen.append(set(lengths))
        lengths.clear()
    assert results[0] == results[1]
    assert seen[0] == {8, 64} and seen[1] == {64}


@pytest.mark.parametrize(
    ("scope", "other", "shared"),
    [
        ("session", SessionRef("s2", "acme", "editor"), False),
        ("session", SessionRef("s1", "evil", "editor"), False),
        ("agent", SessionRef("s2", "acme", "editor"), True),
        ("agent", SessionRef("s2", "acme", "coder"), False),
        ("agent", SessionRef("s1", "evil", "editor"), False),
        ("tenant", SessionRef("s9", "acme", "coder"), True),
        ("tenant", SessionRef("s1", "evil", "editor"), False),
    ],
)
def test_scope_isolation(scope: str, other: SessionRef, shared: bool) -> None:
    drafter = SuffixDrafter(SuffixConfig(scope=scope))
    _run(drafter, [7], DOC, SessionRef("s1", "acme", "editor"))
    ctx = DraftContext([8, *DOC[:20]], 1, other, 0)
    draft = drafter.propose(ctx, 16)
    if shared:
        assert draft.tokens == DOC[20:36] and drafter.last_origin in HISTORY
    else:
        assert draft.tokens == [] and drafter.last_origin == "none"
    assert scope_key(other, scope)[1] == other.tenant


def test_new_request_is_detected_without_step_zero() -> None:
    drafter = SuffixDrafter(SuffixConfig(use_history=False))
    ref = SessionRef("s1")
    first = [*DOC[:40], 1, *DOC[:40], 2]
    assert drafter.propose(DraftContext(first, len(first), ref, 0), 8).tokens == []
    # Other requests of the same session that claim step 3 (same prompt length, a new list):
    # the index must be rebuilt from their own tokens, never extended with the old ones.
    second = [*DOC[100:181], DOC[5]]  # DOC[5] was followed by DOC[6] in the first request
    assert len(second) == len(first)
    assert drafter.propose(DraftContext(second, len(second), ref, 3), 8).tokens == []
    third = [*DOC[:10], 2]
    assert drafter.propose(DraftContext(third, len(third), None, 3), 8).tokens == []
    # The same request continuing in a new list object is recognised and extended.
    grown = [*second, DOC[150]]
    assert drafter.propose(DraftContext(grown, len(second), ref, 4), 8).tokens == DOC[151:159]


class FakeStore:
    def __init__(self) -> None:
        self.turns: dict[SessionRef, list[list[int]]] = {}
        self.loads = 0

    def load(self, ref: SessionRef) -> list[list[int]]:
        self.loads += 1
        return [list(t) for t in self.turns.get(ref, [])]

    def append_turn(self, ref: SessionRef, tokens: list[int]) -> None:
        self.turns.setdefault(ref, []).append(list(tokens))


def test_store_roundtrip() -> None:
    """The drafter reads the store; the lifecycle's owner (the runtime, the vLLM proposer)
    writes every finished turn with ``persist_turn``."""
    store = FakeStore()
    ref = SessionRef("s1", "acme")
    _run(SuffixDrafter(store=store), [1], DOC, ref)
    assert store.turns == {}  # drafters never write
    assert persist_turn(store, ref, [1, *DOC])
    assert store.turns[ref] == [[1, *DOC]]
    fresh = SuffixDrafter(store=store)  # a new process: history comes from the store
    steps, origins = _run(fresh, [2], DOC, ref)
    assert steps < len(DOC) / 8 and HISTORY & set(origins)
    assert store.loads == 2  # once per process, not once per step
    assert fresh.stats()["scopes"]["session/acme/s1"]["turns"] == 2  # no double counting


def test_scope_token_budget() -> None:
    drafter = SuffixDrafter(SuffixConfig(max_scope_tokens=500))
    ref = SessionRef("s1")
    rng = random.Random(5)
    for _ in range(6):
        _run(drafter, [1], [rng.randrange(50) for _ in range(150)], ref)
    assert drafter.stats()["cached_tokens"] <= 500
    steps, _ = _run(drafter, [2], DOC[:100], ref)
    steps, origins = _run(drafter, [3], DOC[:100], ref)  # the latest turn survives eviction
    assert HISTORY & set(origins) and steps < 40


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_depth", 0),
        ("request_window", 0),
        ("max_tokens", -1),
        ("max_scope_tokens", 0),
        ("max_scopes", 0),
        ("max_spec_factor", -1.0),
        ("max_spec_offset", float("nan")),
        ("min_token_prob", 1.5),
        ("scope", "galaxy"),
    ],
)
def test_bad_config(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        SuffixConfig(**{field: value})  # type: ignore[arg-type]


def test_engine_output_unchanged_and_fewer_forwards() -> None:
    vocab = 1200
    table = {(a, b): c for a, b, c in zip(DOC, DOC[1:], DOC[2:], strict=False)}

    class CopyTarget:
        """Greedy next token = what followed the last 2 tokens in DOC (else token 0)."""

        vocab_size = vocab

        def __init__(self) -> None:
            self.cache: list[int] = []

        @property
        def num_cached(self) -> int:
            return len(self.cache)

        def _row(self, ctx: list[int]) -> torch.Tensor:
            row = torch.zeros(vocab)
            row[table.get((ctx[-2], ctx[-1]), 0) if len(ctx) > 1 else 0] = 1.0
            return row

        def prefill(self, tokens: Sequence[int], *, scope: str | None = None) -> torch.Tensor:
            self.cache = list(tokens)
            return self._row(self.cache)

        def score(self, tokens: Sequence[int]) -> torch.Tensor:
            rows = []
            for t in tokens:
                self.cache.append(t)
                rows.append(self._row(self.cache))
            return torch.stack(rows)

        def rollback(self, n: int) -> None:
            del self.cache[len(self.cache) - n :]

        def verify_cost(self, k: int) -> float:
            return 1.0

    prompt = [*DOC, 0, *DOC[:2]]
    plain = SpeculativeDecoder(CopyTarget()).generate(prompt, max_tokens=200)
    spec = SpeculativeDecoder(CopyTarget(), SuffixDrafter(), config=EngineConfig(max_draft=16))
    out = spec.generate(prompt, max_tokens=200, session=SessionRef("s1"))
    assert out.tokens == plain.tokens
    assert out.stats.forwards < plain.stats.forwards / 5
