"""bf16, int8, w8a8 and w8a16 on the embedded model: speculation is token-identical to plain
decoding in the same precision.

The rounding differences that break it are rare per product (a one-row product rounds one
bf16 ulp apart from the same row in a larger product in a few percent of rows on SmolLM2's
MLP) and random weights hardly show them, so this runs on the shipped model's own weights:
a continuation's logits scored one position per forward and in verify blocks of several
lengths must be the same bits, and the suffix cache's answers must be plain decoding's.
"""

from __future__ import annotations

import pytest
import torch

from agentspec.drafters.suffix.drafter import SuffixDrafter
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.types import SessionRef

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["bfloat16", "int8", "w8a8", "w8a16"])
def bf16_target(request: pytest.FixtureRequest) -> HFTarget:
    """The embedded model in bf16, then with int8 weight-only layers (bf16 activations),
    then with int8 weights and activations of one and of two int8 digits."""
    return HFTarget.load(TargetConfig(dtype=request.param, measure_costs=False,
                                      prefix_cache_bytes=0))


def _prompt(target: HFTarget) -> list[int]:
    text = ("You are a coding agent. Tools: read_file(path), write_file(path, text).\n"
            "The file config.json holds {\"name\": \"svc\", \"port\": 8080, \"debug\": false}."
            " Set debug to true, then write the whole file back and explain the change.")
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_bf16_target_is_shape_stable(bf16_target: HFTarget) -> None:
    assert bf16_target.shape_stable
    assert bf16_target.kv.stable is not None and bf16_target.kv.stable.min_rows >= 1


def test_verify_blocks_give_the_one_by_one_bits(bf16_target: HFTarget) -> None:
    t = bf16_target
    prompt = _prompt(t)
    cont = SpeculativeDecoder(t, None).generate(prompt, max_tokens=60).tokens
    seq = [*prompt, *cont]
    n0 = len(prompt) - 1
    t.prefill(seq[:n0])
    one = torch.cat([t.score([seq[i]]) for i in range(n0, len(seq))])  # [n, V]
    for k in (2, 5, 17):
        t.prefill(seq[:n0])
        blocks = torch.cat([t.score(seq[i : i + k]) for i in range(n0, len(seq), k)])
        assert torch.equal(blocks, one), k


def _agent_context(target: HFTarget, length: int = 1800) -> list[int]:
    """The first ``length`` tokens of the first packaged SWE-agent turn that long."""
    from workflows.replay.logs import PACKAGED_TRACES, load_sessions

    for sess in load_sessions([PACKAGED_TRACES], target.tokenizer):
        for turn in sess.turns:
            if len(turn.prompt) >= length:
                return turn.prompt[:length]
    raise AssertionError(f"no packaged turn has {length} prompt tokens")


def test_verifies_of_every_length_give_the_one_row_bits_at_an_agent_context(
        bf16_target: HFTarget) -> None:
    """At an agent's context (1,800 tokens of a real SWE-agent log, keys over four
    alignment blocks), a verify of any 2-33 rows gives each row the bits one-row steps
    give it. Before decode attention took its value product in fp32 blocks, some row
    counts (5-6 rows of Qwen's heads, 11-16 of SmolLM2's: 33-48 rows of one bf16 product)
    rounded rows otherwise, and a w8a8 agent turn's answer changed under speculation."""
    t = bf16_target
    prompt = _agent_context(t)
    cont = SpeculativeDecoder(t, None).generate(prompt, max_tokens=40).tokens
    seq, n0 = [*prompt, *cont], len(prompt)
    t.prefill(seq[:n0])
    one = torch.cat([t.score([seq[i]]) for i in range(n0, len(seq))])  # [40, V]
    t.rollback(len(seq) - n0)
    for k in range(2, 34):
        for at in (0, 7):  # the block's first row at two places
            if at + k > len(cont):
                continue
            if at:
                t.score(seq[n0 : n0 + at])  # the rows before it, one forward
            got = t.score(seq[n0 + at : n0 + at + k])  # [k, V]
            assert torch.equal(got, one[at : at + k]), (k, at)
            t.rollback(t.num_cached - n0)
    assert len(cont) >= 34  # most lengths were checked at both places


def test_suffix_cache_answers_are_plain_bf16_answers(bf16_target: HFTarget) -> None:
    t = bf16_target
    prompt = _prompt(t)
    plain = SpeculativeDecoder(t, None)
    spec = SpeculativeDecoder(t, SuffixDrafter(), config=EngineConfig(max_draft=16))
    ref = SessionRef("bf16", tenant="t")
    history = list(prompt)
    for turn in range(3):  # later turns draft from the session's earlier ones
        want = plain.generate(history, max_tokens=64).tokens
        got = spec.generate(history, max_tokens=64, session=ref)
        assert got.tokens == want, turn
        history += [*want, *_prompt(t)[-8:]]
