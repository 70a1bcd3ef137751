"""ASD (budgeted approximate greedy): B = 0 is strict greedy, the gate / cap / budget
semantics, the vectorised acceptance against a reference loop, and the regret ledger."""

from __future__ import annotations

import random
import threading
import zlib

import pytest
import torch
from pydantic import ValidationError

from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError, RequestStateError
from agentspec.spec import AgentSpec, VerifierPolicy
from agentspec.storage.ledger import LedgerEntry, RegretLedger
from agentspec.types import Draft, SamplingParams, SessionRef
from agentspec.verifiers import (
    BlockVerifier,
    BudgetConfig,
    BudgetedVerifier,
    GreedyVerifier,
    build_verifier,
)
from agentspec.verifiers.budgeted import asd_accept
from tests.conftest import TINY_VOCAB, run_interleaved
from tests.unit.test_engine_lossless import DRAFTS, ScriptedDrafter, _random, hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_asd(
    draft: list[int], logits: torch.Tensor, budget_left: float, gate: float, cap: int
) -> tuple[int, int, float]:
    """ASD acceptance written as the obvious sequential loop."""
    k = len(draft)
    if budget_left <= 0 or cap == 0:
        budget_left, cap = 0.0, 0
    n, exceptions, spent = 0, 0, 0.0
    for i, tok in enumerate(draft):
        row = logits[i]
        best = int(row.argmax())
        if tok == best:
            n += 1
            continue
        regret = float(row[best] - row[tok])
        if cap and exceptions < cap and regret <= gate * (k - i) and spent + regret <= budget_left:
            n, exceptions, spent = n + 1, exceptions + 1, spent + regret
            continue
        break
    return n, exceptions, spent


def test_vectorised_acceptance_matches_the_reference_loop() -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):
        k, vocab = rng.randint(0, 12), rng.choice([3, 8])
        logits = torch.randn(k + 1, vocab, generator=gen) * rng.choice([0.3, 1.0, 3.0])
        best = logits.argmax(-1).tolist()
        # Mostly-right drafts with a few wrong tokens: exceptions get exercised.
        draft = [b if rng.random() < 0.7 else rng.randrange(vocab) for b in best[:k]]
        budget = rng.choice([0.0, 0.5, 2.0, 100.0])
        gate, cap = rng.choice([0.0, 0.2, 1.0, 10.0]), rng.randint(0, 3)
        out = asd_accept(torch.tensor(draft, dtype=torch.long), logits, budget, gate, cap)
        want = reference_asd(draft, logits, budget, gate, cap)
        assert (out.accepted, out.exceptions) == want[:2]
        assert out.regret == pytest.approx(want[2], abs=1e-5)


def _logits(k: int, gaps: dict[int, float]) -> tuple[torch.Tensor, list[int]]:
    """Rows whose argmax is token 0; token 1 trails it by ``gaps[i]`` in row i."""
    z = torch.full((k + 1, 4), -10.0)
    z[:, 0] = 0.0
    for i, gap in gaps.items():
        z[i, 1] = -gap
    return z, [0] * k


def test_gate_is_regret_over_remaining_length() -> None:
    z, draft = _logits(4, {0: 1.9, 3: 0.6})
    draft[0] = 1  # regret 1.9 with 4 tokens remaining: 1.9 / 4 <= 0.5
    assert asd_accept(torch.tensor(draft), z, 10.0, 0.5, 5).accepted == 4
    draft = [0, 0, 0, 1]  # regret 0.6 with 1 token remaining: 0.6 > 0.5
    out = asd_accept(torch.tensor(draft), z, 10.0, 0.5, 5)
    assert (out.accepted, out.exceptions, out.regret) == (3, 0, 0.0)


