"""The 1.5B shipped model by name: Qwen2.5-Coder-1.5B-Instruct loads in the default
precision (``dtype="auto"``: w8a16 from its int8 snapshot on an AVX-512 CPU) and answers a
short chat prompt; ``agentspec models`` lists it.

The first run on a machine converts the model and writes its snapshot (about two minutes on
2 cores, ~10 GB of memory at the peak while the GGUF is dequantised); later runs load in
seconds. `make qwen15` installs the 22 chunks.
"""

from __future__ import annotations

import pytest

from agentspec.cli.console import main
from agentspec.drafters.hybrid import HybridDrafter
from agentspec.drafters.model.target_drafter import TargetDrafter
from agentspec.models import AGENT_MODEL, LOOP_MODEL, SHIPPED_MODELS
from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.targets.kernels.precision import auto_dtype
from agentspec.types import SessionRef

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not SHIPPED_MODELS[LOOP_MODEL].installed,
                       reason=f"the chunks of {LOOP_MODEL} are not installed (`make qwen15`)"),
]


@pytest.fixture(scope="module")
def target() -> HFTarget:
    return HFTarget.load(TargetConfig(model="qwen2.5-coder-1.5b-instruct", dtype="auto",
                                      device="cpu", measure_costs=False))


def _greedy(target: HFTarget, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding: one token per forward, stopping at the end of the turn."""
    eos = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    logits, out = target.prefill(ids), []
    for _ in range(n):
        token = int(logits.argmax())
        if token == eos:
            break
        out.append(token)
        logits = target.score([token])[-1]
    return out


def test_it_loads_by_name_in_the_default_precision_and_answers(target: HFTarget) -> None:
    assert target.name == LOOP_MODEL and target.dtype == auto_dtype(cpu=True)
    assert target.vocab_size == 151_936 and target.model.config.num_hidden_layers == 28
    tok = target.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        tokenize=False, add_generation_prompt=True)
    answer = tok.decode(_greedy(target, tok(text, add_special_tokens=False).input_ids, 8))
    assert "paris" in answer.lower(), answer


def test_agentspec_models_lists_it(target: HFTarget,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert f"{LOOP_MODEL}: converted" in out  # by the target's load, if not before
    assert "as in llama.cpp), slower; licence Apache-2.0" in out


@pytest.mark.skipif(not SHIPPED_MODELS[AGENT_MODEL].installed,
                    reason=f"{AGENT_MODEL}, the 1.5B's draft model, is not installed (`make qwen`)")
def test_hybrid_drafts_with_the_05b_and_says_what_plain_decoding_says(target: HFTarget) -> None:
    """``hybrid`` on the 1.5B takes the 0.5B as its model drafter (in the 1.5B's precision,
    a target of its own) and answers token for token as plain decoding; the draft model's
    steps commit several tokens each. Each method runs under its own tenant, so neither
    reuses the other's prompt KV (reuse feeds a prompt in other forwards than a cold
    prefill, which may round differently)."""
    runtime = Runtime(target, store=None)
    plain = AgentSpec(drafting=DraftingPolicy(method="none"))
    hybrid = AgentSpec(drafting=DraftingPolicy(method="hybrid"))
    drafter = runtime.drafter_for(hybrid)
    assert isinstance(drafter, HybridDrafter) and isinstance(drafter.model, TargetDrafter)
    assert drafter.model.name == f"model:{AGENT_MODEL}"
    assert drafter.model.draft.dtype == target.dtype  # the target's precision
    ask = [{"role": "user", "content": "Write a Python function that returns the n-th "
                                       "Fibonacci number, iteratively."}]
    ref = runtime.chat(ask, spec=plain, max_tokens=48, session=SessionRef("p", tenant="plain"))
    got = runtime.chat(ask, spec=hybrid, max_tokens=48, session=SessionRef("h", tenant="hvd"))
    assert got.text == ref.text
    model_steps = [s for s in got.stats.steps if s.source == drafter.model.name]
    assert model_steps, "the draft model never drafted"
    accepted = sum(s.accepted for s in model_steps) / len(model_steps)
    assert accepted >= 1.0, accepted  # the 0.5B agrees with the 1.5B most of the time
