"""llama.cpp (the peer) on the embedded model's GGUF against agentspec's fp32 greedy decoding
of the same token ids. Skipped only where the peer is not installed (`make llamacpp`).

llama.cpp decodes the GGUF's Q4_1 weights; agentspec dequantises the same file to fp32, so
their greedy answers can part. Measured on 8 short chat prompts, 32 tokens each: fed fp32's
greedy answer, llama.cpp's argmax equals fp32's next token at 247 of 256 positions (96.5 %);
running free, the answers start alike wherever fp32's first-token margin (top-1 minus top-2
logit) is above 0.5 (all 32 tokens alike on three prompts), and part at the first token on
two prompts whose margin is under 0.1 ("What is the capital of France?": fp32 "The" 25.33
against "L" 25.24; llama.cpp "L" 24.91 against "The" 24.56). The tests assert both: the first
tokens on prompts with a clear margin, and the teacher-forced agreement on all of them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agentspec.targets.hf import HFTarget
from workflows.bench.llamacpp import LlamaCppRunner, PeerUnavailableError, load_library

# fp32's first-token margin above 1 logit on these: the free-running answers agree.
CLEAR = ("Write a Python function that adds two numbers.", "What is 12 times 7?",
         "Name the largest planet in the solar system.")
# Margins from 0.02 to 3.1: some free-running answers part at once.
ANY = (*CLEAR, "What is the capital of France?", "List three colours.",
       "Explain what a hash map is in one paragraph.", 'Repeat: {"a": 1, "b": 2}',
       "Translate 'good morning' into Spanish.")
LEAD = 8

# Session scope: set up before the embedded model, so a missing peer skips without loading it.
@pytest.fixture(scope="session")
def runner() -> Iterator[LlamaCppRunner]:
    try:
        load_library()
    except PeerUnavailableError as exc:
        pytest.skip(f"the llama.cpp peer is not installed (`make llamacpp`): {exc}")
    from workflows.bench.llamacpp_bench import peer_gguf

    with peer_gguf(None, None) as gguf:
        r = LlamaCppRunner(gguf, n_ctx=512)
    yield r
    r.close()


def _fp32_greedy(target: HFTarget, prompt: list[int], n: int) -> list[int]:
    from agentspec.factory import build_drafter, build_engine
    from workflows.bench.methods import method_spec

    spec = method_spec("plain")
    tok = target.tokenizer
    engine = build_engine(spec, target, build_drafter(spec, target),
                          decode=lambda ids: tok.decode(ids), eos_token_ids=[])
    return list(engine.generate(prompt, n).tokens)


def test_llamacpp_greedy_agrees_with_agentspec_fp32_greedy(
        runner: LlamaCppRunner, embedded_target: HFTarget) -> None:
    from agentspec.chat.templates import render_prompt

    tok = embedded_target.tokenizer
    agree = total = 0
    for text in ANY:
        prompt = render_prompt(tok, [{"role": "user", "content": text}])
        ours = _fp32_greedy(embedded_target, prompt, 24)
        forced = runner.teacher_forced(prompt, ours)
        agree += sum(a == b for a, b in zip(forced, ours, strict=True))
        total += len(ours)
        if text in CLEAR:
            peer = runner.run_turn(prompt, LEAD, reuse=False)
            assert peer.tokens == ours[:LEAD], (text, tok.decode(peer.tokens),
                                                tok.decode(ours[:LEAD]))
            assert (peer.reused, peer.new_prompt) == (0, len(prompt))
    assert agree / total >= 0.9, f"{agree} of {total} next tokens agree"


def test_prefix_reuse_reads_the_previous_turn_and_keeps_the_answer(
        runner: LlamaCppRunner, embedded_target: HFTarget) -> None:
    """A second turn that re-sends the first (prompt and answer) feeds only the new tail;
    its greedy answer is a cold prefill's of the same prompt (a tail of two or more rows
    runs llama.cpp's batched products, as the cold prompt does; one row would not)."""
    from agentspec.chat.templates import render_prompt

    tok = embedded_target.tokenizer
    runner.clear()
    first = [{"role": "user", "content": ANY[3]}]
    p1 = render_prompt(tok, first)
    a1 = runner.run_turn(p1, 12, eos=[tok.eos_token_id])
    answer = tok.decode(a1.tokens, skip_special_tokens=True)
    p2 = render_prompt(tok, [*first, {"role": "assistant", "content": answer},
                             {"role": "user", "content": ANY[4]}])
    warm = runner.run_turn(p2, LEAD)
    assert warm.reused >= len(p1) and warm.new_prompt == len(p2) - warm.reused >= 2
    cold = runner.run_turn(p2, LEAD, reuse=False)
    assert cold.reused == 0
    assert warm.tokens == cold.tokens
