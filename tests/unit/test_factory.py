"""The one factory (:mod:`agentspec.factory`): the benchmark builds what the product ships,
every accepted option of an AgentSpec reaches the loop, multi-draft included, and HVD's
learned policy state is never shared across tenants."""

from __future__ import annotations

import random

import pytest
import torch

from agentspec.drafters import SuffixDrafter, hybrid_build
from agentspec.drafters.hybrid import HybridDrafter
from agentspec.drafters.model.causal import ModelDrafter, ModelDrafterConfig
from agentspec.drafters.multi import IIDDrafts
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError, DraftError
from agentspec.factory import build_drafter, build_engine
from agentspec.multi_engine import MultiDraftDecoder
from agentspec.payoff import defaults
from agentspec.payoff.features import NUM_FEATURES
from agentspec.payoff.policy import CostAwarePolicy
from agentspec.payoff.predictor import PayoffPredictor
from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec, DraftingPolicy, VerifierPolicy
from agentspec.types import Draft, DraftContext, SamplingParams, SessionRef
from tests.conftest import TINY_VOCAB, noisy_copy
from workflows.bench.methods import MethodContext, build_method, method_spec

pytestmark = pytest.mark.usefixtures("one_thread")

MULTI = AgentSpec(verifier=VerifierPolicy(sampler="multi_draft", num_drafts=2))


def _prompts(seed: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(2, TINY_VOCAB) for _ in range(12)]
    return [[0, *base, *base[: rng.randrange(4, 12)]] for _ in range(n)]


@pytest.fixture(scope="module")
def hvd_parts(tiny_model, tiny_target, monkeypatch_module):  # type: ignore[no-untyped-def]
    """HVD for the tiny target: a noisy-copy model drafter and a constant predictor stand
    in for the shipped EAGLE head and predictor (made for the embedded model's vocabulary),
    and a fixed c(k) for the cost curve (the tiny model's 512 positions are too few to
    measure the real one)."""
    monkeypatch_module.setattr(tiny_target, "verify_cost", lambda k: 0.01 + 0.0005 * k)
    draft = ModelDrafter(noisy_copy(tiny_model, seed=5))
    pred = PayoffPredictor([0.0] * NUM_FEATURES, [1.0] * NUM_FEATURES,
                           [([[0.0] * NUM_FEATURES], [3.0])], 6.0)
    monkeypatch_module.setattr(hybrid_build, "load_model_drafter",
                               lambda target, model=None, max_tokens=6: draft)
    monkeypatch_module.setattr(defaults, "load_predictor", lambda target, path=None: pred)
    return draft


@pytest.fixture(scope="module")
def monkeypatch_module():  # type: ignore[no-untyped-def]
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("method", ["suffix", "hybrid", "arctic_rule", "asd_b4"])
def test_bench_methods_are_the_products_parts(tiny_target, hvd_parts, method: str) -> None:  # type: ignore[no-untyped-def]
    """The bench's drafter and engine equal the runtime's for the same AgentSpec: same
    classes, same configurations (cache settings, model drafter, policy, loop, verifier)."""
    bench = build_method(method, MethodContext(tiny_target, engine=EngineConfig(max_draft=32)))
    spec = method_spec(method, 32)
    rt = Runtime(tiny_target)
    product = rt.drafter_for(spec)
    engine = rt.engine_for(spec)
    assert type(bench.drafter) is type(product)  # type: ignore[attr-defined]
    assert bench.decoder.config == engine.config  # type: ignore[attr-defined]
    assert type(bench.decoder.verifier) is type(engine.verifier)  # type: ignore[attr-defined]
    assert getattr(bench.decoder.verifier, "config", None) == getattr(  # type: ignore[attr-defined]
        engine.verifier, "config", None)
    mine = bench.drafter  # type: ignore[attr-defined]
    if isinstance(product, SuffixDrafter):
        assert mine.config == product.config
        assert product.config.max_tokens == 32
        assert product.config.scope == spec.drafting.scope == "tenant"  # the product default
    else:
        assert isinstance(product, HybridDrafter) and isinstance(mine, HybridDrafter)
        assert mine.name == product.name and mine.model_max == product.model_max
        assert type(mine.policy) is type(product.policy)
        assert type(mine.cache) is type(product.cache) and mine.cache.config == product.cache.config
        assert mine.model is product.model is hvd_parts


