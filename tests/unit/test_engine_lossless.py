"""The engine's output is token-identical to transformers' greedy generate, whatever the
drafts: all wrong, all right, partly right, random, empty, too long, with EOS or a stop
string inside, at the max_tokens boundary."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable

import pytest
import torch

from agentspec.chat.stream import ResultStream
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.types import Draft, DraftContext, VerifyResult
from tests.conftest import TINY_VOCAB

EOS = 1


def hf_greedy(
    model: torch.nn.Module, prompt: list[int], max_new: int, eos: int | None
) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
            eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
        )
    return out[0, len(prompt):].tolist()


class ScriptedDrafter:
    """Drafts from a function of (reference continuation, position)."""

    name = "scripted"

    def __init__(self, fn: Callable[[list[int], int, int], list[int]], ref: list[int]) -> None:
        self.fn, self.ref = fn, ref
        self.calls = 0

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        self.calls += 1
        return Draft(tokens=self.fn(self.ref, len(ctx.generated), max_tokens), source=self.name)

    def observe(self, ctx: DraftContext, result: VerifyResult) -> None:
        assert result.tokens, "the verifier always commits at least one token"

    def finish(self, ctx: DraftContext) -> None:
        pass


def _wrong(ref: list[int], pos: int, k: int) -> list[int]:
    # Every token differs from the reference at its position.
    return [(t + 1) % TINY_VOCAB for t in ref[pos : pos + k]] or [5] * k


def _right(ref: list[int], pos: int, k: int) -> list[int]:
    return ref[pos : pos + k]


def _too_long(ref: list[int], pos: int, k: int) -> list[int]:
    return (ref[pos:] + [7] * 50)[:k]  # right, then junk past the reference's end


def _one_flip(ref: list[int], pos: int, k: int) -> list[int]:
    d = list(ref[pos : pos + k])
    if len(d) > 2:
        d[len(d) // 2] = (d[len(d) // 2] + 3) % TINY_VOCAB
    return d


def _with_eos(ref: list[int], pos: int, k: int) -> list[int]:
    d = list(ref[pos : pos + k])
    return [*d[:2], EOS, *d[2:]][:k]


def _random(rng: random.Random) -> Callable[[list[int], int, int], list[int]]:
    return lambda ref, pos, k: [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(0, k))]


def _empty(ref: list[int], pos: int, k: int) -> list[int]:
    return []


DRAFTS = {
    "wrong": _wrong, "right": _right, "too_long": _too_long, "one_flip": _one_flip,
    "eos_inside": _with_eos, "empty": _empty,
}


@pytest.mark.parametrize("kind", [*DRAFTS, "random"])
def test_identical_to_hf_greedy(tiny_model, tiny_target, kind: str) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(zlib.crc32(kind.encode()))
    for trial in range(12):
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(1, 30))]
        max_new = rng.randint(1, 40)
        eos = EOS if trial % 2 == 0 else None
        expected = hf_greedy(tiny_model, prompt, max_new, eos)
        # The drafter sees the untruncated greedy continuation (as an oracle would).
        long_ref = hf_greedy(tiny_model, prompt, max_new + 20, None)
        fn = _random(rng) if kind == "random" else DRAFTS[kind]
        drafter = ScriptedDrafter(fn, long_ref)
        engine = SpeculativeDecoder(
            tiny_target, drafter, eos_token_ids=[eos] if eos is not None else [],
            config=EngineConfig(max_draft=rng.choice([1, 4, 8, 16])),
        )
        got = engine.generate(prompt, max_tokens=max_new)
        assert got.tokens == expected, (kind, trial, prompt, max_new)
        assert len(got.tokens) <= max_new
        assert got.finish_reason == ("stop" if got.tokens and got.tokens[-1] == eos else "length")
        assert got.stats.generated_tokens == len(expected)
        assert got.stats.forwards == len(got.stats.steps)


def test_right_drafts_need_fewer_forwards(tiny_model, tiny_target) -> None:  # type: ignore[no-untyped-def]
    prompt = [5, 9, 13, 17]
    ref = hf_greedy(tiny_model, prompt, 80, None)
    engine = SpeculativeDecoder(
        tiny_target, ScriptedDrafter(_right, ref), config=EngineConfig(max_draft=8)
    )
    got = engine.generate(prompt, max_tokens=64)
    assert got.tokens == ref[:64]
    # Seven steps commit 8 draft tokens + 1 bonus (63 tokens); the last has no room left
    # for a draft and commits the verifier's own token.
    assert got.stats.forwards == 8
    assert got.stats.accepted_histogram() == {0: 1, 8: 7}


def test_all_wrong_drafts_cost_one_forward_per_token(tiny_model, tiny_target) -> None:  # type: ignore[no-untyped-def]
    prompt = [3, 4, 5]
    ref = hf_greedy(tiny_model, prompt, 40, None)
    engine = SpeculativeDecoder(tiny_target, ScriptedDrafter(_wrong, ref))
    got = engine.generate(prompt, max_tokens=30)
    assert got.tokens == ref[:30]
    assert got.stats.forwards == 30
    assert set(got.stats.accepted_histogram()) == {0}


def test_stop_strings_match_greedy(tiny_model, tiny_target, char_decode) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    checked = 0
    for _ in range(20):
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(1, 20))]
        ref = hf_greedy(tiny_model, prompt, 60, None)
        text = char_decode(ref)
        start = rng.randrange(5, 40)
        stop = text[start : start + rng.randint(1, 3)]
        # Greedy with a stop string ends at the first token whose text completes it.
        cut = next(i + 1 for i in range(len(ref)) if stop in char_decode(ref[: i + 1]))
        for fn in (_right, _wrong, _too_long):
            engine = SpeculativeDecoder(
                tiny_target, ScriptedDrafter(fn, ref), decode=char_decode,
                config=EngineConfig(max_draft=8),
            )
            got = engine.generate(prompt, max_tokens=60, stop=[stop])
            assert got.tokens == ref[:cut]
            assert got.finish_reason == "stop"
            assert got.text == text[: text.find(stop)]
            assert stop not in got.text
            checked += 1
    assert checked == 60


def test_stream_yields_the_same_text(tiny_model, tiny_target, char_decode) -> None:  # type: ignore[no-untyped-def]
    prompt = [11, 12, 13]
    ref = hf_greedy(tiny_model, prompt, 50, None)
    text = char_decode(ref)
    stop = text[30:32]
    engine = SpeculativeDecoder(
        tiny_target, ScriptedDrafter(_right, ref), decode=char_decode,
        config=EngineConfig(max_draft=6),
    )
    stream = ResultStream(engine.stream(prompt, 50, stop=[stop]))
    deltas = list(stream)
    assert len(deltas) > 1  # real increments, not one blob at the end
    assert "".join(deltas) == stream.result.text == text[: text.find(stop)]


def test_max_tokens_one(tiny_model, tiny_target) -> None:  # type: ignore[no-untyped-def]
    ref = hf_greedy(tiny_model, [4, 5], 1, None)
    drafter = ScriptedDrafter(_right, hf_greedy(tiny_model, [4, 5], 10, None))
    got = SpeculativeDecoder(tiny_target, drafter).generate([4, 5], max_tokens=1)
    assert got.tokens == ref
    assert drafter.calls == 0  # no room for a draft: the verifier's own token is the one


def test_stop_string_before_eos_in_one_block(tiny_model, tiny_target, char_decode) -> None:  # type: ignore[no-untyped-def]
    # A draft can carry a stop string and, a few tokens later, EOS: the stop string comes
    # first, so the output ends there (found by the DELEGATE-52 relay: a closing fence
    # followed by more text and EOS inside one accepted block).
    rng = random.Random(3)
    checked = 0
    for _ in range(30):
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(1, 20))]
        ref = hf_greedy(tiny_model, prompt, 60, None)
        text = char_decode(ref)
        start = rng.randrange(5, 30)
        stop = text[start : start + 2]
        cut = next(i + 1 for i in range(len(ref)) if stop in char_decode(ref[: i + 1]))
        later = [t for t in ref[cut + 1 : cut + 6] if t not in ref[:cut]]
        if not later:
            continue
        eos = later[0]  # an EOS id that first occurs a few tokens after the stop string
        engine = SpeculativeDecoder(
            tiny_target, ScriptedDrafter(_right, ref), decode=char_decode,
            eos_token_ids=[eos], config=EngineConfig(max_draft=16),
        )
        got = engine.generate(prompt, max_tokens=60, stop=[stop])
        assert got.tokens == ref[:cut] and got.finish_reason == "stop"
        checked += 1
    assert checked >= 10
