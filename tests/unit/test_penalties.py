"""Frequency, presence and repetition penalties inside the speculative loop: each verified
row is penalised by the tokens along its own draft prefix, so penalised speculative output
is token-identical to penalised decoding without drafts (chains, trees, prompt-lookup and
suffix drafts, under a grammar, and seeded keyed sampling), and penalised plain decoding
matches an independent reference (a naive loop, and transformers' repetition penalty)."""

from __future__ import annotations

import json
import random
import zlib
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from agentspec.drafters import PromptLookupDrafter, SuffixConfig, SuffixDrafter
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError
from agentspec.penalties import PenaltyState, chain_prefixes, penalise_cells, tree_prefixes
from agentspec.types import SamplingParams, SessionRef
from agentspec.verifiers import KeyedVerifier
from tests.conftest import TINY_VOCAB, CharDecoder
from tests.unit.test_engine_lossless import ScriptedDrafter
from tests.unit.test_grammar_engine import Scripted, _draft_fns
from tests.unit.test_keyed_sampling import engines  # noqa: F401 (a fixture used below)
from tests.unit.test_tree_drafts import TreeDrafter, _BatchOnly

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 1
# Several settings of each penalty and mixes; the strong ones change the output a lot.
PENALTIES = {
    "freq": SamplingParams(frequency_penalty=0.8),
    "presence": SamplingParams(presence_penalty=1.5),
    "negative": SamplingParams(frequency_penalty=-0.5, presence_penalty=-0.3),
    "rep": SamplingParams(repetition_penalty=1.3),
    "rep_soft": SamplingParams(repetition_penalty=0.8),
    "all": SamplingParams(frequency_penalty=0.4, presence_penalty=0.6, repetition_penalty=1.2),
}


def naive_penalised(z: torch.Tensor, context: list[int], generated: list[int],
                    sp: SamplingParams) -> torch.Tensor:
    """The penalty of one row computed from scratch over the whole context, token by token
    (the definition, no incremental counts)."""
    z = z.float().clone()
    if sp.repetition_penalty != 1.0:
        for v in set(context):
            z[v] = z[v] / sp.repetition_penalty if z[v] > 0 else z[v] * sp.repetition_penalty
    for v, c in Counter(generated).items():
        z[v] = z[v] - (sp.frequency_penalty * c + sp.presence_penalty * 1.0)
    return z


def reference_decode(model: torch.nn.Module, prompt: list[int], max_new: int,
                     sp: SamplingParams, eos: int | None) -> list[int]:
    """Penalised greedy decoding without agentspec: a full forward per token."""
    out: list[int] = []
    for _ in range(max_new):
        with torch.inference_mode():
            z = model(torch.tensor([prompt + out])).logits[0, -1]
        tok = int(naive_penalised(z, prompt + out, out, sp).argmax())
        out.append(tok)
        if tok == eos:
            break
    return out


def plain(target, prompt: list[int], max_new: int, sp: SamplingParams,  # type: ignore[no-untyped-def]
          eos: int | None = EOS, verifier=None, constraint=None) -> list[int]:  # type: ignore[no-untyped-def]
    engine = SpeculativeDecoder(target, None, verifier, eos_token_ids=[eos] if eos else [])
    return engine.generate(prompt, max_new, sampling=sp, constraint=constraint).tokens


# -- the function and the state -------------------------------------------------------------


def test_cells_follow_the_formulas() -> None:
    z = torch.tensor([2.0, -1.0, 0.5, 3.0])
    count = torch.tensor([2.0, 1.0, 0.0, 0.0])
    seen = torch.tensor([True, True, True, False])
    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0)
    got = penalise_cells(z, count, seen, sp)
    # token 0: 2/2 - (0.5*2 + 0.25); token 1: -1*2 - (0.5 + 0.25); token 2: prompt only.
    assert got.tolist() == [1.0 - 1.25, -2.0 - 0.75, 0.25, 3.0]
    assert penalise_cells(z, count, seen, SamplingParams()).equal(z)


def test_prefixes_of_chains_and_trees() -> None:
    assert chain_prefixes([5, 6]) == [[], [5], [5, 6]]
    # 0:5 -> 1:6, 0:5 -> 2:8 -> 3:9, root -> 4:7
    assert tree_prefixes([5, 6, 8, 9, 7], [-1, 0, 0, 2, -1]) == [
        [], [5], [5, 6], [5, 8], [5, 8, 9], [7]]
    with pytest.raises(ValueError, match="parent"):
        tree_prefixes([5, 6], [-1, 1])


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_state_rows_equal_the_naive_definition(name: str) -> None:
    sp = PENALTIES[name]
    rng = random.Random(zlib.crc32(name.encode()))
    vocab = 40
    for _ in range(20):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        state = PenaltyState(sp, vocab, prompt)
        generated: list[int] = []
        for _step in range(4):
            block = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            state.commit(block)
            generated += block
        n = rng.randint(1, 6)
        draft = [rng.randrange(vocab) for _ in range(n)]
        parents = [rng.randrange(-1, i) for i in range(n)]
        prefixes = tree_prefixes(draft, parents)
        z = torch.randn(n + 1, vocab) * 3
        got = z.clone()
        state.apply(got, prefixes)
        for row, pre in enumerate(prefixes):
            want = naive_penalised(z[row], prompt + generated + pre, generated + pre, sp)
            assert torch.allclose(got[row], want, atol=1e-6), (name, row)


