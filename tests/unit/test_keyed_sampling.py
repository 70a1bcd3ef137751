"""Position-keyed sampling: same seed, same tokens, whatever was drafted; still the target law.

Verifier level (synthetic prefix-dependent models, 200k seeds, the bias bound of
``test_sampling_verifiers``): the keyed output *is* the seeded non-speculative sample
(exact equality for every trial), its law is the target's at every position, cache drafts
are accepted as often as by rejection sampling, coupled model drafts at least as often as
the Gumbel-coupling bound. Engine level (tiny random Llama, fp32): every drafter, the
multi-draft engine and the ASD verifier give the tokens of a hand-written keyed sampling
loop over the model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from agentspec.drafters.model.causal import ModelDrafter, ModelDrafterConfig
from agentspec.drafters.model.eagle import EagleConfig, EagleDrafter, build_head
from agentspec.drafters.model.eagle_head import HeadSpec
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import AgentSpecError, ConfigError
from agentspec.multi_engine import MultiDraftDecoder
from agentspec.sampling import keyed_choice, keyed_sample, process_logits, row_keys, seed_key
from agentspec.spec import VerifierPolicy
from agentspec.types import Draft, SamplingParams
from agentspec.verifiers import (
    BlockVerifier,
    BudgetConfig,
    BudgetedVerifier,
    KeyedVerifier,
    MultiDraftVerifier,
    build_verifier,
)
from agentspec.verifiers.keyed import keyed_accept
from agentspec.verifiers.rejection import rejection_accept
from tests.conftest import noisy_copy
from tests.unit.test_sampling_verifiers import (
    PROMPT,
    SETTINGS,
    FixedDrafter,
    TreeLM,
    exact_law,
    law_mismatch,
)

N_TRIALS = 200_000
K = 3  # draft length; sequences of K + 1 tokens over a 4-token vocabulary

pytestmark = pytest.mark.usefixtures("one_thread")


def _keys(seeds: range, start: int, length: int) -> np.ndarray:
    """Noise streams of output positions ``start .. start+length-1`` per seed ``[N, length]``."""
    return np.stack([row_keys(seed_key(s), range(start, start + length)) for s in seeds])


def _keyed_run(lm: TreeLM, x: torch.Tensor, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Keyed verification of drafts ``x`` ``[N, k]``, completed by keyed sampling to
    ``keys.shape[1]`` tokens. Returns ``(accepted lengths [N], sequences [N, length])``."""
    n_rows, k = x.shape
    length = keys.shape[1]
    n, y = keyed_accept(lambda i, idx: lm.tables[i][lm.code(x[idx], i)], x, keys[:, : k + 1])
    seq = torch.zeros(n_rows, length, dtype=torch.long)
    seq[:, :k] = x[:, :length]
    seq[torch.arange(n_rows), n] = y
    for d in range(1, length):
        later = n < d  # positions after the verifier's token: plain keyed sampling
        fresh = keyed_choice(lm.tables[d][lm.code(seq, d)], keys[:, d])
        seq[:, d] = torch.where(later, fresh, seq[:, d])
    return n, seq


@pytest.fixture(scope="module")
def trial_keys() -> np.ndarray:
    """Noise of output positions 1000..1003 for seeds 0..N-1 (far from 0 on purpose)."""
    return _keys(range(N_TRIALS), 1000, K + 1)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafts", ["sampled", "point_mass", "coupled"])
