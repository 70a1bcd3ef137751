"""HybridDrafter: lossless through the engine with every policy (token-identical to greedy,
fp32), both sub-drafters kept in sync, per-step source records, and the HVD bench methods
failing clearly without a trained drafter."""

from __future__ import annotations

import math
import random
from typing import ClassVar

import pytest

from agentspec.drafters.hybrid import HybridDrafter
from agentspec.drafters.model.causal import ModelDrafter, ModelDrafterConfig
from agentspec.drafters.suffix.drafter import SuffixDrafter
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.payoff.features import NUM_FEATURES, TokenTable
from agentspec.payoff.policy import ArcticRule, CostAwarePolicy, SourcePolicy, ThresholdPolicy
from agentspec.payoff.predictor import PayoffPredictor
from agentspec.types import Draft, DraftContext, SessionRef, VerifyResult
from tests.conftest import TINY_VOCAB, CharDecoder, noisy_copy
from tests.unit.test_engine_lossless import hf_greedy

EOS = 1


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def draft_model(tiny_model):  # type: ignore[no-untyped-def]
    """The tiny model with noisy weights: a model drafter that is often right."""
    return noisy_copy(tiny_model, seed=5)


def _predictor(value: float, tau: float) -> PayoffPredictor:
    return PayoffPredictor([0.0] * NUM_FEATURES, [1.0] * NUM_FEATURES,
                           [([[0.0] * NUM_FEATURES], [value])], tau)


def _policies() -> dict[str, SourcePolicy]:
    return {
        "threshold": ThresholdPolicy(_predictor(7.0, 6.0)),  # cache whenever it has a draft
        "cost_aware": CostAwarePolicy(_predictor(3.0, 6.0), lambda k: 1.0 + 0.05 * k),
        "arctic_rule": ArcticRule(),
    }


