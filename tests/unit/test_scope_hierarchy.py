"""The session cache's scope hierarchy and its request lifecycle keyed by request id."""

from __future__ import annotations

import random
import threading

import pytest

from agentspec.drafters import SuffixConfig, SuffixDrafter
from agentspec.drafters.suffix.drafter import visible_keys
from agentspec.drafters.suffix.index import Speculation, arctic_available, new_tree
from agentspec.tokens import common_prefix
from agentspec.types import DraftContext, SessionRef, VerifyResult

BACKENDS = ["python", "arctic"] if arctic_available() else ["python"]


def _run(drafter: SuffixDrafter, prompt: list[int], output: list[int], ref: SessionRef | None,
         rid: str | None = None, max_draft: int = 16) -> list[list[int]]:
    """Greedy-verify ``output`` as the engine does; the drafts proposed at each step."""
    context, drafts = list(prompt), []
    while len(context) - len(prompt) < len(output):
        ctx = DraftContext(context, len(prompt), ref, len(drafts), rid)
        draft = drafter.propose(ctx, max_draft)
        drafts.append(list(draft.tokens))
        truth = output[len(context) - len(prompt) :]
        acc = 0
        while acc < min(len(draft.tokens), len(truth) - 1) and draft.tokens[acc] == truth[acc]:
            acc += 1
        drafter.observe(ctx, VerifyResult(truth[: acc + 1], acc))
        context.extend(truth[: acc + 1])
    drafter.finish(DraftContext(context, len(prompt), ref, len(drafts), rid))
    return drafts


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scope", ["session", "agent", "tenant"])
def test_never_drafts_across_tenants(backend: str, scope: str, tree: bool) -> None:
    # Each tenant writes tokens from its own range; whatever the scope, sessions and
    # agents, every draft for a tenant holds only tokens of that tenant's range.
    rng = random.Random(11)
    ranges = {"acme": (100, 160), "evil": (200, 260)}
    drafter = SuffixDrafter(SuffixConfig(scope=scope, backend=backend, max_tokens=16,
                                         tree=tree))
    docs = {t: [rng.randrange(*r) for _ in range(120)] for t, r in ranges.items()}
    for turn in range(12):
        tenant = ("acme", "evil")[turn % 2]
        ref = SessionRef(f"s{turn % 3}", tenant=tenant, agent=("a", "b")[turn % 4 // 2])
        lo, hi = ranges[tenant]
        doc = docs[tenant]
        start = rng.randrange(0, 60)
        prompt = [lo, *doc[start : start + 30]]
        output = doc[start + 10 : start + 70]
        for draft in _run(drafter, prompt, output, ref, rid=f"r{turn}"):
            assert all(lo <= t < hi for t in draft), (tenant, draft)
        # A request of the other tenant whose context is one of this tenant's tokens: its
        # own index holds nothing to continue, and no index of this tenant may answer.
        other = "evil" if tenant == "acme" else "acme"
        for ref_other in (SessionRef("new", tenant=other), SessionRef(ref.session_id, other,
                                                                        ref.agent)):
            probe = DraftContext([doc[start + 5]], 1, ref_other, 0, f"probe{turn}")
            assert drafter.propose(probe, 16).tokens == []
            drafter.stop_request(probe)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hierarchy_reads_agent_and_tenant_history_by_scope(backend: str) -> None:
    doc = random.Random(3).sample(range(100, 1100), 200)
    for scope, agent_sees, tenant_sees in [("session", False, False), ("agent", True, False),
                                           ("tenant", True, True)]:
        drafter = SuffixDrafter(SuffixConfig(scope=scope, backend=backend))
        _run(drafter, [1], doc, SessionRef("s1", tenant="acme", agent="editor"), rid="a")
        for ref, sees in [(SessionRef("s2", "acme", "editor"), agent_sees),
                          (SessionRef("s3", "acme", "coder"), tenant_sees),
                          (SessionRef("s1", "acme", "editor"), True)]:
            ctx = DraftContext([7, *doc[:20]], 1, ref, 0, f"probe-{ref.session_id}")
            draft = drafter.propose(ctx, 16)
            assert (draft.tokens == doc[20:36]) == sees, (scope, ref)
            if sees:
                assert drafter.last_origin in ("session", "agent", "tenant")
            drafter.stop_request(ctx)


def test_visible_keys_always_hold_the_tenant() -> None:
    ref = SessionRef("s", tenant="t", agent="a")
    keys = visible_keys(ref, "tenant")
    assert [k[0] for k in keys] == ["session", "agent", "tenant"]
    assert all(k[1] == "t" for k in keys)
    assert visible_keys(ref, "session") == [("session", "t", "s")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_requests_of_one_session_draft_as_alone(backend: str) -> None:
    # Two requests of one session interleaved step by step (and then in two threads)
    # draft exactly what each drafts alone, each with its own request index.
    rng = random.Random(5)
    doc = rng.sample(range(100, 1100), 300)
    ref = SessionRef("s1", tenant="acme")
    jobs = {"r1": ([1, *doc[:80], 2], doc[:80]), "r2": ([3, *doc[100:200], 4], doc[100:200])}

    def alone(rid: str) -> list[list[int]]:
        return _run(SuffixDrafter(SuffixConfig(backend=backend)), *jobs[rid], ref, rid)

    expected = {rid: alone(rid) for rid in jobs}
    shared = SuffixDrafter(SuffixConfig(backend=backend))
    got: dict[str, list[list[int]]] = {}

    def worker(rid: str) -> None:
        got[rid] = _run(shared, *jobs[rid], ref, rid, 16)

    threads = [threading.Thread(target=worker, args=(rid,)) for rid in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected
    assert shared.requests_started == 2


@pytest.mark.parametrize("observed", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_index_holds_in_flight_answers(backend: str, observed: bool) -> None:
    """With ``use_outputs`` a request drafts from another session's answer while that one
    is still being generated, whether its tokens arrive by ``observe`` (the engine) or only
    as a longer context at the next ``propose`` (vLLM's proposer); never across tenants."""
    doc = random.Random(11).sample(range(100, 1100), 200)
    a = SessionRef("s1", tenant="acme")

    def drafter_after_a(use_outputs: bool) -> SuffixDrafter:
        d = SuffixDrafter(SuffixConfig(backend=backend, use_outputs=use_outputs))
        context = [1, 2, 3]
        for step, i in enumerate(range(0, 120, 8)):  # request "a" generates doc[:120]
            ctx = DraftContext(context, 3, a, step, "a")
            d.propose(ctx, 16)
            if observed:
                d.observe(ctx, VerifyResult(doc[i : i + 8], 7))
            context = context + doc[i : i + 8]
        d.propose(DraftContext(context, 3, a, 99, "a"), 16)  # syncs the last block
        return d

    prompt = [7, 8, 9, *doc[:30]]
    for use_outputs in (True, False):
        d = drafter_after_a(use_outputs)
        draft = d.propose(DraftContext(prompt, len(prompt), SessionRef("s2", tenant="acme"),
                                       0, "b"), 16)
        if use_outputs:
            assert d.last_origin == "outputs" and draft.tokens[:8] == doc[30:38]
        else:
            assert not draft.tokens  # "a" has not finished: no history holds its answer
        other = d.propose(DraftContext(prompt, len(prompt), SessionRef("s2", tenant="evil"),
                                       0, "c"), 16)
        assert not other.tokens


def test_request_index_is_carried_into_the_sessions_next_turn() -> None:
    drafter = SuffixDrafter()
    ref = SessionRef("s1")
    doc = random.Random(9).sample(range(100, 1100), 100)
    _run(drafter, [1, *doc[:50]], doc[50:], ref, rid="t0")
    carried = drafter.stats()["active_requests"]
    assert carried == 0
    # The next prompt resends the conversation and appends a tool result.
    prompt = [1, *doc, 5, 6]
    ctx = DraftContext(prompt + doc[:3], len(prompt), ref, 0, "t1")
    assert drafter.propose(ctx, 8).tokens == doc[3:11]
    with drafter._lock:
        assert drafter._requests[("id", "t1")].carried


def test_common_prefix() -> None:
    a = list(range(1000))
    assert common_prefix(a, [*a, 5]) == 1000
    assert common_prefix(a, [*a[:700], 0, *a[701:]]) == 700
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [2]) == 0


def test_backends_agree_on_a_copy_workload() -> None:
    if not arctic_available():
        pytest.skip("arctic-inference not installed: only the Python index exists")
    doc = random.Random(4).sample(range(100, 1100), 200)
    ref = SessionRef("s")
    steps = {}
    for backend in ("python", "arctic"):
        d = SuffixDrafter(SuffixConfig(backend=backend))
        _run(d, [1, *doc, 2], doc, ref, "a")
        steps[backend] = len(_run(d, [3], doc, ref, "b"))
    assert steps["python"] == steps["arctic"] <= len(doc) // 12


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_backends_answer_a_named_speculation(backend: str) -> None:
    """A chain has no tree fields; a tree's parents and path probabilities line up with its
    tokens and its score is their sum; an unmatched window drafts nothing."""
    tree = new_tree(backend, 64, 32)
    tree.extend(0, [7, 8, 1, 2, 3, 4])
    chain = tree.speculate([7, 8, 1], 8, 2.0, 2.0, 0.0, False)
    assert isinstance(chain, Speculation)
    # arctic's tree stops at the shortest match that scores best; the automaton at the longest
    assert chain.tokens == [2, 3, 4] and chain.score == 3.0 and 1 <= chain.match_len <= 3
    assert chain.parents is None and chain.probs is None
    tree.extend(1, [8, 1, 5, 6])  # a second continuation of ``8 1``
    branched = tree.speculate([7, 8, 1], 8, 2.0, 2.0, 0.0, True)
    assert branched.parents is not None and branched.probs is not None
    assert len(branched.tokens) == len(branched.parents) == len(branched.probs) >= 2
    assert branched.parents[0] == -1 and branched.match_len >= 1
    assert branched.score == pytest.approx(sum(branched.probs))
    assert tree.speculate([9], 8, 2.0, 2.0, 0.0, False) == Speculation([], 0, 0.0)


def test_carried_indexes_and_latest_turns_stay_within_their_token_budgets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agentspec.drafters.suffix import drafter as session_cache

    monkeypatch.setattr(session_cache, "_CARRY_TOKENS", 500)
    monkeypatch.setattr(session_cache, "_LAST_TURN_TOKENS", 800)
    drafter = SuffixDrafter(SuffixConfig(backend="python"))
    rng = random.Random(2)
    for i in range(12):
        ref = SessionRef(f"s{i % 5}")
        _run(drafter, [rng.randrange(100, 900) for _ in range(120)], [5, 6, 7], ref, f"r{i}")
        with drafter._lock:
            assert drafter._carry.total_weight == sum(r.n for r in drafter._carry.values()) <= 500
            assert drafter._last_turn.total_weight == sum(map(len, drafter._last_turn.values()))
            assert drafter._last_turn.total_weight <= 800
    drafter.forget(SessionRef("s1"))
    with drafter._lock:
        assert drafter._carry.total_weight == sum(r.n for r in drafter._carry.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_levels_nobody_reads_are_built_when_first_read(backend: str) -> None:
    """A finished turn goes into the agent level at once; the session level (read only by
    a request that does not extend its previous turn) and a tenant level holding its one
    agent's turns wait as pending turns. A request that reads them builds them, and drafts
    what an eagerly built index drafts."""
    doc = random.Random(13).sample(range(100, 1100), 120)
    ref = SessionRef("s1", tenant="acme", agent="editor")
    drafter = SuffixDrafter(SuffixConfig(backend=backend))
    _run(drafter, [1, 2, 3], doc, ref, "t1")
    scopes = drafter.stats()["scopes"]
    pending = {k: v["pending_tokens"] for k, v in scopes.items()}
    assert pending["agent/acme/editor"] == 0
    assert pending["session/acme/s1"] == pending["tenant/acme"] == 3 + len(doc)
    # The next turn does not extend the previous one: it reads the session level.
    drafts = _run(drafter, [7, 8, *doc[:10]], doc[10:40], ref, "t2")
    assert drafts[0][:8] == doc[10:18]
    # Built by that read; only the turn just finished waits (2 + 10 + 30 new tokens).
    assert drafter.stats()["scopes"]["session/acme/s1"]["pending_tokens"] == 42
    # A second agent's turn: the tenant level no longer mirrors one agent, and is built.
    other = SessionRef("s2", tenant="acme", agent="coder")
    _run(drafter, [5, 5, 5], doc[60:90], other, "t3")
    assert drafter.stats()["scopes"]["tenant/acme"]["pending_tokens"] == 0
    assert _run(drafter, [9, 9, *doc[60:70]], doc[70:90], SessionRef("s3", "acme", "x"),
                "t4")[0][:8] == doc[70:78]


def test_pending_turns_are_evicted_and_dropped_like_indexed_ones() -> None:
    from agentspec.drafters.suffix.levels import Pool

    pool = Pool(new_tree("python", 64, 32))
    pool.add("a", 1, [1, 2, 3, 4], budget=100)
    pool.add("b", 2, [5, 6, 7], budget=100, lazy=True)
    pool.add("a", 3, [8, 9], budget=100, lazy=True)
    assert pool.pending_tokens == 5 and pool.tokens == 9
    pool.drop_session("a")  # one indexed turn, one pending
    assert (pool.tokens, pool.pending_tokens, [t[1] for t in pool.turns]) == (3, 3, [2])
    pool.add("c", 4, list(range(10, 20)), budget=12, lazy=True)  # evicts pending turn 2
    assert (pool.tokens, pool.pending_tokens, [t[1] for t in pool.turns]) == (10, 10, [4])
    pool.ready(limit=1)  # one turn at least, whole
    assert pool.pending_tokens == 0 and pool.memory_bytes() > 0