def test_every_drafting_option_reaches_the_loop(tiny_target) -> None:  # type: ignore[no-untyped-def]
    spec = AgentSpec(drafting=DraftingPolicy(max_draft=12, min_draft=3, tree=True))
    drafter = build_drafter(spec, tiny_target)
    assert isinstance(drafter, SuffixDrafter) and drafter.config.tree is True
    assert drafter.config.max_tokens == 12
    engine = build_engine(spec, tiny_target, drafter)
    assert engine.config == EngineConfig(max_draft=12, min_draft=3)
    rt = Runtime(tiny_target)  # the runtime's drafter cache tells the policies apart
    tree = rt.drafter_for(spec)
    assert isinstance(tree, SuffixDrafter) and tree.config.tree is True
    assert rt.drafter_for(AgentSpec()) is not tree and rt.drafter_for(spec) is tree
    assert rt.engine_for(spec).config == EngineConfig(max_draft=12, min_draft=3)
    with pytest.raises(ValueError, match="tree=True needs method 'suffix' or 'hybrid'"):
        DraftingPolicy(method="prompt_lookup", tree=True)
    with pytest.raises(ValueError, match="strict greedy"):
        AgentSpec(drafting=DraftingPolicy(tree=True), verifier=VerifierPolicy(temperature=0.7))


def test_greedy_suffix_drafts_trees_by_default(tiny_target) -> None:  # type: ignore[no-untyped-def]
    assert AgentSpec().tree_drafts
    assert AgentSpec(drafting=DraftingPolicy(method="hybrid")).tree_drafts
    off = [
        AgentSpec(drafting=DraftingPolicy(method="hybrid"),
                  verifier=VerifierPolicy(temperature=0.7)),
        AgentSpec(drafting=DraftingPolicy(tree=False)),
        AgentSpec(verifier=VerifierPolicy(temperature=0.7)),
        AgentSpec(verifier=VerifierPolicy(sampler="multi_draft", num_drafts=2)),
        AgentSpec(verifier=VerifierPolicy(mode="budgeted", budget=4.0)),
        AgentSpec(drafting=DraftingPolicy(method="prompt_lookup")),
    ]
    assert not any(spec.tree_drafts for spec in off)
    default = build_drafter(AgentSpec())
    assert isinstance(default, SuffixDrafter) and default.config.tree is True
    # The runtime keeps one drafter per (drafting policy, trees): a sampled agent with the
    # same drafting policy gets chains.
    rt = Runtime(tiny_target)
    trees, chains = rt.drafter_for(AgentSpec()), rt.drafter_for(off[1])
    assert isinstance(chains, SuffixDrafter) and chains is not trees
    assert chains.config.tree is False
    with pytest.raises(ValueError, match="strict greedy"):
        AgentSpec(drafting=DraftingPolicy(tree=True),
                  verifier=VerifierPolicy(sampler="multi_draft", num_drafts=2))


def test_tree_drafts_and_min_draft_through_the_factory_are_lossless(
    tiny_target, char_decode  # type: ignore[no-untyped-def]
) -> None:
    plain = SpeculativeDecoder(tiny_target, None, eos_token_ids=[1])
    for drafting in (DraftingPolicy(tree=True, max_draft=12), DraftingPolicy(min_draft=4)):
        spec = AgentSpec(drafting=drafting)
        engine = build_engine(spec, tiny_target, build_drafter(spec), eos_token_ids=[1])
        session = SessionRef(f"s-{drafting.tree}")
        for prompt in _prompts(3):
            got = engine.generate(prompt, 24, session=session)
            assert got.tokens == plain.generate(prompt, 24).tokens
            short = [s for s in got.stats.steps if s.source != "none" and s.draft_len < 4]
            assert drafting.tree or not short  # min_draft=4: no shorter draft verified


def test_multi_draft_spec_builds_the_multi_draft_loop(tiny_target, char_decode) -> None:  # type: ignore[no-untyped-def]
    """sampler='multi_draft', num_drafts=K: the runtime runs MultiDraftDecoder (K drafts per
    step from the spec's drafter); greedy output stays identical to greedy decoding."""
    rt = Runtime(tiny_target)
    engine = rt.engine_for(MULTI)
    assert isinstance(engine, MultiDraftDecoder) and engine.num_drafts == 2
    assert isinstance(engine.multi_drafter, IIDDrafts)
    assert isinstance(engine.multi_drafter.drafter, SuffixDrafter)
    engine.decode = char_decode  # the tiny model has no tokenizer for Runtime.decode
    single = rt.engine_for(AgentSpec())
    assert not isinstance(single, MultiDraftDecoder)
    plain = SpeculativeDecoder(tiny_target, None)
    for prompt in _prompts(5):
        got = engine.generate(prompt, 20, session=SessionRef("multi"))
        assert got.tokens == plain.generate(prompt, 20).tokens
    assert engine.multi_drafter.calls > 0
    with pytest.raises(ConfigError, match="needs a drafter"):
        build_engine(AgentSpec(drafting=DraftingPolicy(method="none"),
                               verifier=MULTI.verifier), tiny_target, None)


