"""The in-place KV cache and the grouped-query attention give bit-identical logits to
transformers' own DynamicCache + SDPA path, through every way the target feeds and cuts
its cache."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch

from agentspec.targets.cache.kv_cache import GrowingLayer, StepPlan, new_cache, reusable_layers
from agentspec.targets.cache.prefix_cache import PrefixCache
from agentspec.targets.forward import attention
from agentspec.targets.hf import HFTarget
from tests.conftest import TINY_VOCAB, keep_process_threads


def _stock_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attention_mask: torch.Tensor | None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with repeat_kv, except one-row forwards, which take
    agentspec's thread-invariant products in both targets (SDPA splits a single query's
    keys by thread: that path is not what this test compares)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] == 1:
        return attention.stable_attention(query, key, value, attention_mask,
                                          kwargs.get("scaling")), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


class _StockTarget(HFTarget):
    """The target as it was: transformers' DynamicCache (torch.cat per append) and its
    SDPA attention with repeat_kv for multi-row forwards. (Both targets keep the small-rows
    linear forward of ``agentspec.targets.kernels.linear`` and the one-row attention of
    ``agentspec.targets.forward.attention``: this test is about the cache and the grouped-query
    attention; those have their own tests.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register("stock_sdpa", _stock_sdpa)
        ALL_MASK_ATTENTION_FUNCTIONS.register("stock_sdpa", sdpa_mask)
        self.model.set_attn_implementation("stock_sdpa")
        self.kv.cache_factory = self._stock_cache

    def _stock_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)


@pytest.fixture(scope="module")
def pair(tiny_model: torch.nn.Module) -> tuple[HFTarget, HFTarget]:
    fast = HFTarget(copy.deepcopy(tiny_model), None, "tiny", "float32", "cpu",
                    PrefixCache(1 << 24))
    stock = _StockTarget(copy.deepcopy(tiny_model), None, "tiny", "float32", "cpu",
                         PrefixCache(1 << 24))
    # This test is about the cache and the attention, not the thread choice.
    return keep_process_threads(fast), keep_process_threads(stock)


def test_install_switches_gqa_models_only(tiny_model: torch.nn.Module) -> None:
    model = copy.deepcopy(tiny_model)
    model.set_attn_implementation("sdpa")
    assert attention.install_gqa_attention(model)
    assert model.config._attn_implementation == attention.ATTENTION_NAME
    from transformers import LlamaConfig, LlamaForCausalLM

    mha = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=2))
    assert not attention.install_gqa_attention(mha)  # no grouped heads: nothing to gain
    eager = copy.deepcopy(tiny_model)
    eager.set_attn_implementation("eager")
    assert not attention.install_gqa_attention(eager)


def _random_tree(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def _path(parents: list[int], leaf: int) -> list[int]:
    out = []
    while leaf > 0:
        out.append(leaf)
        leaf = parents[leaf]
    return out[::-1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_cache_operation_gives_the_stock_logits(pair: tuple[HFTarget, HFTarget],
                                                       seed: int) -> None:
    """Random sessions of prefill (with prefix reuse), score, rollback, trees and batch
    rows: the fast target's logits equal the stock target's bit for bit."""
    fast, stock = pair
    rng = random.Random(seed)
    history: list[int] = []
    for _turn in range(3):
        # The next prompt: the previous one (or a changed copy of it) plus new tokens.
        if history and rng.random() < 0.3:
            history[rng.randrange(len(history))] = rng.randrange(TINY_VOCAB)
        history += [rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(20, 120))]
        a, b = fast.prefill(history, scope="t"), stock.prefill(history, scope="t")
        assert fast.reused_tokens == stock.reused_tokens
        assert torch.equal(a, b)
        for _step in range(12):
            op = rng.choice(["score", "score", "rollback", "tree", "batch"])
            if op == "score":
                toks = [rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(1, 12))]
                assert torch.equal(fast.score(toks), stock.score(toks))
            elif op == "rollback":
                n = rng.randrange(0, min(8, fast.num_cached))
                fast.rollback(n)
                stock.rollback(n)
            elif op == "tree":
                n = rng.randrange(2, 10)
                toks = [rng.randrange(TINY_VOCAB) for _ in range(n)]
                parents = _random_tree(rng, n)
                assert torch.equal(fast.score_tree(toks, parents),
                                   stock.score_tree(toks, parents))
                path = _path(parents, rng.randrange(n))
                fast.keep_tree_path(path)
                stock.keep_tree_path(path)
            else:
                rows = [[rng.randrange(TINY_VOCAB) for _ in range(4)] for _ in range(3)]
                assert torch.equal(fast.score_batch(rows), stock.score_batch(rows))
                keep = rng.randrange(3)
                fast.select_row(keep)
                stock.select_row(keep)
            assert fast.num_cached == stock.num_cached
        history = list(history) + [rng.randrange(TINY_VOCAB) for _ in range(5)]