def test_keyed_output_is_the_seeded_sample_and_follows_the_target_law(
    setting: str, drafts: str, trial_keys: np.ndarray
) -> None:
    target_sp, draft_sp = SETTINGS[setting]
    target = TreeLM(4, K + 1, 3, target_sp)
    drafter = TreeLM(4, K, 103, draft_sp)
    gen = torch.Generator().manual_seed(3)
    if drafts == "coupled":  # the drafter's own keyed samples (a model drafter's drafts)
        _, x = _keyed_run(drafter, torch.zeros(N_TRIALS, 0, dtype=torch.long),
                          trial_keys[:, :K])
    else:
        x = drafter.draw(N_TRIALS, K, gen)
        if drafts == "point_mass":
            x[N_TRIALS // 2 :] = x[0]  # half the trials: one fixed (cache-like) draft
    n, seq = _keyed_run(target, x, trial_keys)
    _, plain = _keyed_run(target, torch.zeros(N_TRIALS, 0, dtype=torch.long), trial_keys)
    # Same seed, same tokens: every trial equals the non-speculative seeded sample.
    assert torch.equal(seq, plain)
    assert float(n.float().mean()) > 0.1  # drafts were really accepted (verified, not skipped)
    problem = law_mismatch(target.code(seq, K + 1), target.exact(K + 1))
    assert problem is None, problem
    for pos in range(K + 1):  # and every position alone (marginal law)
        exact = target.exact(K + 1).reshape([4] * (K + 1))
        marginal = exact.sum(dim=tuple(d for d in range(K + 1) if d != pos))
        problem = law_mismatch(seq[:, pos], marginal)
        assert problem is None, (pos, problem)


def test_cache_drafts_are_accepted_as_often_as_by_rejection_sampling(
    trial_keys: np.ndarray,
) -> None:
    target = TreeLM(4, K + 1, 5, SamplingParams(temperature=1.0))
    x = TreeLM(4, K, 105, SamplingParams(temperature=0.5)).draw(N_TRIALS, K, torch.Generator()
                                                                .manual_seed(5))
    n_keyed, _ = _keyed_run(target, x, trial_keys)
    p = target.rows(x, K + 1)  # [N, k+1, V]
    q = torch.nn.functional.one_hot(x, 4).float()  # point masses
    u = torch.rand(x.shape, generator=torch.Generator().manual_seed(6))
    n_rej, _ = rejection_accept(p, q, x, u)
    # Exact E[accepted] = sum_i prod_{j <= i} p_j(x_j) for both rules.
    p_x = p[:, :K].gather(2, x[:, :, None]).squeeze(2).double()
    exact = float(p_x.cumprod(dim=1).sum(dim=1).mean())
    se = float(n_keyed.double().std()) / N_TRIALS**0.5
    keyed, rej = float(n_keyed.double().mean()), float(n_rej.double().mean())
    assert abs(keyed - exact) < 5 * se, (keyed, exact, se)
    assert abs(rej - exact) < 5 * se, (rej, exact, se)
    assert keyed >= rej - 5 * 2**0.5 * se


def test_coupled_drafts_agree_at_least_as_the_gumbel_bound(trial_keys: np.ndarray) -> None:
    gen = torch.Generator().manual_seed(9)
    for _ in range(5):
        p = torch.softmax(2 * torch.randn(6, generator=gen), -1)
        q = torch.softmax(p.log() + torch.randn(6, generator=gen), -1)
        keys = trial_keys[:, 0]
        agree = (keyed_choice(p.expand(N_TRIALS, -1), keys)
                 == keyed_choice(q.expand(N_TRIALS, -1), keys)).double().mean()
        tv = float((p - q).abs().sum() / 2)
        assert float(agree) >= (1 - tv) / (1 + tv) - 5 * (0.25 / N_TRIALS) ** 0.5


def test_seed_hashing_accepts_any_integer_and_refuses_the_rest() -> None:
    keys = {seed_key(s) for s in (0, 1, -1, 2**64, 2**64 + 1, 2**200, -(2**70))}
    assert len(keys) == 7  # distinct seeds, unrelated keys (no truncation to 64 bits)
    p = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), -1)
    assert keyed_sample(p, seed_key(2**64), 3) == keyed_sample(p, seed_key(2**64), 3)
    for bad in (1.5, "7", None, True):
        with pytest.raises(ConfigError, match="seed must be an integer"):
            seed_key(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="position"):
        row_keys(seed_key(1), [-1])
    assert issubclass(ConfigError, AgentSpecError) and issubclass(ConfigError, ValueError)


def test_verify_many_keeps_the_longest_branch_matching_the_keyed_samples() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 5, 8, generator=gen).expand(3, -1, -1).clone()  # one law per depth
    sp = SamplingParams(temperature=1.0, seed=11)
    key = seed_key(11)
    want = [keyed_sample(process_logits(logits[0, i], sp), key, 20 + i) for i in range(5)]
    other = [(t + 1) % 8 for t in want]
    drafts = [Draft(tokens=[want[0], other[1], *want[2:4]], position=20),
              Draft(tokens=want[:3] + other[3:4], position=20),
              Draft(tokens=other[:4], position=20)]
    out = KeyedVerifier(MultiDraftVerifier()).verify_many(drafts, logits, sp)
    assert out.draft_index == 1 and out.result.tokens == want[:4]
    full = KeyedVerifier().verify(Draft(tokens=want[:4], position=20), logits[0], sp)
    assert full.tokens == want and full.num_accepted == 4


def test_seeded_requests_are_keyed_by_default() -> None:
    assert isinstance(build_verifier(VerifierPolicy()), KeyedVerifier)
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    draft = Draft(tokens=[1, 2], position=5)
    sp = SamplingParams(temperature=0.8, seed=3)
    want = KeyedVerifier().verify(draft, logits, sp)
    assert build_verifier(VerifierPolicy(sampler="rejection")).verify(draft, logits, sp,
                                                                      None) == want
    assert BudgetedVerifier(BudgetConfig(budget=2.0)).verify(draft, logits, sp, None) == want


# -- engine level: the tiny model -----------------------------------------------------------

SAMPLING = SamplingParams(temperature=1.0, top_p=0.95)


def _reference(model: Any, prompt: list[int], n: int, sp: SamplingParams) -> list[int]:
    """A hand-written keyed sampling loop: one full forward per token, no cache, no drafts."""
    out: list[int] = []
    key = seed_key(sp.seed if sp.seed is not None else 0)
    for t in range(n):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
        out.append(keyed_sample(process_logits(logits, sp), key, t))
    return out


