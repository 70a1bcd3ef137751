"""Shared fixtures: a tiny random-weight Llama (unit tests) and the embedded model
(integration tests), both loaded once per test session."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import pytest

# isort: split
# Before torch: `import agentspec` lets torch's idle OpenMP workers sleep (it reads
# OMP_WAIT_POLICY once, when it loads), as in the product; see agentspec/__init__.py.
import agentspec  # noqa: F401

# isort: split
import torch

# Converted model files and cost curves go to the repo's git-ignored cache unless set.
os.environ.setdefault(
    "AGENTSPEC_HOME", str(Path(__file__).resolve().parents[1] / ".cache" / "agentspec")
)

TINY_VOCAB = 96


def keep_process_threads(target: Any) -> Any:
    """``target`` with its live cost kept at the process's thread count. Float products'
    bits depend on the thread count, and a target's live cost picks a forward's count from
    its own timings (one thread when it measures one as cheaper): two targets compared bit
    for bit could run one forward with different counts on a busy machine."""
    target.live_cost.config = dataclasses.replace(target.live_cost.config, adapt_threads=False)
    return target


def run_interleaved(gens: Sequence[Generator[Any, None, Any]]) -> list[Any]:
    """Drive decode generators (``SpeculativeDecoder.steps``) one step of each live one in
    turn, as concurrent requests interleave; their return values, in order."""
    done: dict[int, Any] = {}
    while len(done) < len(gens):
        for i, gen in enumerate(gens):
            if i in done:
                continue
            try:
                next(gen)
            except StopIteration as stop:
                done[i] = stop.value
    return [done[i] for i in range(len(gens))]


class CharDecoder:
    """A stand-in tokenizer for the tiny model: token i is one character."""

    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;{}[]\"'\n"

    def __call__(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i % len(self.alphabet)] for i in ids)


def tiny_llama(layers: int = 2, max_positions: int = 512,
               init: float = 0.2) -> torch.nn.Module:
    """A random-weight Llama with a 96-token vocabulary (4 query heads over 2 key/value
    heads), fp32, seeded: the unit tests' model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, initializer_range=init,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_model() -> torch.nn.Module:
    """A 2-layer random-weight Llama with a 96-token vocabulary, fp32, seeded. A wide init
    makes the logits peaked, so argmax ties (where fp32 rounding could legitimately flip a
    token) are vanishingly rare."""
    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_target(tiny_model: torch.nn.Module):  # type: ignore[no-untyped-def]
    """The tiny model behind the Target protocol."""
    from agentspec.targets.hf import HFTarget

    return HFTarget(tiny_model, None, "tiny-llama", "float32", "cpu")


@pytest.fixture(scope="session")
def embedded_target():  # type: ignore[no-untyped-def]
    """The embedded SmolLM2-135M-Instruct, fp32 (converted once into AGENTSPEC_HOME): the
    reference precision, named (the default, ``auto``, is the machine's choice)."""
    from agentspec.targets.hf import HFTarget, TargetConfig

    return HFTarget.load(TargetConfig(dtype="float32"))


@pytest.fixture(scope="session")
def qwen_runtime():  # type: ignore[no-untyped-def]
    """The agent-grade shipped model (Qwen2.5-Coder-0.5B-Instruct, fp32), no session store.

    It is the process-wide runtime ``ChatAgentSpec(model=..., store=False)`` also uses, so
    the model is loaded once for every test that needs it (`make qwen` installs it).
    """
    from adapters.langchain.runtimes import shared_runtime
    from agentspec.models import AGENT_MODEL

    return shared_runtime(AGENT_MODEL, "float32", store=False)


@pytest.fixture(scope="session")
def char_decode() -> CharDecoder:
    """Decode function for the tiny model."""
    return CharDecoder()


@pytest.fixture(scope="module")
def one_thread():  # type: ignore[no-untyped-def]
    """Run a module's tests with one torch thread: on tiny matrices a second thread only
    adds synchronisation (10x slower on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def noisy_copy(model: torch.nn.Module, seed: int, scale: float = 0.05) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise on every weight: a close but imperfect
    drafter (right most of the time) for model-drafter tests."""
    import copy

    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in out.parameters():
            prm.add_(scale * torch.randn(prm.shape, generator=gen))
    return out
