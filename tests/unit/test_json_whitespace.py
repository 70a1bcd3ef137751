"""``response_format`` grammars allow the model's own JSON whitespace (pretty-printed or
compact, bounded to one line break plus indentation), tool-call grammars keep the compact
layout, and constrained + speculative decoding stays token-identical to constrained greedy
decoding under the flexible grammar, penalties included."""

from __future__ import annotations

import json
import random
import zlib

import pytest

from agentspec.chat.grammar import GrammarCompiler
from agentspec.chat.grammar_sources import json_grammar, response_format_grammar
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.types import SamplingParams
from tests.conftest import TINY_VOCAB, CharDecoder
from tests.unit.test_grammar_engine import Scripted, _draft_fns, alphabet_ids

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 1
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                            "maxItems": 3}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
DOC = {"name": "ann", "age": 7, "tags": ["a", "bc"]}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    alphabet = CharDecoder.alphabet
    return GrammarCompiler.from_tokens(
        [alphabet[i % len(alphabet)].encode() for i in range(TINY_VOCAB)], EOS, special=[0])


def _accepts(compiler: GrammarCompiler, grammar: str, text: str) -> bool:
    """Whether the grammar accepts exactly ``text`` (then EOS)."""
    matcher = compiler.constraint(grammar).matcher
    # Tokens 0 and 1 are BOS / EOS; their characters ('a', 'b') are also one alphabet later.
    ids = [i if i > 1 else i + len(CharDecoder.alphabet) for i in alphabet_ids(text)]
    return (matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids)
            and matcher.is_accepting())


@pytest.mark.parametrize("layout,ok", [
    (json.dumps(DOC), True),  # ", " and ": " (the tool-call layout)
    (json.dumps(DOC, separators=(",", ":")), True),  # minimal
    (json.dumps(DOC, indent=2), True),  # pretty-printed, as instruction models write it
    (json.dumps(DOC, indent=4), True),
    (json.dumps(DOC, indent=2).replace("\n", "\n\n"), False),  # two line breaks in a row
    (json.dumps(DOC).replace(", ", "," + " " * 40), False),  # a run past the bound
    (" " + json.dumps(DOC), False),  # nothing before the value
    (json.dumps({**DOC, "age": "7"}, indent=2), False),  # still the schema
])
def test_response_format_allows_the_models_own_whitespace(compiler, layout: str, ok: bool) -> None:  # type: ignore[no-untyped-def]
    grammar = response_format_grammar(FORMAT)
    assert grammar is not None
    assert _accepts(compiler, grammar, layout) is ok, layout
    obj = response_format_grammar({"type": "json_object"})
    assert obj is not None and _accepts(compiler, obj, json.dumps(DOC, indent=2))


def test_compact_grammar_keeps_one_layout(compiler) -> None:  # type: ignore[no-untyped-def]
    # json_grammar without flexible (the tool-call layout) accepts only ", " / ": ".
    grammar = json_grammar(SCHEMA)
    assert _accepts(compiler, grammar, json.dumps(DOC))
    assert not _accepts(compiler, grammar, json.dumps(DOC, indent=2))
    assert not _accepts(compiler, grammar, json.dumps(DOC, separators=(",", ":")))


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(repetition_penalty=1.3),
                                      SamplingParams(frequency_penalty=0.7)],
                         ids=["greedy", "rep", "freq"])
@pytest.mark.parametrize("kind", ["right", "too_long", "flip", "random"])
def test_flexible_constrained_speculative_equals_constrained_greedy(
    tiny_target, compiler, kind: str, sampling: SamplingParams  # type: ignore[no-untyped-def]
) -> None:
    grammar = response_format_grammar(FORMAT)
    assert grammar is not None
    rng = random.Random(zlib.crc32(f"{kind}{sampling}".encode()))
    for trial in range(4):
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(1, 20))]
        plain = SpeculativeDecoder(tiny_target, None, eos_token_ids=[EOS])
        expected = plain.generate(prompt, 80, sampling=sampling,
                                  constraint=compiler.constraint(grammar))
        drafter = Scripted(_draft_fns(rng)[kind], expected.tokens + [9] * 30)
        engine = SpeculativeDecoder(tiny_target, drafter, eos_token_ids=[EOS],
                                    config=EngineConfig(max_draft=rng.choice([2, 4, 8, 16])))
        got = engine.generate(prompt, 80, sampling=sampling,
                              constraint=compiler.constraint(grammar))
        assert got.tokens == expected.tokens, (kind, trial)
        if expected.finish_reason == "stop":  # the random model closed the document
            json.loads(CharDecoder()(expected.tokens[:-1]))
