"""The live cost tracker (agentspec.targets.cost.live_cost): estimates follow the timed forwards,
decay back to the prior, explore the other thread count, and the target and the runtime
use it (a gate that lives across requests, one-row forwards at the process's threads)."""

from __future__ import annotations

import copy

import pytest
import torch

from agentspec.errors import ConfigError
from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.targets.cost.live_cost import (
    LiveCost,
    LiveCostConfig,
    context_bucket,
    row_bucket,
    safe_prior,
)
from agentspec.targets.hf import HFTarget
from agentspec.types import SessionRef
from tests.conftest import keep_process_threads, tiny_llama


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def linear_prior(k: int, context: int) -> float:
    return 0.1 * (1 + 0.1 * (k - 1))


def test_buckets() -> None:
    assert [row_bucket(k) for k in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33)] == [
        0, 1, 2, 2, 3, 3, 4, 4, 5, 6]
    assert [context_bucket(c) for c in (0, 1023, 1024, 2047, 2048, 4096)] == [0, 0, 1, 1, 2, 3]


def test_safe_prior_allows_short_drafts_only() -> None:
    assert safe_prior(4, 0) / safe_prior(1, 0) < 1.5
    assert safe_prior(16, 0) / safe_prior(1, 0) > 5
    assert safe_prior(1, 8000) > safe_prior(1, 0)


def test_estimates_follow_observations_and_decay_back_to_the_prior() -> None:
    clock = Clock()
    live = LiveCost(linear_prior, threads=2, clock=clock,
                    config=LiveCostConfig(half_life=10.0, adapt_threads=False))
    assert live.cost(8, 3000) == pytest.approx(linear_prior(8, 3000))
    for _ in range(50):  # the machine got busy: 8-row forwards take 3x the prior
        live.observe(8, 3000, 2, 3 * linear_prior(8, 3000))
    assert live.cost(8, 3000) == pytest.approx(3 * linear_prior(8, 3000), rel=0.05)
    # A row bucket never observed starts from the next shorter observed one, whose
    # slowdown it shares; a context never timed shares the machine-wide slowdown.
    assert live.cost(16, 3000) == pytest.approx(3 * linear_prior(16, 3000), rel=0.05)
    assert live.cost(8, 9000) == pytest.approx(3 * linear_prior(8, 9000), rel=0.05)
    clock.now += 200  # 20 half-lives later the evidence is gone
    assert live.cost(8, 3000) == pytest.approx(linear_prior(8, 3000), rel=0.01)


def test_one_thread_is_explored_and_kept_when_it_is_cheaper() -> None:
    clock = Clock()
    live = LiveCost(linear_prior, threads=2, clock=clock,
                    config=LiveCostConfig(explore_after=30.0))
    live.observe(1, 500, 2, linear_prior(1, 500))
    assert live.threads_for(1, 500) == 1  # one-row steps explore one thread too
    live.observe(1, 500, 1, 1.5 * linear_prior(1, 500))
    assert live.threads_for(1, 500) == 2  # ... and keep T threads where they are faster
    # No evidence for one thread yet: tried once.
    assert live.threads_for(8, 500) == 1
    live.observe(8, 500, 1, 0.5 * linear_prior(8, 500))
    live.observe(8, 500, 2, 2.0 * linear_prior(8, 500))
    assert live.threads_for(8, 500) == 1  # cheaper
    assert live.cost(8, 500) == pytest.approx(live.estimate(8, 500, 1))
    clock.now += 10
    assert live.threads_for(8, 500) == 1
    clock.now += 40  # the two-thread evidence aged out: tried again
    assert live.threads_for(8, 500) == 2
    live.observe(8, 500, 2, 0.2 * linear_prior(8, 500))  # the load went away
    for _ in range(5):
        live.observe(8, 500, 2, 0.2 * linear_prior(8, 500))
    assert live.threads_for(8, 500) == 1  # one thread's evidence is stale now: re-tried
    live.observe(8, 500, 1, 0.5 * linear_prior(8, 500))
    assert live.threads_for(8, 500) == 2
    single = LiveCost(linear_prior, threads=1)
    assert single.threads_for(8, 500) == 1


