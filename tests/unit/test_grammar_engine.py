"""Grammar-constrained speculative decoding on the tiny model: token-identical to
constrained greedy decoding without drafts whatever the drafts, grammar state consistent
with the committed tokens after every step (rollback included), output always valid."""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Callable

import pytest

from agentspec.chat.grammar import GrammarCompiler
from agentspec.chat.grammar_sources import json_grammar
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError, GrammarError
from agentspec.types import Draft, DraftContext, SamplingParams, VerifyResult
from tests.conftest import TINY_VOCAB, CharDecoder

EOS = 1
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "maxLength": 4},
        "b": {"enum": ["x", "yz"]},
        "c": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    """A grammar compiler for the tiny model's character vocabulary (token 0 is BOS,
    token 1 EOS; the other 94 tokens are characters, each character twice)."""
    alphabet = CharDecoder.alphabet
    tokens = [alphabet[i % len(alphabet)].encode() for i in range(TINY_VOCAB)]
    return GrammarCompiler.from_tokens(tokens, EOS, special=[0])


class Scripted:
    """Drafts from a function of (reference continuation, position, room)."""

    name = "scripted"

    def __init__(self, fn: Callable[[list[int], int, int], list[int]], ref: list[int]) -> None:
        self.fn, self.ref = fn, ref

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return Draft(tokens=self.fn(self.ref, len(ctx.generated), max_tokens), source=self.name)

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        pass

    def finish(self, ctx: DraftContext) -> None:
        pass


def _draft_fns(rng: random.Random) -> dict[str, Callable[[list[int], int, int], list[int]]]:
    def flip(ref: list[int], pos: int, k: int) -> list[int]:
        d = list(ref[pos : pos + k])
        if len(d) > 2:
            d[len(d) // 2] = rng.randrange(2, TINY_VOCAB)
        return d

    return {
        "right": lambda ref, pos, k: ref[pos : pos + k],
        "too_long": lambda ref, pos, k: (ref[pos:] + [7] * 40)[:k],
        "flip": flip,
        "random": lambda ref, pos, k: [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(0, k))],
    }


def alphabet_ids(text: str) -> list[int]:
    return [CharDecoder.alphabet.index(c) for c in text]


def _baseline(tiny_target, compiler, prompt, max_new):  # type: ignore[no-untyped-def]
    engine = SpeculativeDecoder(tiny_target, None, eos_token_ids=[EOS])
    return engine.generate(prompt, max_new, constraint=compiler.constraint(json_grammar(SCHEMA)))


@pytest.mark.parametrize("kind", ["right", "too_long", "flip", "random"])
def test_constrained_speculative_equals_constrained_greedy(
    tiny_target, compiler, one_thread, kind: str  # type: ignore[no-untyped-def]
) -> None:
    rng = random.Random(zlib.crc32(kind.encode()))
    decode = CharDecoder()
    for trial in range(6):
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(1, 20))]
        expected = _baseline(tiny_target, compiler, prompt, 60)
        # The no-draft run is valid JSON following the schema (the random model alone
        # would never write JSON).
        assert expected.finish_reason == "stop", decode(expected.tokens)
        doc = json.loads(decode(expected.tokens[:-1]))
        assert set(doc) == {"a", "b", "c"} and doc["b"] in ("x", "yz"), doc
        drafter = Scripted(_draft_fns(rng)[kind], expected.tokens + [9] * 30)
        engine = SpeculativeDecoder(tiny_target, drafter, eos_token_ids=[EOS],
                                    config=EngineConfig(max_draft=rng.choice([2, 4, 8, 16])))
        constraint = compiler.constraint(json_grammar(SCHEMA))
        got = engine.generate(prompt, 60, constraint=constraint)
        assert got.tokens == expected.tokens, (kind, trial)
        if kind == "right":  # drafts of the answer itself are accepted: fewer forwards
            assert got.stats.forwards < expected.stats.forwards
        assert constraint.done  # EOS consumed: the grammar is complete
        assert constraint.stats.masks >= got.stats.forwards


def test_grammar_state_matches_committed_tokens_after_every_step(
    tiny_target, compiler, one_thread  # type: ignore[no-untyped-def]
) -> None:
    rng = random.Random(7)
    prompt = [5, 9, 13, 17, 21]
    ref = _baseline(tiny_target, compiler, prompt, 60).tokens
    drafter = Scripted(_draft_fns(rng)["flip"], ref + [9] * 30)
    engine = SpeculativeDecoder(tiny_target, drafter, eos_token_ids=[EOS],
                                config=EngineConfig(max_draft=8))
    constraint = compiler.constraint(json_grammar(SCHEMA))
    steps = engine.steps(prompt, 60, constraint=constraint)
    seen = 0
    for generated in steps:
        seen += 1
        assert constraint.tokens == generated
        fresh = compiler.constraint(json_grammar(SCHEMA))
        for tok in generated:
            assert fresh.matcher.consume_token(tok)
        if not constraint.done:
            assert constraint.state_mask().equal(fresh.state_mask()), generated
    assert seen >= 2 and constraint.stats.cut_drafts > 0  # flipped drafts were cut


