"""The draft gate (agentspec.drafters.gate) and the context-aware cost curve it prices with
(agentspec.targets.cost.costs): decisions, calibration, tenant isolation, losslessness."""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agentspec.drafters.gate import POOLED, DraftGate, GateConfig, _reach, bucket
from agentspec.engine import SpeculativeDecoder
from agentspec.errors import AgentSpecError
from agentspec.factory import build_drafter, build_engine
from agentspec.payoff.estimators import POSITION_GROUPS, DecayedSurvival, position_group
from agentspec.spec import AgentSpec, DraftingPolicy, VerifierPolicy
from agentspec.targets.cost import costs
from agentspec.targets.cost.cost_curves import CostCurves
from agentspec.targets.kernels.linear import ProductForms
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
    draft = Draft.trusted(list(range(10, 26)), None, 2.0, 1, "suffix")  # 16 tokens
    likely = [0.5] + [0.9] * 15  # a coin-toss first token, then a copy that mostly runs on
    gate = DraftGate(steep)
    assert gate.length(draft, 100, likely) == 16  # short context: the whole draft is cheap
    assert 0 < gate.length(draft, 8000, likely) < 16  # long context: cut
    assert DraftGate(flat).length(draft, 8000, likely) == 16
    assert gate.length(draft, 8000, [1.0] * 16) == 16  # a sure copy: verified whole
    hopeless = Draft.trusted([3, 4, 5, 6], None, 0.05, 1, "suffix")
    assert gate.length(hopeless, 8000, [0.05] * 4) == 0
    unscored = Draft([3, 4, 5, 6])  # a drafter without scores is not gated
    assert gate.length(unscored, 8000, [0.05] * 4) == 4
    with pytest.raises(AgentSpecError, match="rate for each of the draft's 4 positions"):
        gate.length(hopeless, 8000, [0.5] * 3)


def test_a_tree_is_priced_by_the_depth_its_nodes_reach() -> None:
    # root -> 5 -> {6, 8}; 6 -> 7; 8 -> 9: five nodes, three deep
    tree = Draft.trusted([5, 6, 8, 7, 9], [-1, 0, 0, 1, 2], 3.0, 8, "suffix")
    assert _reach(tree) == [1, 2, 2, 3, 3]
    assert _reach(Draft([1, 2, 3])) == [1, 2, 3]
    # A sure first token and nothing after it: only the first node is worth a row.
    assert DraftGate(steep).length(tree, 8000, [1.0, 0.0, 0.0]) == 1


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
    # The same bucket of another tenant is not touched by what tenant "t" learned.
    assert len(gate.cut(ctx(history, "z", tenant="other"), draft).tokens) > 0
    # Another bucket of tenant "t" starts from the tenant's pooled rates (skipped too), and
    # learns its own: once its drafts are followed to the end they are verified whole.
    longer = Draft.trusted(draft.tokens, None, 6.0, 16, "suffix")
    assert gate.cut(ctx(history, "y"), longer).tokens == []
    gate.finish(ctx(history, "y"))
    for i in range(4):
        c = ctx(history, f"l{i}")
        gate.cut(c, longer)
        gate.observe(c, VerifyResult([*longer.tokens, 0], 8))
        gate.finish(c)
    assert len(gate.cut(ctx(history, "w"), longer).tokens) == 8
    assert gate.cut(ctx(history, "x2"), draft).tokens == []  # bucket 1 still skipped


def test_a_new_tenant_is_trusted_with_caution_until_its_drafts_prove_right() -> None:
    """Before evidence p₀(j) = 1 − (1 − p₁)/j: a new tenant's long draft is cut where a
    trusting prior verifies it whole; once its drafts of that bucket follow, it is verified
    whole."""
    draft = Draft.trusted(list(range(10, 26)), None, 6.0, 4, "suffix")
    history = list(range(100, 8100))
    trusting = DraftGate(steep, GateConfig(first_rate=0.99))
    assert len(trusting.cut(ctx(history, "a"), draft).tokens) == 16
    cautious = DraftGate(steep)  # the default prior
    assert len(cautious.cut(ctx(history, "a"), draft).tokens) < 16
    cautious.finish(ctx(history, "a"))
    for i in range(3):  # the tenant's drafts are right to the end
        c = ctx(history, f"r{i}")
        cautious.cut(c, draft)
        cautious.observe(c, VerifyResult([*draft.tokens, 0], 16))
        cautious.finish(c)
    assert len(cautious.cut(ctx(history, "b"), draft).tokens) == 16