def test_config_and_copies() -> None:
    with pytest.raises(ConfigError, match="half_life"):
        LiveCostConfig(half_life=0)
    with pytest.raises(ConfigError, match="threads"):
        LiveCost(threads=0)
    live = LiveCost(linear_prior, threads=2, measured=True)
    live.observe(4, 100, 2, 1.0)
    twin = copy.deepcopy(live)
    assert twin.measured and twin.observed == 0 and live.observed == 1
    live.set_prior(safe_prior, measured=False)
    assert live.to_dict()["cell_weights"] == {} and not live.measured


def test_the_target_times_its_verify_forwards(tiny_target: HFTarget) -> None:
    live = tiny_target.live_cost
    before = live.observed
    threads = torch.get_num_threads()
    tiny_target.prefill(list(range(2, 40)))
    tiny_target.score([5])
    tiny_target.score([6, 7, 8, 9])
    tiny_target.rollback(3)
    assert live.observed == before + 2
    assert torch.get_num_threads() == threads  # restored after a one-thread forward
    assert tiny_target.context_cost(4, 38) > 0


def test_the_runtime_keeps_one_gate_per_policy(tiny_target: HFTarget) -> None:
    rt = Runtime(tiny_target, store=None)
    spec = AgentSpec()
    gate = rt.gate_for(spec)
    assert gate is not None and rt.gate_for(AgentSpec()) is gate
    assert rt.engine_for(spec).gate is gate
    assert rt.gate_for(AgentSpec(drafting=DraftingPolicy(method="none"))) is None
    # Calibration learned in one request is there for the next one.
    ref = SessionRef("s1", tenant="t1")
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]
    for _ in range(2):  # the tiny model has no chat template: the runtime's engine
        engine = rt.engine_for(spec)
        engine.decode = None  # (no tokenizer either: token ids only)
        engine.generate(prompt, max_tokens=24, session=ref)
    assert "t1" in gate._tenants
    assert rt.engine_for(spec).gate is gate


def test_one_thread_verify_forwards_stay_lossless(tiny_model: torch.nn.Module) -> None:
    from agentspec.drafters import SuffixConfig, SuffixDrafter
    from agentspec.engine import SpeculativeDecoder

    threads = torch.get_num_threads()
    target = HFTarget(copy.deepcopy(tiny_model), None, "tiny-llama", "float32", "cpu")
    live = LiveCost(linear_prior, threads=threads)
    target.meter.live = live
    # Two-thread forwards look slow everywhere: every forward, one-row steps included, runs
    # with one thread (when the process has more).
    for k in (1, 2, 4, 8, 16, 32, 64):
        for _ in range(20):
            live.observe(k, 10, live.threads, 50 * linear_prior(k, 10))
    assert live.threads_for(8, 10) == 1  # (trivially so in a one-thread process)
    assert live.threads_for(1, 10) == 1
    plain = SpeculativeDecoder(target, None, eos_token_ids=[1])
    spec = SpeculativeDecoder(target, SuffixDrafter(SuffixConfig()), eos_token_ids=[1])
    torch.manual_seed(0)
    base = torch.randint(2, 90, (12,)).tolist()
    for i in range(4):
        prompt = base * 3 + [i + 2]
        want = plain.generate(prompt, 40).tokens
        got = spec.generate(prompt, 40, session=SessionRef("lossless"))
        assert got.tokens == want
        assert any(s.draft_len > 0 for s in got.stats.steps)
    assert torch.get_num_threads() == threads


def test_a_frozen_tracker_prices_by_the_prior_only() -> None:
    live = LiveCost(linear_prior, threads=2, config=LiveCostConfig(learn=False))
    live.observe(8, 500, 2, 100.0)
    assert live.observed == 0 and live.cost(8, 500) == linear_prior(8, 500)
    assert live.threads_for(8, 500) == 2