def test_growing_layer_appends_in_place_and_overwrites_after_a_crop() -> None:
    torch.manual_seed(0)
    layer = GrowingLayer(max_positions=1000)
    k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    keys, values = layer.update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v)
    assert layer.capacity == 256 and layer.get_seq_length() == 5
    buffer = layer.keys.data_ptr()
    layer.crop(-2)
    assert layer.get_seq_length() == 3 and torch.equal(layer.keys, k[..., :3, :])
    k2, v2 = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)
    keys, _ = layer.update(k2, v2)
    assert keys.data_ptr() == buffer  # no copy: the same buffer
    assert torch.equal(keys, torch.cat([k[..., :3, :], k2], dim=-2))
    # Growing past the capacity keeps every position; never past max_positions unless needed.
    big = torch.randn(1, 2, 300, 4)
    keys, _ = layer.update(big, big)
    assert layer.get_seq_length() == 307 and layer.capacity == 384
    assert torch.equal(keys[..., 7:, :], big)
    with pytest.raises(ValueError, match="negative"):
        layer.crop(3)


def test_growing_layer_capacity_stops_at_the_context_window() -> None:
    layer = GrowingLayer(max_positions=300)
    x = torch.zeros(1, 1, 200, 2)
    layer.update(x, x)
    assert layer.capacity == 256
    y = torch.zeros(1, 1, 60, 2)
    layer.update(y, y)
    assert layer.capacity == 300  # not 384: the model never holds more
    layer.update(y, y)  # past the window: still appended (the target refuses first)
    assert layer.get_seq_length() == 320 and layer.capacity == 320


def test_aligned_growth_keeps_whole_buffers_contiguous() -> None:
    """Under an alignment a buffer grows to exactly the need rounded up to it, so a forward
    attending the aligned length reads one contiguous block (what keeps PyTorch's bf16
    batched product from copying the keys first); crops keep the buffer."""
    plan = StepPlan()
    plan.align = 64
    layer = GrowingLayer(max_positions=1000, plan=plan)
    x = torch.randn(1, 2, 50, 4)
    layer.update(x, x)
    assert layer.capacity == 64
    plan.attend = 64
    keys, values = layer.update(x[..., :10, :], x[..., :10, :])  # needs 60, attends 64
    assert layer.capacity == 64 and keys.is_contiguous() and values.is_contiguous()
    plan.attend = 128
    keys, _ = layer.update(x[..., :10, :], x[..., :10, :])  # crosses 64: grows to 128
    assert layer.capacity == 128 and keys.shape[-2] == 128 and keys.is_contiguous()
    assert torch.equal(keys[..., :50, :], x) and not keys[..., 70:, :].any()
    layer.crop(-20)
    plan.clear()
    assert plan.align == 64  # the alignment outlives a forward's plan
    layer.update(x, x)  # 100 positions: within the buffer
    assert layer.capacity == 128 and layer.get_seq_length() == 100


def test_new_cache_keeps_sliding_layers_and_says_what_is_reusable() -> None:
    from transformers import MistralConfig

    full = new_cache(MistralConfig(num_hidden_layers=2, sliding_window=None))
    assert all(isinstance(layer, GrowingLayer) for layer in full.layers)
    assert reusable_layers(full)
    sliding = new_cache(MistralConfig(num_hidden_layers=2, sliding_window=64))
    assert not any(isinstance(layer, GrowingLayer) for layer in sliding.layers)
    assert not reusable_layers(sliding)