def test_block_cap_and_budget() -> None:
    z, _ = _logits(6, {1: 0.2, 3: 0.3, 5: 0.4})
    draft = [0, 1, 0, 1, 0, 1]
    assert asd_accept(torch.tensor(draft), z, 10.0, 1.0, 1).accepted == 3  # cap M = 1
    assert asd_accept(torch.tensor(draft), z, 10.0, 1.0, 2).accepted == 5
    out = asd_accept(torch.tensor(draft), z, 10.0, 1.0, 3)
    assert (out.accepted, out.exceptions, out.regret) == (6, 3, pytest.approx(0.9))
    assert asd_accept(torch.tensor(draft), z, 0.55, 1.0, 3).accepted == 5  # budget B
    assert asd_accept(torch.tensor(draft), z, 0.0, 1.0, 3).accepted == 1  # B = 0: greedy


def test_tied_logits_are_no_exception_at_zero_budget() -> None:
    z = torch.zeros(3, 4)  # every token ties: argmax is 0, regret of token 2 is 0
    assert asd_accept(torch.tensor([2, 2]), z, 0.0, 1.0, 5).accepted == 0
    assert asd_accept(torch.tensor([2, 2]), z, 1e-9, 1.0, 5).accepted == 2


def test_zero_budget_equals_the_greedy_verifier_even_with_ties() -> None:
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    strict = BudgetedVerifier(BudgetConfig(budget=0.0, gate=1e9, max_exceptions=99))
    strict.begin_request(None)
    for _ in range(300):
        k = rng.randint(0, 8)
        logits = torch.randint(0, 3, (k + 1, 5), generator=gen).float()  # ties everywhere
        draft = Draft([rng.randrange(5) for _ in range(k)])
        want = GreedyVerifier().verify(draft, logits, SamplingParams())
        assert strict.verify(draft, logits, SamplingParams()) == want


def test_verifier_commits_the_targets_argmax_after_exceptions() -> None:
    z, _ = _logits(3, {1: 0.1})
    z[3, 2] = 5.0  # bonus row: argmax 2
    v = BudgetedVerifier(BudgetConfig(budget=1.0, gate=1.0, max_exceptions=1))
    v.begin_request(None)
    res = v.verify(Draft([0, 1, 0]), z, SamplingParams())
    # Realised-prefix reuse: the token after the exception is still target-greedy.
    assert res.tokens == [0, 1, 0, 2] and res.num_accepted == 3
    assert (res.exceptions, res.regret) == (1, pytest.approx(0.1))
    account = v.account()
    assert account.spent == pytest.approx(0.1) and account.remaining == pytest.approx(0.9)


def test_budget_lifecycle_raises_on_misuse() -> None:
    """A greedy step for a request never begun (or ended), an id begun twice, or ending an
    unknown request raise RequestStateError naming the request."""
    z, _ = _logits(3, {1: 0.1})
    v = BudgetedVerifier(BudgetConfig(budget=1.0, gate=1.0, max_exceptions=1))
    with pytest.raises(RequestStateError, match="'r1'"):
        v.verify(Draft([0, 1, 0]), z, SamplingParams(), request_id="r1")
    v.begin_request(None, request_id="r1")
    with pytest.raises(RequestStateError, match="begun twice"):
        v.begin_request(None, request_id="r1")
    v.verify(Draft([0, 1, 0]), z, SamplingParams(), request_id="r1")
    v.end_request("r1")
    with pytest.raises(RequestStateError, match="'r1'"):
        v.verify(Draft([0, 1, 0]), z, SamplingParams(), request_id="r1")
    with pytest.raises(RequestStateError, match="never begun"):
        v.end_request("r1")