def test_sampling_params_validate_penalties() -> None:
    for bad in ({"frequency_penalty": 2.5}, {"presence_penalty": -3.0},
                {"frequency_penalty": float("nan")}, {"repetition_penalty": 0.0},
                {"repetition_penalty": -1.0}, {"repetition_penalty": float("inf")}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert not SamplingParams().penalised
    assert SamplingParams(repetition_penalty=1.1).penalised


# -- plain penalised decoding against independent references ---------------------------------


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_plain_penalised_decoding_matches_the_reference(tiny_model, tiny_target, name) -> None:  # type: ignore[no-untyped-def]
    sp = PENALTIES[name]
    rng = random.Random(zlib.crc32(name.encode()) + 1)
    changed = 0
    for _ in range(3):
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(1, 15))]
        got = plain(tiny_target, prompt, 30, sp)
        assert got == reference_decode(tiny_model, prompt, 30, sp, EOS)
        changed += got != plain(tiny_target, prompt, 30, SamplingParams())
    assert changed  # the penalty did change the output


def test_repetition_penalty_matches_transformers(tiny_model, tiny_target) -> None:  # type: ignore[no-untyped-def]
    for rp in (1.1, 1.5):
        prompt = [5, 9, 13, 5, 9, 30]
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            hf = tiny_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                                     do_sample=False, repetition_penalty=rp, eos_token_id=EOS,
                                     pad_token_id=EOS)
        want = hf[0, len(prompt):].tolist()
        assert plain(tiny_target, prompt, 30, SamplingParams(repetition_penalty=rp)) == want


# -- speculative == plain, token for token --------------------------------------------------


def _chain_fns(rng: random.Random) -> dict[str, Callable[[list[int], int, int], list[int]]]:
    fns = _draft_fns(rng)
    fns["wrong"] = lambda ref, pos, k: [(t + 1) % TINY_VOCAB for t in ref[pos:pos + k]]
    return fns


@pytest.mark.parametrize("name", sorted(PENALTIES))
@pytest.mark.parametrize("kind", ["right", "too_long", "flip", "random", "wrong"])
def test_penalised_chain_drafts_equal_plain(tiny_target, name, kind) -> None:  # type: ignore[no-untyped-def]
    sp = PENALTIES[name]
    rng = random.Random(zlib.crc32(f"{name}{kind}".encode()))
    for trial in range(3):
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(1, 20))]
        max_new = rng.randint(1, 40)
        expected = plain(tiny_target, prompt, max_new, sp)
        ref = plain(tiny_target, prompt, max_new + 20, sp, eos=None)
        drafter = ScriptedDrafter(_chain_fns(rng)[kind], ref)
        engine = SpeculativeDecoder(tiny_target, drafter, eos_token_ids=[EOS],
                                    config=EngineConfig(max_draft=rng.choice([2, 4, 8, 16])))
        got = engine.generate(prompt, max_new, sampling=sp)
        assert got.tokens == expected, (name, kind, trial)
        if kind == "right" and max_new > 4 and len(expected) == max_new:
            assert got.stats.forwards < len(expected)  # drafts were accepted


@pytest.mark.parametrize("name", ["freq", "rep", "all"])
@pytest.mark.parametrize("attention", ["tree", "branch_rows"])
def test_penalised_tree_drafts_equal_plain(tiny_target, name, attention) -> None:  # type: ignore[no-untyped-def]
    sp = PENALTIES[name]
    target = tiny_target if attention == "tree" else _BatchOnly(tiny_target)
    rng = random.Random(zlib.crc32(f"{name}{attention}".encode()))
    for trial in range(5):
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(1, 20))]
        expected = plain(tiny_target, prompt, 30, sp, eos=None)
        engine = SpeculativeDecoder(target, TreeDrafter(expected + [3] * 20, rng),
                                    config=EngineConfig(max_draft=16, max_branches=3))
        got = engine.generate(prompt, 30, sampling=sp)
        assert got.tokens == expected, (name, attention, trial)
        assert any(s.accepted for s in got.stats.steps)  # tree rows were accepted


