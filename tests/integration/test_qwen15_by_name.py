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
from agentspec.models import LOOP_MODEL, SHIPPED_MODELS
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.targets.kernels.precision import auto_dtype

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
    assert "not yet verified there), slower; licence Apache-2.0" in out