def test_sampled_multi_draft_requests_are_seeded(tiny_target) -> None:  # type: ignore[no-untyped-def]
    """A sampled request through the multi-draft loop depends on its seed only."""
    spec = AgentSpec(verifier=VerifierPolicy(sampler="multi_draft", num_drafts=3,
                                             temperature=0.9, seed=11))
    engine = build_engine(spec, tiny_target, build_drafter(spec), eos_token_ids=[1])
    assert isinstance(engine, MultiDraftDecoder) and engine.num_drafts == 3
    prompt = _prompts(9)[0]
    runs = [engine.generate(prompt, 16, sampling=spec.verifier.sampling(),
                            session=SessionRef(f"seeded-{i}")).tokens for i in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0
    other = engine.generate(prompt, 16, sampling=SamplingParams(0.9, 1.0, 0, 12))
    assert other.tokens != runs[0] or len(other.tokens) < 4  # another seed, another draw


def test_iid_drafts_repeat_a_point_mass_and_redraw_a_sampled_draft(tiny_model) -> None:  # type: ignore[no-untyped-def]
    ctx = DraftContext([0, 5, 6, 7, 5, 6], 6)
    gen = torch.Generator().manual_seed(0)

    class Fixed:
        name = "fixed"

        def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
            return Draft(tokens=[7, 5, 6][:max_tokens], source="fixed")

        def observe(self, *_: object) -> None: ...
        def finish(self, *_: object) -> None: ...

    drafts = IIDDrafts(Fixed()).propose_many(ctx, 3, 3, gen)
    assert [d.tokens for d in drafts] == [[7, 5, 6]] * 3
    sampler = ModelDrafter(noisy_copy(tiny_model, seed=5),
                           ModelDrafterConfig(max_tokens=4, temperature=1.0))
    many = IIDDrafts(sampler).propose_many(ctx, 4, 3, gen)  # the drafter's own batched path
    assert len(many) == 3 and all(len(d.tokens) == 4 and d.probs is not None for d in many)


def test_both_engines_refuse_an_out_of_vocabulary_draft_alike(tiny_target) -> None:  # type: ignore[no-untyped-def]
    class Bad:
        name = "bad"

        def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
            return Draft(tokens=[TINY_VOCAB + 3], source="bad")

        def observe(self, *_: object) -> None: ...
        def finish(self, *_: object) -> None: ...

    for engine in (SpeculativeDecoder(tiny_target, Bad()),
                   MultiDraftDecoder(tiny_target, IIDDrafts(Bad()), num_drafts=2)):
        with pytest.raises(DraftError, match=r"outside \[0, 96\)"):
            engine.generate([0, 4, 5], 4, sampling=SamplingParams())


def _state(p: CostAwarePolicy) -> tuple[float, ...]:
    """What a cost-aware policy learns from traffic."""
    return (p.calibration, p.model_alpha, p.miss_rate, p.model_token_s)


def test_hvd_policy_state_is_per_tenant(tiny_target, hvd_parts) -> None:  # type: ignore[no-untyped-def]
    """One tenant's traffic never moves another tenant's policy estimates."""
    hybrid = build_drafter(AgentSpec(drafting=DraftingPolicy(method="hybrid")), tiny_target)
    assert isinstance(hybrid, HybridDrafter)
    engine = SpeculativeDecoder(tiny_target, hybrid, eos_token_ids=[1])
    a, b = SessionRef("s", tenant="a"), SessionRef("s", tenant="b")
    pol_a, pol_b = hybrid.policy_for(a), hybrid.policy_for(b)
    assert pol_a is not pol_b and hybrid.policy_for(a) is pol_a
    assert isinstance(pol_b, CostAwarePolicy)
    fresh = _state(pol_b)
    assert _state(pol_a) == fresh
    for prompt in _prompts(7):
        engine.generate(prompt, 24, session=a)
    assert _state(pol_b) == fresh  # tenant b's estimates did not move
    assert _state(pol_a) != fresh  # tenant a's did
    # The drafter served tenant a with a's policy, looked up per request: its default
    # policy (requests without a session) is never swapped for a tenant's.
    assert hybrid.policy is not pol_a and _state(hybrid.policy) == fresh