def test_one_row_forwards_give_the_same_bits_with_any_thread_count(
        tiny_model: torch.nn.Module) -> None:
    """Plain decoding is the reference of every lossless guarantee, and a loaded machine
    runs its one-row steps with one thread: the logits must not change by a bit."""
    threads = torch.get_num_threads()
    target = HFTarget(copy.deepcopy(tiny_model), None, "tiny-llama", "float32", "cpu")
    gen = torch.Generator().manual_seed(3)
    target.prefill(torch.randint(2, 90, (150,), generator=gen).tolist())
    try:
        for tok in torch.randint(2, 90, (6,), generator=gen).tolist():
            got = []
            for t in (threads, 1, max(2, threads)):
                torch.set_num_threads(t)
                got.append(target.score([tok]).clone())  # [1, vocab]
                target.rollback(1)
            assert all(torch.equal(got[0], g) for g in got[1:])
            target.score([tok])
    finally:
        torch.set_num_threads(threads)


def test_prefill_follows_the_pooled_verify_evidence() -> None:
    """A prefill takes one thread only when the cells with fresh evidence for both counts,
    wider row buckets weighing more, say one thread is clearly cheaper now."""
    clock = Clock()
    live = LiveCost(linear_prior, threads=2, clock=clock,
                    config=LiveCostConfig(explore_after=30.0))
    assert live.prefill_threads() == 2  # no evidence: the process's count
    live.observe(1, 500, 1, 0.5 * linear_prior(1, 500))  # one-row: one thread cheaper ...
    assert live.prefill_threads() == 2  # ... but nothing for two threads there yet
    live.observe(1, 500, 2, 1.0 * linear_prior(1, 500))
    assert live.prefill_threads() == 1
    tie = LiveCost(linear_prior, threads=2, clock=clock)
    for t, f in ((1, 0.95), (2, 1.0)):  # a near tie (one row, quiet): the process's count
        tie.observe(1, 500, t, f * linear_prior(1, 500))
    assert tie.prefill_threads() == 2
    live.observe(8, 500, 1, 2.0 * linear_prior(8, 500))  # wider: two threads cheaper
    live.observe(8, 500, 2, 1.0 * linear_prior(8, 500))
    assert live.prefill_threads() == 2  # the wider bucket outweighs one row
    clock.now += 31  # all of it aged out
    assert live.prefill_threads() == 2
    busy = LiveCost(linear_prior, threads=2, clock=clock)
    for _ in range(6):  # beside a busy process, as the verifies keep showing
        for t, f in ((1, 1.0), (2, 3.0)):
            busy.observe(16, 900, t, f * linear_prior(16, 900))
    assert busy.prefill_threads() == 1
    assert LiveCost(linear_prior, threads=1).prefill_threads() == 1
    frozen = LiveCost(linear_prior, threads=2, config=LiveCostConfig(adapt_threads=False))
    assert frozen.prefill_threads() == 2


@pytest.mark.parametrize("limit", [None, 0, 50])
def test_a_prefill_runs_with_the_threads_the_load_calls_for(
        tiny_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch,
        limit: int | None) -> None:
    """A prompt forward of fewer rows than the probe allowed (``None``: any) runs with the
    count the live tracker picks; a longer one, or any where the probe failed (0), with the
    process's; the count is restored after it."""
    threads = torch.get_num_threads()
    if threads == 1:
        pytest.skip("one thread: nothing to choose (CI machines have 2)")
    target = HFTarget(copy.deepcopy(tiny_model), None, "tiny-llama", "float32", "cpu",
                      prefill_rows=limit)
    monkeypatch.setattr(target.live_cost, "prefill_threads", lambda: 1)
    seen: list[int] = []
    target.model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    target.prefill(list(range(2, 60)))  # 58 rows
    target.prefill(list(range(3, 33)))  # 30 rows
    assert seen == {None: [1, 1], 0: [threads, threads], 50: [threads, 1]}[limit]
    assert torch.get_num_threads() == threads
    target.score([5])
    assert torch.get_num_threads() == threads