def test_long_drafts_that_the_answer_leaves_early_are_cut() -> None:
    """The case a share of the drafter's score got wrong: in one bucket, short drafts that
    the target follows to the end (beyond their score) beside long, high-scoring ones it
    leaves after a few tokens. A ratio of the score, fitted on both, priced the long ones as
    copies; the gate learns where they end and verifies about that far, while a tenant whose
    long drafts are copies keeps verifying them whole."""
    history = list(range(100, 2100))
    rng = random.Random(3)
    gate = DraftGate(steep)

    def teach(tenant: str, i: int, n: int, score: float, y: int) -> None:
        draft = Draft.trusted([rng.randrange(2, 90) for _ in range(n)], None, score, 12,
                              "suffix")
        c = ctx(history, f"{tenant}{i}", tenant=tenant)
        gate.cut(c, draft)
        gate.observe(c, VerifyResult([*draft.tokens[:y], 99], y))
        gate.finish(c)

    for i in range(40):
        teach("leaves", 2 * i, 3, 1.0, 3)  # short and sure
        teach("leaves", 2 * i + 1, 32, 30.0, rng.randrange(1, 5))  # long, left early
        teach("copies", i, 32, 30.0, 32)
    draft = Draft.trusted(list(range(10, 42)), None, 30.0, 12, "suffix")
    assert 0 < len(gate.cut(ctx(history, "a", tenant="leaves"), draft).tokens) <= 6
    assert len(gate.cut(ctx(history, "b", tenant="copies"), draft).tokens) == 32


def test_a_cut_draft_is_labelled_from_later_steps() -> None:
    gate = DraftGate(steep)
    history = list(range(100, 4100))
    draft = Draft.trusted([7, 8, 9, 10], None, 4.0, 1, "suffix")
    c = ctx(history, "r")
    gate.cut(c, draft)
    gate.observe(c, VerifyResult([7], 0))  # plain step: the label is not known yet
    assert gate._pending.get(("id", "r"))
    # ... but its first position is: it survived there (a right-censored count).
    first = [1.0, 0, 0, 0, 0, 0, 0, 0]
    assert gate._tenants["t"].counts[bucket(1)] == first + first
    later = ctx([*history, 7], "r")
    gate.observe(later, VerifyResult([8, 0], 1))  # 7, 8, then 0: the draft followed 2
    assert not gate._pending.get(("id", "r"))
    # At risk at positions 1, 2, 3 (groups 0, 1, 2), followed at 1 and 2.
    at_risk, survived = [1.0, 1.0, 1.0, 0, 0, 0, 0, 0], [1.0, 1.0, 0, 0, 0, 0, 0, 0]
    assert gate._tenants["t"].counts[bucket(1)] == at_risk + survived
    assert gate._tenants["t"].counts[POOLED] == at_risk + survived
    gate.cut(later, draft)
    gate.finish(later)
    assert ("id", "r") not in gate._pending


def test_declined_drafts_teach_the_gate_within_their_request() -> None:
    """A verbatim repeat in a new tenant on a machine where verifies cost much: the prior
    declines its first draft, and the copy being followed, counted step by step, makes
    the gate verify the rest within the same request (labels known only once each whole
    draft was decided came after the repeat was decoded one token per forward)."""
    gate = DraftGate(lambda k, context: 1.0 + 0.6 * (k - 1))
    history = list(range(100, 400))
    copy = list(range(10, 40))  # the 30 tokens the request answers, all in the cache
    committed: list[int] = []
    forwards, cuts = 0, []
    while len(committed) < len(copy):
        c = ctx([*history, *committed], "repeat")
        rest = copy[len(committed):]
        cut = gate.cut(c, Draft.trusted(rest, None, float(len(rest)), 200, "suffix"))
        cuts.append(len(cut.tokens))
        block = [*cut.tokens, *rest[len(cut.tokens):][:1]] or [0]
        gate.observe(c, VerifyResult(block, len(cut.tokens)))
        committed.extend(block)
        forwards += 1
    assert cuts[0] == 0  # the prior alone declines a 30-token draft at these costs
    assert forwards <= 8, cuts