def _eagle(model: Any) -> EagleDrafter:
    from agentspec.drafters.model.distilled import embedding_checksum

    torch.manual_seed(0)
    spec = HeadSpec.for_target(model, (*range(0, 96, 2), 1), "tiny-llama",
                               embedding_checksum(model))  # half the vocabulary
    head = build_head(model, spec)
    head.init_identity(0)
    return EagleDrafter(head.eval(), EagleConfig(max_tokens=4))


@pytest.fixture(scope="module")
def engines(tiny_model: Any, tiny_target: Any) -> dict[str, Any]:
    cfg = EngineConfig(max_draft=4)
    drafter = noisy_copy(tiny_model, seed=1)
    keyed = KeyedVerifier()
    garbage = FixedDrafter([7, 7, 7, 7])
    sampled = ModelDrafter(drafter, ModelDrafterConfig(max_tokens=4, temperature=1.0))
    return {
        "none": SpeculativeDecoder(tiny_target, None, keyed, config=cfg),
        "garbage": SpeculativeDecoder(tiny_target, garbage, keyed, config=cfg),
        "model_greedy": SpeculativeDecoder(
            tiny_target, ModelDrafter(drafter, ModelDrafterConfig(max_tokens=4)), keyed,
            config=cfg),
        "model_self": SpeculativeDecoder(  # the target as its own drafter: q == p
            tiny_target, ModelDrafter(tiny_model, ModelDrafterConfig(max_tokens=4)), keyed,
            config=cfg),
        "eagle": SpeculativeDecoder(tiny_target, _eagle(tiny_model), keyed, config=cfg),
        "multi_draft": MultiDraftDecoder(tiny_target, sampled,
                                         KeyedVerifier(MultiDraftVerifier()), num_drafts=3,
                                         config=cfg),
        "asd": SpeculativeDecoder(
            tiny_target, garbage, BudgetedVerifier(BudgetConfig(budget=5.0)), config=cfg),
    }


@pytest.mark.parametrize("seed", [0, 2**64 + 5, -3])
def test_every_drafter_gives_the_seeded_non_speculative_tokens(
    engines: dict[str, Any], tiny_model: Any, seed: int
) -> None:
    sp = SamplingParams(SAMPLING.temperature, SAMPLING.top_p, seed=seed)
    prompt = [3, 9, 27, 81, 50, 11]
    want = _reference(tiny_model, prompt, 24, sp)
    for name, engine in engines.items():
        for _ in range(2):  # and again: drafter caches are warm now
            got = engine.generate(prompt, max_tokens=24, sampling=sp)
            assert got.tokens == want, name
    # The coupled drafts of the target itself are always right; others at least sometimes.
    self_run = engines["model_self"].generate(prompt, max_tokens=24, sampling=sp).stats
    assert all(s.accepted == s.draft_len for s in self_run.steps)
    eagle_run = engines["eagle"].generate(prompt, max_tokens=24, sampling=sp).stats
    assert sum(s.accepted for s in eagle_run.steps) > 0


def test_unseeded_requests_keep_the_usual_sampler(tiny_target: Any) -> None:
    class Spy(BlockVerifier):
        calls = 0

        def verify(self, *args: Any, **kwargs: Any) -> Any:
            Spy.calls += 1
            return super().verify(*args, **kwargs)

    eng = SpeculativeDecoder(tiny_target, FixedDrafter([7, 7]), KeyedVerifier(Spy()),
                             config=EngineConfig(max_draft=2))
    eng.generate(PROMPT, max_tokens=6, sampling=SamplingParams(1.0, seed=1))
    assert Spy.calls == 0
    out = eng.generate(PROMPT, max_tokens=6, sampling=SamplingParams(1.0))
    assert Spy.calls == out.stats.forwards > 0


def test_keyed_engine_samples_the_models_law(tiny_model: Any, tiny_target: Any) -> None:
    law = exact_law(tiny_model, 3)
    drafter = ModelDrafter(noisy_copy(tiny_model, seed=1), ModelDrafterConfig(max_tokens=2))
    engine = SpeculativeDecoder(tiny_target, drafter, KeyedVerifier(),
                                config=EngineConfig(max_draft=2))
    outcomes = list(law)
    n = 300
    codes = []
    for seed in range(n):
        sp = SamplingParams(1.0, top_k=2, seed=seed)
        codes.append(outcomes.index(tuple(engine.generate(PROMPT, 3, sampling=sp).tokens)))
    exact = torch.tensor([law[o] for o in outcomes], dtype=torch.float64)
    counts = torch.bincount(torch.tensor(codes), minlength=len(outcomes)).double()
    chi2 = float(((counts - n * exact) ** 2 / (n * exact)).sum())
    df = torch.tensor((len(outcomes) - 1) / 2)
    assert float(torch.special.gammaincc(df, torch.tensor(chi2 / 2))) > 1e-3