def test_forbidden_draft_token_ends_the_accepted_prefix(
    tiny_target, compiler, one_thread  # type: ignore[no-untyped-def]
) -> None:
    constraint = compiler.constraint(json_grammar(SCHEMA))
    # '{' is the only legal first character; '"' / 'a' are legal next; 'z' after '{' is not.
    alphabet = CharDecoder.alphabet
    ids = [alphabet.index(c) for c in '{"z']
    cut = constraint.prepare(Draft(ids, source="t"))
    assert cut.tokens == ids[:2]
    assert constraint.stats.cut_drafts == 1 and constraint.stats.masks == 3


def test_sampled_constrained_output_follows_the_schema(
    tiny_target, compiler, one_thread  # type: ignore[no-untyped-def]
) -> None:
    from agentspec.verifiers.rejection import RejectionVerifier

    decode = CharDecoder()
    ref = [alphabet_ids('{"a": "')]
    engine = SpeculativeDecoder(tiny_target, Scripted(lambda r, pos, k: r[pos:pos + k], ref[0]),
                                RejectionVerifier(), eos_token_ids=[EOS])
    for seed in range(4):
        got = engine.generate([3, 4, 5], 60, sampling=SamplingParams(1.0, seed=seed),
                              constraint=compiler.constraint(json_grammar(SCHEMA)))
        assert got.finish_reason == "stop"
        doc = json.loads(decode(got.tokens[:-1]))
        assert doc["b"] in ("x", "yz") and 0 <= doc["c"] <= 999 and len(doc["a"]) <= 4


def test_misuse_raises(tiny_target, compiler) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(GrammarError, match="invalid grammar"):
        compiler.constraint("start: %json {")
    from agentspec.multi_engine import MultiDraftDecoder

    multi = MultiDraftDecoder.__new__(MultiDraftDecoder)
    assert not multi.supports_constraints
    engine = SpeculativeDecoder(tiny_target, None, eos_token_ids=[EOS])
    engine.supports_constraints = False
    with pytest.raises(ConfigError, match="cannot decode under a grammar"):
        engine.generate([3], 5, constraint=compiler.constraint(json_grammar(SCHEMA)))


def test_constrained_bench_methods(tiny_target, compiler) -> None:  # type: ignore[no-untyped-def]
    from agentspec.errors import BenchmarkError
    from workflows.bench.methods import EngineMethod, MethodContext, build_method

    class _Ctx(MethodContext):
        eos_ids = (EOS,)  # the tiny target has no tokenizer

    ctx = _Ctx(tiny_target, grammars=compiler)
    greedy = build_method("greedy", ctx)  # the reference: the engine without drafts
    assert isinstance(greedy, EngineMethod) and greedy.decoder.drafter is None
    assert isinstance(build_method("suffix", ctx), EngineMethod)
    with pytest.raises(BenchmarkError, match="cannot decode under a grammar"):
        build_method("hf_prompt_lookup", ctx)


def test_runtime_picks_the_request_grammar() -> None:
    from agentspec.chat.grammar_sources import tool_call_grammar
    from agentspec.runtime import Runtime
    from agentspec.spec import AgentSpec

    class Recorder:  # stands in for the compiler: returns the grammar text it is given
        def constraint(self, grammar: str) -> str:
            return grammar

    from agentspec.chat.formats.fallback import FallbackFormat

    rt = Runtime.__new__(Runtime)
    rt._grammars = Recorder()  # type: ignore[assignment]
    rt.tool_format = FallbackFormat()
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}
    on, off = AgentSpec(), AgentSpec(constrained_tool_calls=False)
    obj = {"type": "json_object"}
    # A forced call wins over response_format; response_format over the auto tool grammar.
    assert rt.constraint_for([tool], "required", obj, on) == tool_call_grammar([tool], "required")
    assert rt.constraint_for([tool], "auto", obj, on) == json_grammar(None, flexible=True)
    assert rt.constraint_for([tool], None, None, on) == tool_call_grammar([tool], "auto")
    assert rt.constraint_for([tool], "none", None, on) is None
    assert rt.constraint_for([tool], "required", None, off) is None
    assert rt.constraint_for(None, None, obj, off) == json_grammar(None, flexible=True)
    grammar = tool_call_grammar([tool], "add")
    assert grammar is not None and '"additionalProperties": false' in grammar
