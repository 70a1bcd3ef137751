"""The transformers target: scoring, exact rollback, cost curve, bad calls."""

from __future__ import annotations

import pytest
import torch

from agentspec.errors import AgentSpecError, ConfigError, PromptTooLongError
from agentspec.targets.hf import HFTarget, TargetConfig


def _fresh_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def test_score_matches_full_forward(tiny_model, tiny_target: HFTarget) -> None:  # type: ignore[no-untyped-def]
    a, b = list(range(2, 22)), [30, 31, 32, 33, 34]
    tiny_target.prefill(a)
    got = tiny_target.score(b)  # [5, V]
    want = _fresh_logits(tiny_model, a + b)[len(a):]
    assert got.shape == (5, tiny_target.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert tiny_target.num_cached == len(a) + len(b)


def test_rollback_is_exact(tiny_model, tiny_target: HFTarget,  # type: ignore[no-untyped-def]
                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Both paths run their forwards with the same thread count: on a loaded machine the
    # live cost may pick one thread for one path and two for the other, and fp32 products
    # over a few rows are not thread-invariant (what this test compares is the rollback).
    from agentspec.targets.cost.live_cost import LiveCost

    monkeypatch.setattr(LiveCost, "threads_for", lambda self, k, context: self.threads)
    a, rejected, c = [5, 6, 7, 8, 9, 10], [40, 41, 42, 43], [50, 51, 52]
    # Path 1: feed a, score a rejected draft, roll it back, score c.
    tiny_target.prefill(a)
    tiny_target.score(rejected)
    tiny_target.rollback(len(rejected))
    assert tiny_target.num_cached == len(a)
    after_rollback = tiny_target.score(c)
    # Path 2: the same shapes without the rejected draft: bit-identical.
    tiny_target.prefill(a)
    clean = tiny_target.score(c)
    assert torch.equal(after_rollback, clean)
    # And equal to a fresh full forward up to fp32 rounding.
    torch.testing.assert_close(after_rollback, _fresh_logits(tiny_model, a + c)[len(a):],
                               atol=1e-5, rtol=1e-5)


def test_partial_rollback_keeps_accepted_prefix(tiny_target: HFTarget) -> None:
    tiny_target.prefill([3, 4, 5])
    tiny_target.score([6, 7, 8, 9])
    tiny_target.rollback(2)  # keep 6, 7
    after = tiny_target.score([60])
    tiny_target.prefill([3, 4, 5])
    tiny_target.score([6, 7])
    # K/V of 6, 7 were computed in a 4-token batch vs a 2-token one: equal up to rounding.
    torch.testing.assert_close(after, tiny_target.score([60]), atol=1e-5, rtol=1e-5)


def test_bad_calls_raise_clear_errors(tiny_target: HFTarget) -> None:
    tiny_target.prefill([3, 4])
    with pytest.raises(ConfigError, match="rollback"):
        tiny_target.rollback(5)
    with pytest.raises(ConfigError, match="at least one token"):
        tiny_target.score([])
    with pytest.raises(PromptTooLongError, match="context window"):
        tiny_target.prefill(list(range(2, 90)) * 10)
    with pytest.raises(ConfigError, match="dtype"):
        TargetConfig(dtype="float16")
    with pytest.raises(AgentSpecError):
        tiny_target.verify_cost(0)


def test_cost_curve_measured_and_cached(tiny_target: HFTarget) -> None:
    costs = tiny_target.measure_costs(context=64, repeats=3)
    assert set(costs) >= {1, 4, 8, 16, 32}
    assert all(c > 0 for c in costs.values())
    saved = tiny_target.curves.base
    tiny_target.curves.base = costs  # use the measured curve for interpolation
    assert tiny_target.verify_cost(5) == pytest.approx((costs[4] + costs[6]) / 2)
    assert tiny_target.verify_cost(40) >= costs[32] > 0
    # A noisy curve whose last point falls still extrapolates to a positive, flat cost.
    tiny_target.curves.base = {**costs, 24: 2.0, 32: 1.0}
    assert tiny_target.verify_cost(1000) == 1.0
    tiny_target.curves.base = saved
