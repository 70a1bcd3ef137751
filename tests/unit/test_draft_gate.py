"""The draft gate (agentspec.drafters.gate) and the context-aware cost curve it prices with
(agentspec.targets.costs): decisions, calibration, tenant isolation, losslessness."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from agentspec.drafters.gate import DraftGate, GateConfig, bucket
from agentspec.engine import SpeculativeDecoder
from agentspec.errors import AgentSpecError
from agentspec.factory import build_drafter, build_engine
from agentspec.spec import AgentSpec, DraftingPolicy, VerifierPolicy
from agentspec.targets import costs
from agentspec.targets.cost_curves import CostCurves
from agentspec.targets.linear import ProductForms
from agentspec.types import Draft, DraftContext, SessionRef, VerifyResult
from tests.conftest import TINY_VOCAB


def steep(k: int, context: int) -> float:
    """c(k, L) shaped as measured: c(33)/c(1) ~1.7 at 100 positions, ~4.8 at 8,000."""
    return 1.0 + (k - 1) * (0.02 + context / 80000)


def flat(k: int, context: int) -> float:
    return 1.0


def ctx(tokens: list[int], rid: str = "r", tenant: str = "t") -> DraftContext:
    return DraftContext(tokens, len(tokens), SessionRef("s", tenant=tenant), 0, rid)


def test_followed_length_walks_chains_and_trees() -> None:
    # The full-length label of a draft: what the gate and the HVD policy learn from.
    chain = Draft([5, 6, 7])
    assert chain.followed_length([5, 6, 9]) == 2
    assert chain.followed_length([5, 6, 7, 8]) == 3  # the leaf: all of it
    assert chain.followed_length([5, 6]) is None  # not known yet
    assert chain.followed_length([9]) == 0
    # root -> 5 -> {6, 8}; 6 -> 7
    tree = Draft([5, 6, 8, 7], [-1, 0, 0, 1])
    assert tree.followed_length([5, 8, 1]) == 2
    assert tree.followed_length([5, 6, 7]) == 3
    assert tree.followed_length([5, 6, 3]) == 2
    assert tree.followed_length([5]) is None
    assert Draft([]).followed_length([]) == 0


def test_buckets_are_powers_of_two() -> None:
    assert [bucket(m) for m in (0, 1, 2, 3, 4, 7, 8, 64, 500)] == [0, 1, 2, 2, 3, 3, 4, 7, 7]


def test_the_gate_prices_drafts_by_context_length() -> None:
    draft = Draft.trusted(list(range(10, 26)), None, 2.0, 1, "suffix")  # 16 tokens, ŷ = 2
    gate = DraftGate(steep)
    assert gate.length(draft, 100, 1.0) == 16  # short context: the whole draft is cheap
    assert gate.length(draft, 8000, 1.0) < 16  # long context: cut or skipped
    assert DraftGate(flat).length(draft, 8000, 1.0) == 16
    sure = Draft.trusted(list(range(10, 26)), None, 16.0, 40, "suffix")  # ŷ = n: a copy
    assert gate.length(sure, 8000, 1.0) == 16
    hopeless = Draft.trusted([3, 4, 5, 6], None, 0.05, 1, "suffix")
    assert gate.length(hopeless, 8000, 1.0) == 0
    unscored = Draft([3, 4, 5, 6])  # a drafter without scores is not gated
    assert gate.length(unscored, 8000, 1.0) == 4


def test_calibration_learns_per_tenant_and_per_bucket() -> None:
    gate = DraftGate(steep, GateConfig(prior=1.0))
    draft = Draft.trusted([7, 8, 9, 10, 11, 12, 13, 14], None, 6.0, 1, "suffix")
    history = list(range(100, 4100))
    assert len(gate.cut(ctx(history, "r0"), draft).tokens) > 0  # trusted before evidence
    gate.finish(ctx(history, "r0"))
    # Tenant "t"'s one-token matches are always refuted at once: they stop being verified.
    for i in range(30):
        c = ctx(history, f"r{i}")
        gate.cut(c, draft)
        gate.observe(c, VerifyResult([99], 0))  # the model went elsewhere: label 0
        gate.finish(c)
    assert gate.cut(ctx(history, "x"), draft).tokens == []
    # Another bucket of the same tenant, and the same bucket of another tenant, are not
    # touched by what tenant "t" learned.
    longer = Draft.trusted(draft.tokens, None, 6.0, 16, "suffix")
    assert len(gate.cut(ctx(history, "y"), longer).tokens) > 0
    assert len(gate.cut(ctx(history, "z", tenant="other"), draft).tokens) > 0


def test_a_new_tenant_is_trusted_with_caution_until_its_drafts_prove_right() -> None:
    """Before evidence r = prior_ratio: a new tenant's long draft is cut where a trusting
    prior verifies it whole; once its drafts of that bucket follow, it is verified whole."""
    draft = Draft.trusted(list(range(10, 26)), None, 6.0, 4, "suffix")
    history = list(range(100, 4100))
    trusting = DraftGate(steep, GateConfig(prior_ratio=1.0))
    assert len(trusting.cut(ctx(history, "a"), draft).tokens) == 16
    cautious = DraftGate(steep)  # the default prior ratio
    assert cautious.config.prior_ratio < 1.0
    assert len(cautious.cut(ctx(history, "a"), draft).tokens) < 16
    cautious.finish(ctx(history, "a"))
    for i in range(3):  # the tenant's drafts are right to the end: r rises towards 16/6
        c = ctx(history, f"r{i}")
        cautious.cut(c, draft)
        cautious.observe(c, VerifyResult([*draft.tokens, 0], 16))
        cautious.finish(c)
    assert len(cautious.cut(ctx(history, "b"), draft).tokens) == 16


def test_a_cut_draft_is_labelled_from_later_steps() -> None:
    gate = DraftGate(steep)
    history = list(range(100, 4100))
    draft = Draft.trusted([7, 8, 9, 10], None, 4.0, 1, "suffix")
    c = ctx(history, "r")
    gate.cut(c, draft)
    gate.observe(c, VerifyResult([7], 0))  # plain step: the label is not known yet
    assert gate._pending.get(("id", "r"))
    later = ctx([*history, 7], "r")
    gate.observe(later, VerifyResult([8, 0], 1))  # 7, 8, then 0: the draft followed 2
    assert not gate._pending.get(("id", "r"))
    y, s = gate._tenants["t"].sums[bucket(1)]
    assert (y, s) == (2.0, 4.0)
    gate.cut(later, draft)
    gate.finish(later)
    assert ("id", "r") not in gate._pending


def test_the_gate_and_the_session_cache_calibrate_with_one_formula() -> None:
    """The gate's per-bucket calibration and the session cache's per-level one are one
    class (agentspec.payoff.estimators.DecayedRatios): the numbers are bit for bit those of
    the formula each used to write out, Σ ← Σ·d + v and (Σy + P·r₀) / (Σs + P)."""
    from agentspec.drafters.gate import _Calibration
    from agentspec.drafters.suffix.index import Speculation
    from agentspec.drafters.suffix.levels import Calibration

    rng = random.Random(7)
    gate, level = _Calibration(), Calibration()
    y_sum = s_sum = a_sum = c_sum = 0.0
    for _ in range(500):
        label, score = rng.randrange(0, 20), rng.uniform(0.0, 12.0)
        gate.learn(bucket(3), label, score, 0.98)
        y_sum, s_sum = y_sum * 0.98 + label, s_sum * 0.98 + score
        assert gate.ratio(bucket(3), 4.0, 0.25) == (y_sum + 4.0 * 0.25) / (s_sum + 4.0)
        toks = [rng.randrange(5) for _ in range(6)]
        spec = Speculation(toks, 3, rng.uniform(0.0, 6.0))
        committed = [rng.randrange(5) for _ in range(6)]
        level.learn([("session", spec)], committed)
        n = next((i for i, (a, b) in enumerate(zip(toks, committed, strict=True)) if a != b), 6)
        a_sum, c_sum = a_sum * 0.99 + n, c_sum * 0.99 + spec.score
        assert level.ratio("session", 3) == (a_sum + 4.0) / (c_sum + 4.0)
    assert gate.ratio(bucket(40), 4.0, 0.25) == 0.25 and level.ratio("agent", 3) == 1.0


def test_gate_config_is_checked() -> None:
    for bad in ({"miss_rate": 1.0}, {"decay": 0.0}, {"prior": 0.0}, {"max_tenants": 0},
                {"prior_ratio": 0.0}, {"prior_ratio": 1.5}):
        with pytest.raises(AgentSpecError):
            GateConfig(**bad)  # type: ignore[arg-type]


def test_tenants_are_bounded() -> None:
    gate = DraftGate(steep, GateConfig(max_tenants=2))
    draft = Draft.trusted([7, 8], None, 1.0, 1, "suffix")
    for t in ("a", "b", "c"):
        gate.cut(ctx([1, 2, 3], t, tenant=t), draft)
    assert list(gate._tenants) == ["b", "c"]


def test_spec_turns_the_gate_on_for_the_session_cache_methods() -> None:
    assert AgentSpec().gated_drafts
    assert AgentSpec(drafting=DraftingPolicy(method="hybrid")).gated_drafts
    assert not AgentSpec(drafting=DraftingPolicy(draft_gate=False)).gated_drafts
    assert not AgentSpec(drafting=DraftingPolicy(method="prompt_lookup")).gated_drafts
    assert not AgentSpec(verifier=VerifierPolicy(mode="budgeted", budget=1.0)).gated_drafts
    with pytest.raises(ValueError, match="draft_gate=True needs method 'suffix'"):
        DraftingPolicy(method="prompt_lookup", draft_gate=True)


def _prompts(seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(2, TINY_VOCAB) for _ in range(40)]
    return [[0, *base, *base[: rng.randrange(4, 30)]] for _ in range(n)]


def test_gated_engine_is_lossless_and_reports_offered_tokens(  # type: ignore[no-untyped-def]
    tiny_target, char_decode
) -> None:
    plain = SpeculativeDecoder(tiny_target, None, eos_token_ids=[1])
    spec = AgentSpec()
    engine = build_engine(spec, tiny_target, build_drafter(spec), eos_token_ids=[1],
                          decode=char_decode)
    assert isinstance(engine.gate, DraftGate)
    # A steep price makes the gate cut or skip drafts on the tiny model's short contexts.
    engine.gate = DraftGate(lambda k, n: 1.0 + (k - 1) * 0.5)
    cut = 0
    for i, prompt in enumerate(_prompts(5)):
        got = engine.generate(prompt, 32, session=SessionRef(f"g{i % 2}"))
        assert got.tokens == plain.generate(prompt, 32).tokens
        for s in got.stats.steps:
            assert s.offered >= s.draft_len >= s.accepted
            cut += s.offered > s.draft_len
    assert cut > 0
    assert not engine.gate._pending  # every request's drafts released
    # A stream abandoned mid-request releases its drafts too.
    stream = engine.stream(_prompts(6)[0], 32, session=SessionRef("g0"))
    next(stream)
    stream.close()
    assert not engine.gate._pending


def test_context_curves_interpolate_in_k_and_context() -> None:
    short = {k: 1.0 + k for k in costs.COST_POINTS}
    long = {k: 2.0 + 3 * k for k in costs.COST_POINTS}
    curves = {500: short, 4000: long}
    assert costs.at_context(curves, 4, 500) == 5.0
    assert costs.at_context(curves, 4, 100) == 5.0  # below the first context: the first
    assert costs.at_context(curves, 4, 4000) == 14.0
    assert costs.at_context(curves, 4, 2250) == pytest.approx(9.5)
    assert costs.at_context(curves, 4, 7500) == pytest.approx(23.0)  # along the line
    assert costs.at_context(curves, 5, 500) == pytest.approx(6.0)  # between k=4 and 6
    assert costs.at_context({500: short}, 4, 9000) == 5.0
    assert costs.long_context(8192) == costs.LONG_CONTEXT
    assert costs.long_context(512) is None
    assert costs.short_context(512) == 448 and costs.short_context(8192) == 500
    assert costs.parse_curve({"1": 1.0}) is None
    assert costs.parse_curve({str(k): 0.0 for k in costs.COST_POINTS}) is None
    assert costs.parse_curve(short) == short
    with pytest.raises(ValueError):
        costs.at_context({}, 1, 1)


def test_tiny_target_context_cost_uses_its_window(tiny_target, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    saved = tiny_target.curves, tiny_target.meter.live

    def forget() -> None:  # a new target: nothing read from the cost file yet
        c = tiny_target.curves
        tiny_target.curves = CostCurves(c.name, c.key, 512, c.probe, c.forms)
        tiny_target.meter.live = None

    forget()
    try:
        # Nothing measured yet: the safe prior, and context_cost never measures (it is
        # read inside requests).
        assert not tiny_target.live_cost.measured
        assert tiny_target.context_cost(32, 300) > tiny_target.context_cost(4, 300) > 0
        assert not (tmp_path / "costs").exists()
        curves = tiny_target.measure_cost_curves()
        assert tiny_target.live_cost.measured
        c1, c32 = tiny_target.context_cost(1, 300), tiny_target.context_cost(32, 300)
        assert c1 > 0 and c32 > 0
        # The tiny model's 512-position window has room for the base curve only.
        assert list(curves) == [costs.short_context(512)]
        (path,) = (tmp_path / "costs").glob("*.json")
        data = json.loads(path.read_text())
        assert costs.parse_curve(data["costs"]) is not None and "long" not in data
        # The product forms the curve was timed with are kept beside it.
        assert ProductForms.from_json(data["forms"]) is not None
        # A new target (or process) reads the stored curve without measuring.
        forget()
        assert tiny_target.live_cost.measured
        path.write_text("{not json")  # corrupt: the safe prior, measured again on demand
        forget()
        assert not tiny_target.live_cost.measured and tiny_target.context_cost(4, 100) > 0
        tiny_target.measure_cost_curves()
        assert tiny_target.live_cost.measured
        with pytest.raises(AgentSpecError):
            tiny_target.context_cost(0, 10)
    finally:
        tiny_target.curves, tiny_target.meter.live = saved