def test_survival_counts_follow_their_formula() -> None:
    """DecayedSurvival's rates are bit for bit the decayed counts written out:
    A ← A·d + [at risk], S ← S·d + [followed], p(j) = (S + P·p₀(j)) / (A + P)."""
    rng = random.Random(7)
    est: DecayedSurvival[int] = DecayedSurvival()
    stepwise: DecayedSurvival[int] = DecayedSurvival()  # counted as tokens come
    at = [0.0] * POSITION_GROUPS
    ok = [0.0] * POSITION_GROUPS
    for _ in range(300):
        depth = rng.randrange(1, 70)
        label = rng.randrange(0, depth + 1)
        est.age(3, 0.98)
        est.count(3, 0, label, True, depth)  # the whole label at once
        stepwise.age(3, 0.98)
        known = 0
        while True:  # the committed tokens show 0-3 more positions per step
            seen = min(label, known + rng.randrange(0, 4))
            decided = seen == label and rng.random() < 0.5
            stepwise.count(3, known, seen, decided, depth)
            known = seen
            if decided:
                break
        assert stepwise.counts[3] == est.counts[3]
        at = [a * 0.98 for a in at]
        ok = [o * 0.98 for o in ok]
        for j in range(1, depth + 1):
            if label >= j - 1:
                at[position_group(j)] += 1.0
            if label >= j:
                ok[position_group(j)] += 1.0
        got = est.rates(3, 70, 2.0, lambda j: 1.0 - 0.5 / j)
        want = [(ok[position_group(j)] + 2.0 * (1.0 - 0.5 / j)) / (at[position_group(j)] + 2.0)
                for j in range(1, 71)]
        assert got == want
    assert [position_group(j) for j in (1, 2, 3, 4, 5, 8, 9, 64, 65, 500)] == \
        [0, 1, 2, 2, 3, 3, 4, 6, 7, 7]
    assert est.rates(4, 2, 2.0, lambda j: 0.25) == [0.25, 0.25]  # never learned: the prior
    assert 4 not in est.counts  # reading never creates a cell


def test_level_calibration_is_a_decayed_ratio() -> None:
    """The session cache's per-level calibration is DecayedRatios' formula, bit for bit:
    Σ ← Σ·d + v and (Σy + P·r₀) / (Σs + P)."""
    from agentspec.drafters.suffix.index import Speculation
    from agentspec.drafters.suffix.levels import Calibration

    rng = random.Random(7)
    level = Calibration()
    a_sum = c_sum = 0.0
    for _ in range(500):
        toks = [rng.randrange(5) for _ in range(6)]
        spec = Speculation(toks, 3, rng.uniform(0.0, 6.0))
        committed = [rng.randrange(5) for _ in range(6)]
        level.learn([("session", spec)], committed)
        n = next((i for i, (a, b) in enumerate(zip(toks, committed, strict=True)) if a != b), 6)
        a_sum, c_sum = a_sum * 0.99 + n, c_sum * 0.99 + spec.score
        assert level.ratio("session", 3) == (a_sum + 4.0) / (c_sum + 4.0)
    assert level.ratio("agent", 3) == 1.0


def test_gate_config_is_checked() -> None:
    for bad in ({"first_rate": 1.0}, {"first_rate": 0.0}, {"decay": 0.0}, {"prior": 0.0},
                {"pooled_prior": -1.0}, {"max_tenants": 0}):
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