class Recorder:
    """Wraps a drafter and counts the protocol calls it receives."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", "?")
        self.calls = {"propose": 0, "observe": 0, "finish": 0, "begin_request": 0}

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        self.calls["propose"] += 1
        return self.inner.propose(ctx, max_tokens)  # type: ignore[attr-defined,no-any-return]

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        self.calls["observe"] += 1
        self.inner.observe(ctx, result)  # type: ignore[attr-defined]

    def finish(self, ctx: DraftContext) -> None:
        self.calls["finish"] += 1
        self.inner.finish(ctx)  # type: ignore[attr-defined]

    def begin_request(self, session: SessionRef | None, rng: object,
                      request_id: str | None = None) -> None:
        self.calls["begin_request"] += 1


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(3):
        chunk = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(5, 12))]
        out.append([0, *chunk, *[rng.randrange(2, TINY_VOCAB) for _ in range(4)], *chunk])
    return out


@pytest.mark.parametrize("policy_name", ["threshold", "cost_aware", "arctic_rule"])
def test_hybrid_is_lossless_through_the_engine(
    tiny_model, tiny_target, draft_model, policy_name: str  # type: ignore[no-untyped-def]
) -> None:
    table = TokenTable.from_decode(CharDecoder(), TINY_VOCAB)
    cache = Recorder(SuffixDrafter())
    model = Recorder(ModelDrafter(draft_model, ModelDrafterConfig(max_tokens=4)))
    hybrid = HybridDrafter(cache, model, _policies()[policy_name], table, model_max=4)  # type: ignore[arg-type]
    engine = SpeculativeDecoder(tiny_target, hybrid, eos_token_ids=[EOS],
                                config=EngineConfig(max_draft=8))
    session = SessionRef("s1")
    sources: set[str] = set()
    steps = 0
    for prompt in _prompts(1):
        # A two-turn session: the second turn resends the first turn's output.
        ref: list[int] = []
        for turn in range(2):
            ids = prompt if turn == 0 else [*prompt, *ref[:10], 3, *prompt[1:6]]
            ref = hf_greedy(tiny_model, ids, 30, EOS)
            gen = engine.generate(ids, max_tokens=30, session=session)
            assert gen.tokens == ref, (policy_name, turn)
            sources.update(s.source for s in gen.stats.steps)
            steps += len(gen.stats.steps)
    assert sources <= {"suffix", "model", "none"}
    assert "suffix" in sources or "model" in sources
    # observe() and finish() reach both sub-drafters every step, whichever source won.
    assert cache.calls["observe"] == model.calls["observe"] == steps
    assert cache.calls["finish"] == model.calls["finish"] == 6
    assert cache.calls["begin_request"] == model.calls["begin_request"] == 6
    assert sum(hybrid.wins.values()) == cache.calls["propose"]


def test_threshold_policy_uses_both_sources(tiny_target, draft_model) -> None:  # type: ignore[no-untyped-def]
    table = TokenTable.from_decode(CharDecoder(), TINY_VOCAB)
    model = ModelDrafter(draft_model, ModelDrafterConfig(max_tokens=4))
    hybrid = HybridDrafter(SuffixDrafter(), model, _policies()["threshold"], table, model_max=4)
    engine = SpeculativeDecoder(tiny_target, hybrid, eos_token_ids=[EOS])
    chunk = list(range(10, 30))
    stats = engine.generate([0, *chunk, 5, *chunk[:3]], max_tokens=40).stats
    wins = stats.drafter_wins()
    assert wins.get("suffix", 0) > 0 and wins.get("model", 0) > 0, wins


def test_hybrid_refuses_a_feature_policy_without_a_table(draft_model) -> None:  # type: ignore[no-untyped-def]
    model = ModelDrafter(draft_model)
    with pytest.raises(ValueError, match="TokenTable"):
        HybridDrafter(SuffixDrafter(), model, _policies()["threshold"], None)
    with pytest.raises(ValueError, match="model_max"):
        HybridDrafter(SuffixDrafter(), model, ArcticRule(), None, model_max=0)


@pytest.mark.parametrize("method", ["model", "arctic_rule", "hybrid"])
def test_hvd_methods_fail_clearly_without_a_drafter(
    tiny_target, monkeypatch, method: str  # type: ignore[no-untyped-def]
) -> None:
    from agentspec.drafters.model import distilled
    from agentspec.errors import BenchmarkError, ModelLoadError
    from workflows.bench.methods import MethodContext, build_method

    def missing(*_a: object, **_k: object) -> None:
        raise ModelLoadError("no trained drafter for target 'tiny-llama'")

    monkeypatch.setattr(distilled, "load_default_drafter", missing)
    with pytest.raises(BenchmarkError, match=f"method '{method}'.*no trained drafter"):
        build_method(method, MethodContext(tiny_target))


def test_model_sync_steps_are_not_cost_samples(tiny_target) -> None:  # type: ignore[no-untyped-def]
    """A model draft that follows the request start or a step of another source also syncs
    the drafter with the tokens committed meanwhile; its time must not be learned as a
    per-token cost (it once priced the EAGLE head out of every later step)."""
    import math

    from agentspec.drafters import OracleDrafter
    from agentspec.payoff.policy import MODEL, NONE, Choice

    class AlwaysModel:
        name, needs_features = "always_model", False

        def __init__(self, every: int = 1) -> None:
            self.costs: list[float] = []
            self.every, self.n = every, 0

        def choose(self, cache, model_len, phi, context=0):  # type: ignore[no-untyped-def]
            self.n += 1  # with every=3: model, none, none, model, ...
            return Choice(MODEL if self.n % self.every == 1 % self.every else NONE,
                          model_len)

        def update(self, source, draft_len, accepted, draft_s):  # type: ignore[no-untyped-def]
            self.costs.append(draft_s)

    policy = AlwaysModel()
    model = OracleDrafter({})  # drafts nothing useful; any Drafter works here
    hybrid = HybridDrafter(SuffixDrafter(), model, policy, None, model_max=2)  # type: ignore[arg-type]
    eng = SpeculativeDecoder(tiny_target, hybrid, config=EngineConfig(max_draft=4))
    for prompt in ([5, 6, 7, 8], [9, 10, 11]):
        policy.costs.clear()
        eng.generate(prompt, max_tokens=6)
        assert math.isnan(policy.costs[0])
        assert all(math.isfinite(c) for c in policy.costs[1:]) and len(policy.costs) > 1
    # Model steps between plain steps each sync first: none is a cost sample.
    policy = AlwaysModel(every=3)
    hybrid = HybridDrafter(SuffixDrafter(), model, policy, None, model_max=2)  # type: ignore[arg-type]
    eng = SpeculativeDecoder(tiny_target, hybrid, config=EngineConfig(max_draft=4))
    eng.generate([5, 6, 7, 8], max_tokens=12)
    model_costs = [c for n, c in enumerate(policy.costs, start=1) if n % 3 == 1]
    assert len(model_costs) >= 2 and all(math.isnan(c) for c in model_costs)


def test_full_length_labels() -> None:
    def full_length_label(tokens: list[int], continuation: list[int]) -> int | None:
        return Draft(tokens=tokens).followed_length(continuation)

    assert full_length_label([1, 2, 3], [1, 2]) is None  # not known yet
    assert full_length_label([1, 2, 3], [1, 2, 3, 4]) == 3
    assert full_length_label([1, 2, 3], [1, 9]) == 1
    assert full_length_label([1, 2, 3], []) is None
    assert full_length_label([], [5]) == 0


def test_cut_and_unverified_cache_drafts_get_their_full_length_label(tiny_target) -> None:  # type: ignore[no-untyped-def]
    """The policy learns what each cache draft would have scored at full length, from the
    tokens committed later, even when only one token of it was verified or the model won."""
    from agentspec.drafters import OracleDrafter
    from agentspec.payoff.policy import CACHE, MODEL, Choice

    class CutEverything:
        name, needs_features = "cut", False

        def __init__(self) -> None:
            self.outcomes: list[tuple[float, int]] = []
            self.n = 0

        def choose(self, cache, model_len, phi, context=0):  # type: ignore[no-untyped-def]
            self.n += 1
            return Choice(CACHE if self.n % 2 else MODEL, 1, 5.0, float(self.n))

        def update(self, source, draft_len, accepted, draft_s):  # type: ignore[no-untyped-def]
            pass

        def outcome(self, raw, accepted, score=math.nan, length=0):  # type: ignore[no-untyped-def]
            self.outcomes.append((raw, accepted))

    class Recording(HybridDrafter):
        shadows: ClassVar[list[tuple[int, tuple[int, ...], float]]] = []

        def propose(self, ctx, max_tokens):  # type: ignore[no-untyped-def]
            req = self._requests.get(ctx.state_key)  # this request's state
            before = len(req.shadow) if req is not None and ctx.step else 0
            draft = super().propose(ctx, max_tokens)
            shadow = self._requests[ctx.state_key].shadow
            latest = shadow.latest
            if latest is not None and (len(shadow) > before or latest[0] == len(ctx.tokens)):
                self.shadows.append(latest)
            return draft

    policy = CutEverything()
    hybrid = Recording(SuffixDrafter(), OracleDrafter({}), policy, None, model_max=2)  # type: ignore[arg-type]
    eng = SpeculativeDecoder(tiny_target, hybrid, config=EngineConfig(max_draft=8))
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    # The same request twice in one session: the second time the cache holds the answer,
    # so its drafts are long and right, but only one token of each is ever verified.
    eng.generate(prompt, max_tokens=40, session=SessionRef("s"))
    Recording.shadows.clear()
    policy.outcomes.clear()
    out = eng.generate(prompt, max_tokens=40, session=SessionRef("s"))
    final = prompt + list(out.tokens)
    expected = [d.followed_length(final[start:]) for start, d, *_ in Recording.shadows]
    known = expected[: expected.index(None)] if None in expected else expected
    assert len(known) >= 3 and max(known) > 1  # more than the one verified token
    assert policy.outcomes == [(raw, y) for (_, _, raw, _), y in zip(Recording.shadows, known,
                                                                 strict=False)]


def test_the_draft_gate_cuts_or_declines_the_cache_draft_it_prices_whole(tiny_target) -> None:  # type: ignore[no-untyped-def]
    """With a draft gate the cache step verifies the shorter of the policy's cut and the
    gate's, the gate labels whole drafts (what it calibrates on, as under ``suffix``), a
    gate that declines turns the step plain, and the output stays exactly greedy."""
    from agentspec.drafters.gate import DraftGate

    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    want = hf_greedy(tiny_target.model, prompt, 30, EOS)

    def run(cost):  # type: ignore[no-untyped-def]
        gate = DraftGate(cost)
        cuts: list[tuple[int, int]] = []
        real = gate.cut

        def cut(ctx, draft):  # type: ignore[no-untyped-def]
            out = real(ctx, draft)
            cuts.append((len(draft.tokens), len(out.tokens)))
            return out

        gate.cut = cut  # type: ignore[method-assign]
        hybrid = HybridDrafter(SuffixDrafter(), ModelDrafter(tiny_target.model,
                               ModelDrafterConfig(max_tokens=2)), _policies()["threshold"],
                               TokenTable.blank(TINY_VOCAB), model_max=2, gate=gate)
        eng = SpeculativeDecoder(tiny_target, hybrid, config=EngineConfig(max_draft=8),
                                 eos_token_ids=(EOS,))
        out = eng.generate(prompt, max_tokens=30, session=SessionRef("s"))
        assert out.tokens == want
        assert not gate._pending  # the request's unlabelled drafts end with it
        return out, cuts

    free, cuts = run(lambda k, context: 1.0)  # verifying costs one step: drafts whole
    assert cuts and all(n == k for n, k in cuts)
    assert any(s.source == "suffix" and s.draft_len > 1 for s in free.stats.steps)
    steep, cuts = run(lambda k, context: float(k) ** 3)  # no draft pays for its forward
    assert cuts and all(k == 0 for _, k in cuts)
    assert not any(s.source == "suffix" for s in steep.stats.steps)