@pytest.mark.parametrize("name", ["freq", "presence", "rep", "all"])
def test_penalised_session_drafters_equal_plain(tiny_target, name) -> None:  # type: ignore[no-untyped-def]
    # A session that repeats itself: the suffix cache (chains and trees) and prompt lookup
    # draft from it; with penalties the model repeats less, so drafts are often rejected.
    sp = PENALTIES[name]
    rng = random.Random(zlib.crc32(name.encode()) + 2)
    base = [rng.randrange(2, TINY_VOCAB) for _ in range(12)]
    drafters = {"suffix": SuffixDrafter(SuffixConfig(max_tokens=12)),
                "suffix_tree": SuffixDrafter(SuffixConfig(tree=True, max_tokens=12)),
                "lookup": PromptLookupDrafter()}
    drafted = Counter[str]()
    for turn in range(3):
        prompt = base + [rng.randrange(2, TINY_VOCAB) for _ in range(3)] + base[:6]
        expected = plain(tiny_target, prompt, 30, sp, eos=None)
        for label, drafter in drafters.items():
            engine = SpeculativeDecoder(tiny_target, drafter, config=EngineConfig(max_draft=12))
            got = engine.generate(prompt, 30, sampling=sp, session=SessionRef("s1", "t"))
            assert got.tokens == expected, (name, label, turn)
            drafted[label] += sum(s.draft_len for s in got.stats.steps)
        base = expected[:12] if len(expected) >= 12 else base
    assert all(drafted[label] for label in drafters), drafted


@pytest.mark.parametrize("name", ["freq", "rep", "all"])
@pytest.mark.parametrize("kind", ["right", "flip", "random"])
def test_penalised_constrained_drafts_equal_plain(tiny_target, name, kind) -> None:  # type: ignore[no-untyped-def]
    from agentspec.chat.grammar import GrammarCompiler
    from agentspec.chat.grammar_sources import json_grammar
    from tests.unit.test_grammar_engine import SCHEMA

    alphabet = CharDecoder.alphabet
    compiler = GrammarCompiler.from_tokens(
        [alphabet[i % len(alphabet)].encode() for i in range(TINY_VOCAB)], EOS, special=[0])
    sp = PENALTIES[name]
    rng = random.Random(zlib.crc32(f"{name}{kind}".encode()) + 3)
    decode = CharDecoder()
    for trial in range(3):
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(1, 20))]
        expected = plain(tiny_target, prompt, 80, sp,
                         constraint=compiler.constraint(json_grammar(SCHEMA)))
        assert expected[-1] == EOS
        json.loads(decode(expected[:-1]))  # valid JSON under the penalty too
        drafter = Scripted(_draft_fns(rng)[kind], expected + [9] * 30)
        engine = SpeculativeDecoder(tiny_target, drafter, eos_token_ids=[EOS],
                                    config=EngineConfig(max_draft=rng.choice([4, 8, 16])))
        got = engine.generate(prompt, 80, sampling=sp,
                              constraint=compiler.constraint(json_grammar(SCHEMA)))
        assert got.tokens == expected, (name, kind, trial)


@pytest.mark.parametrize("name", ["freq", "rep", "all"])
def test_penalised_seeded_sampling_equals_its_plain_run(tiny_target, name) -> None:  # type: ignore[no-untyped-def]
    # Keyed (seeded) sampling promises the non-speculative seeded sample whatever is
    # drafted; with penalties each row's distribution is the penalised one of its prefix.
    base = PENALTIES[name]
    rng = random.Random(zlib.crc32(name.encode()) + 4)
    changed = 0
    for seed in range(4):
        sp = SamplingParams(1.0, top_k=8, seed=seed, frequency_penalty=base.frequency_penalty,
                            presence_penalty=base.presence_penalty,
                            repetition_penalty=base.repetition_penalty)
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(1, 15))]
        expected = plain(tiny_target, prompt, 30, sp, eos=None, verifier=KeyedVerifier())
        unpenalised = plain(tiny_target, prompt, 30, SamplingParams(1.0, top_k=8, seed=seed),
                            eos=None, verifier=KeyedVerifier())
        for kind in ("right", "flip", "random"):
            drafter = ScriptedDrafter(_chain_fns(rng)[kind], expected + [3] * 20)
            engine = SpeculativeDecoder(tiny_target, drafter, KeyedVerifier(),
                                        config=EngineConfig(max_draft=8))
            assert engine.generate(prompt, 30, sampling=sp).tokens == expected, (seed, kind)
        changed += expected != unpenalised
    assert changed  # the penalty is in effect


# -- every drafter and the multi-draft engine, seeded ---------------------------------------


def test_every_drafter_gives_the_penalised_seeded_tokens(engines, tiny_model) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    # The keyed-sampling engines of test_keyed_sampling (no drafts, garbage, model drafters
    # greedy / sampled / the target itself, EAGLE, K=3 multi-draft, ASD's keyed fallback)
    # against a hand-written loop: full forward, naive penalty, keyed draw per position.
    from agentspec.sampling import keyed_sample, process_logits, seed_key

    prompt = [3, 9, 27, 81, 50, 11]
    for sp in (SamplingParams(1.0, top_p=0.95, seed=5, repetition_penalty=1.3),
               SamplingParams(1.0, seed=8, frequency_penalty=0.7, presence_penalty=0.4)):
        want: list[int] = []
        for t in range(20):
            with torch.inference_mode():
                z = tiny_model(torch.tensor([prompt + want])).logits[0, -1]
            p = process_logits(naive_penalised(z, prompt + want, want, sp), sp)
            want.append(keyed_sample(p, seed_key(sp.seed or 0), t))
        for name, engine in engines.items():
            assert engine.generate(prompt, 20, sampling=sp).tokens == want, (name, sp)