def test_the_prompt_probe_sees_thread_dependent_bits(tiny_model: torch.nn.Module) -> None:
    """The probe passes on the tiny model in int8, fails where prompt forwards change with
    the thread count (else it could not fail), and where only forwards from the precision's
    switch on change, allows those below it."""
    from agentspec.targets.kernels.int8 import quantize_linears
    from agentspec.targets.probes.prompt import prompt_thread_rows

    if torch.get_num_threads() == 1:
        pytest.skip("one thread: nothing to compare (CI machines have 2)")
    model = copy.deepcopy(tiny_model)
    quantize_linears(model)
    target = HFTarget(model.to(torch.bfloat16), None, "tiny-llama", "int8", "cpu")
    assert prompt_thread_rows(target.kv) is None
    assert prompt_thread_rows(target.kv, switch=100) is None
    assert target.num_cached == 0  # the probe leaves the cache empty
    norm = target.model.model.norm
    # Forwards of 100 rows or more change with the thread count (a kernel switch there).
    hook = norm.register_forward_hook(
        lambda _m, _i, out: out * (1 + 1e-3 * torch.get_num_threads())
        if out.shape[1] >= 100 else out)
    assert prompt_thread_rows(target.kv) is None  # the lengths probed stay below it
    assert prompt_thread_rows(target.kv, switch=100) == 100
    # A switch beyond the model's window is never reached.
    assert prompt_thread_rows(target.kv, switch=target.kv.max_positions + 1) is None
    hook.remove()
    norm.register_forward_hook(lambda _m, _i, out: out * (1 + 1e-3 * torch.get_num_threads()))
    assert prompt_thread_rows(target.kv, switch=100) == 0


def test_a_stale_prior_is_corrected_for_row_counts_never_timed() -> None:
    """A prior measured under load overprices every forward; a policy that then only runs
    2-row verifies with one thread must still see longer verifies get cheaper (the pooled
    evidence), or it never tries them."""
    clock = Clock()
    live = LiveCost(linear_prior, threads=2, clock=clock)
    for _ in range(20):  # 2-row forwards, one thread, at 0.4x the prior
        live.observe(2, 500, 1, 0.4 * linear_prior(2, 500))
    for k in (1, 4, 8):
        assert live.cost(k, 500) == pytest.approx(0.4 * linear_prior(k, 500), rel=0.1)
    # Evidence of one-row steps with T threads, where there is some, still rules them.
    for _ in range(10):
        live.observe(1, 500, 2, 2.0 * linear_prior(1, 500))
    assert live.estimate(1, 500, 2) > 1.5 * linear_prior(1, 500)


@pytest.mark.parametrize(("two_threads_s", "want"), [(0.024, 2), (0.060, 1)])
def test_under_the_safe_prior_one_timing_of_each_count_decides(two_threads_s: float,
                                                                want: int) -> None:
    """A target without a measured curve (a draft model) prices by the safe prior, in
    units, not seconds: a one-row step's count is decided by the two counts' own timings,
    not by a machine-wide ratio pulled toward the prior's scale (which priced the count
    timed once at ~4x its evidence and kept one-row steps on the slower count)."""
    clock = Clock()
    live = LiveCost(safe_prior, threads=2, clock=clock)
    for _ in range(10):  # one thread, timed many times
        clock.now += 0.05
        live.observe(1, 100, 1, 0.031)
    live.observe(1, 100, 2, two_threads_s)  # two threads, timed once
    assert live.threads_for(1, 100) == want


def test_int8_kernel_trials_are_not_timed_as_the_machines_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The live cost skips a forward that was one of the int8 kernel's trials (half run
    the slower kernel: they say what a kernel costs, not what the load does) and times
    every forward after them."""
    from agentspec.targets.kernels import int8_mm
    from agentspec.targets.kernels.int8 import quantize_linears

    model = tiny_llama(layers=2, max_positions=256)
    quantize_linears(model, activations=2)
    target = keep_process_threads(HFTarget(model.to(torch.bfloat16), None, "tiny", "w8a16",
                                           "cpu", None, None))
    monkeypatch.setattr(int8_mm, "_trials", {})
    target.prefill(list(range(2, 30)))
    before = target.live_cost.observed
    steps = 2 * int8_mm.TRIALS + 2
    for i in range(steps):
        target.score([5 + i])
    trials = 2 * int8_mm.TRIALS if int8_mm.int_mm_exact() and int8_mm.path() else 0
    assert target.live_cost.observed - before == steps - trials
    assert "timing" not in int8_mm.choices().values()