def test_cost_glitches_are_found_and_clamped() -> None:
    """A point slowed by another process (the measured 2.8 s at 24 rows beside 0.85 s at
    32) is found; a sound curve is left alone."""
    sound = {1: 0.042, 2: 0.052, 4: 0.058, 6: 0.113, 8: 0.120, 24: 0.272, 32: 0.340}
    assert costs.glitches(sound) == [] and costs.without_glitches(sound) == sound
    noisy = {1: 0.045, 4: 0.063, 6: 0.284, 8: 0.235, 16: 0.589, 24: 2.756, 32: 0.847}
    assert costs.glitches(noisy) == [24]
    assert costs.without_glitches(noisy)[24] == pytest.approx(1.5 * 0.847)
    late = {1: 0.04, 16: 0.2, 24: 0.27, 32: 2.0}  # the last point: above its slope
    assert costs.glitches(late) == [32]
    fixed = costs.without_glitches(late)
    assert fixed[32] == pytest.approx(1.5 * 0.27 * 32 / 24) and fixed[24] == 0.27
    stored = {str(k): v for k, v in zip(costs.COST_POINTS, [0.045, 0.049, 0.054, 0.063, 0.284,
                                                            0.235, 0.508, 0.589, 2.756, 0.847],
                                       strict=True)}
    assert costs.parse_curve(stored)[24] == pytest.approx(1.5 * 0.847)  # type: ignore[index]
    run = {1: 0.04, 2: 0.9, 3: 0.8, 4: 0.05}  # a run of slowed points
    assert costs.glitches(run) == [2, 3]
    assert costs.without_glitches(run) == pytest.approx({1: 0.04, 2: 0.1125, 3: 0.075,
                                                         4: 0.05})


def test_the_measurement_times_a_glitch_again(tiny_target,  # type: ignore[no-untyped-def]
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A point slowed while it was timed is timed again and the lower median kept (a fake
    clock: each forward over k rows "takes" 1 + k/10 s, the first five of 24 rows 50 s)."""
    from agentspec.targets.cost import cost_meter

    clock = [0.0]
    slow = [5]

    class Pad:
        def score(self, tokens: list[int]) -> None:
            k = len(tokens)
            if k == 24 and slow[0] > 0:
                slow[0] -= 1
                clock[0] += 50.0
            else:
                clock[0] += 1.0 + k / 10

        def rollback(self, n: int) -> None:
            pass

        def scratch(self, context: int, gen: object) -> Any:
            return contextlib.nullcontext()

    monkeypatch.setattr(cost_meter, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    curve = tiny_target.meter.measure(Pad(), context=64, repeats=5, budget_s=None)
    assert slow[0] == 0  # the five slowed forwards all landed on the first timing of 24
    assert curve == pytest.approx({k: 1.0 + k / 10 for k in costs.COST_POINTS})


def test_a_measurement_past_its_budget_interpolates_the_points_left(
        tiny_target, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Past the time budget the points not reached are interpolated between the measured
    ones (the ends always measured first); a fake clock where a forward over k rows takes
    1 + k/10 s and the curve bends at k = 8."""
    from agentspec.targets.cost import cost_meter

    clock, timed = [0.0], []

    def cost(k: int) -> float:
        return 1.0 + k / 10 if k <= 8 else 1.8 + (k - 8) / 5

    class Pad:
        def score(self, tokens: list[int]) -> None:
            timed.append(len(tokens))
            clock[0] += cost(len(tokens))

        def rollback(self, n: int) -> None:
            pass

        def scratch(self, context: int, gen: object) -> Any:
            return contextlib.nullcontext()

    assert costs.MEASURE_ORDER[:2] == (1, 32)
    assert sorted(costs.MEASURE_ORDER) == list(costs.COST_POINTS)
    monkeypatch.setattr(cost_meter, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    curve = tiny_target.meter.measure(Pad(), context=64, repeats=3, budget_s=30.0)
    assert set(timed) == {1, 32, 8, 2}  # the budget ran out after the 2-row point
    assert set(curve) == set(costs.COST_POINTS)
    measured = {k: cost(k) for k in (1, 2, 8, 32)}
    assert curve == pytest.approx({k: costs.interpolate(measured, k)
                                   for k in costs.COST_POINTS})
    assert curve[4] == pytest.approx(cost(4)) and curve[24] == pytest.approx(cost(24))