def test_interleaved_requests_keep_separate_budgets(tiny_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two requests alternating steps on one BudgetedVerifier (each on its own target)
    take the same exceptions, regret and tokens as each decoded alone, and the ledger
    holds the same totals; every account is released when its request stops."""
    from agentspec.targets.hf import HFTarget

    prompts = ([4, 8, 15, 16, 23, 42], [3, 1, 4, 1, 5, 9, 2, 6])
    refs = [hf_greedy(tiny_model, p, 60, None) for p in prompts]
    cfg = BudgetConfig(budget=3.0, gate=5.0, max_exceptions=3)

    def engine(verifier: BudgetedVerifier, ref: list[int]) -> SpeculativeDecoder:
        target = HFTarget(tiny_model, None, "tiny-llama", "float32", "cpu")
        return SpeculativeDecoder(target, ScriptedDrafter(DRAFTS["one_flip"], ref), verifier,
                                  config=EngineConfig(max_draft=8))

    def outcome(gen):  # type: ignore[no-untyped-def]
        return gen.tokens, gen.stats.exceptions, gen.stats.regret

    refs_session = [SessionRef(f"s{i}") for i in range(2)]
    alone_ledger = RegretLedger(tmp_path / "alone.sqlite")
    alone = [outcome(engine(BudgetedVerifier(cfg, alone_ledger), ref).generate(
        p, max_tokens=40, session=s)) for p, ref, s in zip(prompts, refs, refs_session,
                                                          strict=True)]
    # Exceptions were taken and the budget binds (each request spends ~2.8 of its 3.0).
    assert all(exc > 0 and regret > 2.0 for _, exc, regret in alone)
    ledger = RegretLedger(tmp_path / "both.sqlite")
    shared = BudgetedVerifier(cfg, ledger)
    both = run_interleaved([engine(shared, ref).steps(p, max_tokens=40, session=s)
                            for p, ref, s in zip(prompts, refs, refs_session, strict=True)])
    assert [outcome(g) for g in both] == alone
    for s in refs_session:
        assert ledger.get(s) == alone_ledger.get(s)
    assert not shared._accounts  # released by the engine


@pytest.mark.parametrize("kind", ["wrong", "one_flip", "random", "right"])
def test_zero_budget_is_token_identical_to_greedy(tiny_model, tiny_target, kind: str) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(zlib.crc32(kind.encode()))
    for trial in range(6):
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(1, 20))]
        max_new = rng.randint(5, 40)
        expected = hf_greedy(tiny_model, prompt, max_new, None)
        ref = hf_greedy(tiny_model, prompt, max_new + 20, None)
        fn = _random(rng) if kind == "random" else DRAFTS[kind]
        # A huge gate and cap: only B = 0 stands between the drafts and an exception.
        verifier = BudgetedVerifier(BudgetConfig(budget=0.0, gate=1e9, max_exceptions=99))
        engine = SpeculativeDecoder(
            tiny_target, ScriptedDrafter(fn, ref), verifier, config=EngineConfig(max_draft=8)
        )
        got = engine.generate(prompt, max_tokens=max_new)
        assert got.tokens == expected, (kind, trial)
        assert (got.stats.exceptions, got.stats.regret) == (0, 0.0)


def test_positive_budget_takes_and_reports_exceptions(tiny_model, tiny_target, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ledger = RegretLedger(tmp_path / "ledger.sqlite")
    session = SessionRef("s1", tenant="t", agent="a")
    prompt = [4, 8, 15, 16, 23, 42]
    ref = hf_greedy(tiny_model, prompt, 60, None)
    verifier = BudgetedVerifier(BudgetConfig(budget=6.0, gate=2.0, max_exceptions=2), ledger)
    engine = SpeculativeDecoder(
        tiny_target, ScriptedDrafter(DRAFTS["one_flip"], ref), verifier,
        config=EngineConfig(max_draft=8),
    )
    totals = LedgerEntry()
    for _ in range(2):
        got = engine.generate(prompt, max_tokens=40, session=session)
        assert got.stats.exceptions > 0
        assert 0 < got.stats.regret <= 6.0 + 1e-5  # request-scoped budget
        assert got.tokens != ref[:40]  # an approximation: it diverges, and says so
        totals = LedgerEntry(totals.regret + got.stats.regret,
                             totals.exceptions + got.stats.exceptions, totals.requests + 1)
    entry = RegretLedger(tmp_path / "ledger.sqlite").get(session)  # a fresh connection
    assert entry.exceptions == totals.exceptions and entry.requests == 2
    assert entry.regret == pytest.approx(totals.regret, rel=1e-6)


def test_session_scope_budget_spans_requests(tiny_model, tiny_target, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ledger = RegretLedger(tmp_path / "l.sqlite")
    session = SessionRef("s2")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = hf_greedy(tiny_model, prompt, 60, None)
    cfg = BudgetConfig(budget=3.0, gate=5.0, max_exceptions=3, scope="session")
    spent = 0.0
    for _ in range(4):
        engine = SpeculativeDecoder(  # a fresh verifier per request, like the runtime's
            tiny_target, ScriptedDrafter(DRAFTS["one_flip"], ref), BudgetedVerifier(cfg, ledger),
            config=EngineConfig(max_draft=8),
        )
        spent += engine.generate(prompt, max_tokens=40, session=session).stats.regret
    assert spent <= 3.0 + 1e-5
    assert ledger.get(session).regret == pytest.approx(spent, rel=1e-6)
    ledger.reset(session)
    assert ledger.get(session) == LedgerEntry()


def test_sampled_requests_are_verified_losslessly() -> None:
    gen = torch.Generator().manual_seed(0)
    logits, draft = torch.randn(4, 20, generator=gen), Draft([1, 2, 3])
    sp = SamplingParams(temperature=0.8)
    got = BudgetedVerifier(BudgetConfig(budget=5.0)).verify(
        draft, logits, sp, torch.Generator().manual_seed(5)
    )
    want = BlockVerifier().verify(draft, logits, sp, torch.Generator().manual_seed(5))
    assert got == want


def test_ledger_updates_are_atomic_across_threads_and_connections(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "ledger.sqlite"
    session = SessionRef("busy", tenant="x", agent="y")

    def charge() -> None:
        own = RegretLedger(path)  # each thread its own connection: SQLite locking decides
        for _ in range(50):
            own.charge(session, 0.25, 1)
        own.close()

    threads = [threading.Thread(target=charge) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ledger = RegretLedger(path)
    assert ledger.get(session) == LedgerEntry(50.0, 200, 0)
    assert ledger.entries() == {("x", "y", "busy"): LedgerEntry(50.0, 200, 0)}
    with pytest.raises(ConfigError, match="regret=-1"):
        ledger.charge(session, -1.0, 0)


def test_build_verifier_and_policy_validation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ledger = RegretLedger(tmp_path / "l.sqlite")
    policy = VerifierPolicy(mode="budgeted", budget=4.0, gate=0.3, max_exceptions=2)
    v = build_verifier(policy, ledger)
    assert isinstance(v, BudgetedVerifier) and not v.lossless
    assert v.config == BudgetConfig(budget=4.0, gate=0.3, max_exceptions=2)
    assert build_verifier(VerifierPolicy()).lossless
    with pytest.raises(ValidationError, match=r"temperature=0\.7"):
        VerifierPolicy(mode="budgeted", temperature=0.7)
    with pytest.raises(ValidationError, match="budget"):
        AgentSpec(verifier={"mode": "budgeted", "budget": -1})  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="num_drafts=4"):
        VerifierPolicy(num_drafts=4, sampler="block")
    with pytest.raises(ConfigError, match="gate"):
        BudgetConfig(gate=-1.0)


def test_an_aged_out_account_neither_fails_a_finished_request_nor_hides_an_error(
        tiny_model, tiny_target) -> None:  # type: ignore[no-untyped-def]
    """More live requests than the verifier keeps: the oldest account ages out. Ending that
    request must not turn its result into an error, nor replace the error it raised."""
    prompt = [4, 8, 15, 16, 23, 42]
    ref = hf_greedy(tiny_model, prompt, 40, None)
    verifier = BudgetedVerifier(BudgetConfig(budget=0.0))
    engine = SpeculativeDecoder(tiny_target, ScriptedDrafter(DRAFTS["right"], ref), verifier,
                                config=EngineConfig(max_draft=4))
    steps = engine.steps(prompt, max_tokens=12)
    next(steps)
    verifier._accounts.clear()  # what aging out does to this request's account
    with pytest.raises(RequestStateError, match="no live request") as err:
        for _ in steps:
            pass
    assert "cannot end request" not in str(err.value)  # the verify error, not the ending's
    # A request whose account ages out after its last step still returns its tokens.
    steps = engine.steps(prompt, max_tokens=3)
    out = None
    try:
        while True:
            next(steps)
            verifier._accounts.clear()
    except StopIteration as stop:
        out = stop.value
    assert out is not None and out.tokens == ref[:3]
