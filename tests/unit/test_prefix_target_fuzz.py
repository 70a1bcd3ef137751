"""Prefix reuse under random budgets, evictions, restarts and disk faults, on the real target.

Seeded random sequences of requests (tenants, prompts that share system prompts and extend
earlier turns) go through a tiny random-weight model whose prefix store has random memory
and disk budgets (often smaller than one conversation). Between requests the disk copy is
damaged at random: a block file truncated, flipped or deleted, every write failing with a
full disk, the process "restarted" (a new store over the same folder). Whatever happens,
no request may raise, and every answer must be the tokens a cold prefill gives.
"""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest
import torch

from agentspec.targets.cache.kv_spill import KVSpill
from agentspec.targets.cache.prefix_cache import PrefixCache
from agentspec.targets.hf import HFTarget
from tests.conftest import TINY_VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")

ANSWER = 4  # greedy tokens per request: enough to use the reused KV past the prompt


def _greedy(target: HFTarget, prompt: list[int], scope: str | None) -> list[int]:
    logits = target.prefill(prompt, scope=scope)  # [V]
    out = [int(logits.argmax())]
    for _ in range(ANSWER - 1):
        out.append(int(target.score([out[-1]])[-1].argmax()))
    target.retire()
    return out


def _conversations(rng: random.Random, tenants: list[str]) -> dict[str, list[int]]:
    system = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(20, 60))]
    return {t: list(system) for t in tenants}  # every tenant starts from one system prompt


def _damage(rng: random.Random, folder: Path) -> str:
    files = sorted(folder.rglob("*.kv"))
    if not files:
        return "none"
    victim = rng.choice(files)
    kind = rng.choice(["truncate", "flip", "delete"])
    data = victim.read_bytes()
    if kind == "truncate":
        victim.write_bytes(data[: rng.randrange(len(data))])
    elif kind == "flip":
        i = rng.randrange(len(data))
        victim.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])
    else:
        victim.unlink()
    return kind


@pytest.mark.parametrize("seed", range(6))
def test_random_reuse_sequences_never_fail_and_match_a_cold_prefill(
    tiny_model: torch.nn.Module, tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    cold = HFTarget(tiny_model, None, "tiny-llama", "float32", "cpu")
    block = rng.choice([4, 8, 16])
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x fp32 bytes
    folder = tmp_path / "spill"

    def process() -> HFTarget:  # a fresh process over the same spill folder
        memory = rng.choice([0, block * per_token, 6 * block * per_token, 10**7])
        spill = KVSpill(folder, rng.choice([1, 3 * block * per_token + 4096, 10**7]))
        store = PrefixCache(memory, block_size=block, spill=spill)
        return HFTarget(tiny_model, None, "tiny-llama", "float32", "cpu", store)

    tenants = ["a", "b", "c"][: rng.randrange(1, 4)]
    convs = _conversations(rng, tenants)
    target = process()
    real_replace = os.replace
    for step in range(14):
        event = rng.random()
        if event < 0.15:
            target = process()
        elif event < 0.35:
            _damage(rng, folder)
        full = rng.random() < 0.2
        if full:  # every write of this request meets a full disk

            def no_space(src: object, dst: object) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(os, "replace", no_space)
        tenant = rng.choice(tenants)
        conv = convs[tenant]
        if len(conv) > 380:  # within the tiny model's 512 positions: a new conversation
            conv = convs[tenant] = conv[: rng.randrange(20, 60)]
        elif rng.random() < 0.2:  # an edited earlier message: the conversation forks
            cut = rng.randrange(1, len(conv))
            conv = convs[tenant] = conv[:cut]
        conv.extend(rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(3, 30)))
        got = _greedy(target, conv, tenant)
        monkeypatch.setattr(os, "replace", real_replace)
        want = _greedy(cold, conv, None)
        assert got == want, (seed, step, tenant)
        conv.extend(got)  # the next turn resends the answer
        store = target.prefix_cache
        assert store is not None and store.bytes_used <= store.budget_bytes
