"""Prefix KV reuse: the block store (budget, LRU, tenants) and HFTarget's reuse, checked
against the same requests fed from scratch (exact tokens, fp32, the tiny model)."""

from __future__ import annotations

import random

import pytest
import torch

from agentspec.drafters import PromptLookupDrafter, SuffixConfig, SuffixDrafter
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError
from agentspec.interfaces import PrefixReuseTarget
from agentspec.targets.cache.prefix_cache import PrefixCache
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.types import SessionRef

pytestmark = pytest.mark.usefixtures("one_thread")


def _kv(n: int, layers: int = 2, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 2, n, 4, generator=gen), torch.randn(1, 2, n, 4, generator=gen))
            for _ in range(layers)]


def _block_bytes(block: int, layers: int = 2) -> int:
    return layers * 2 * (2 * block * 4) * 4  # layers x (k, v) x heads*block*dims x fp32


def test_store_returns_the_longest_block_prefix_and_exact_tensors() -> None:
    cache = PrefixCache(budget_bytes=10**7, block_size=4)
    tokens = list(range(10, 30))  # 20 tokens: 5 blocks
    kv = _kv(20)
    assert cache.insert("t1", tokens, kv) == 5
    assert cache.insert("t1", tokens, kv) == 0  # already stored: only touched
    # A prompt sharing 13 tokens reuses 3 whole blocks (12 tokens).
    n, got = cache.lookup("t1", [*tokens[:13], 99, 98], limit=100)
    assert n == 12
    assert torch.equal(got[1][0], kv[1][0][..., :12, :])
    assert torch.equal(got[0][1], kv[0][1][..., :12, :])
    # The limit cuts inside a block.
    n, got = cache.lookup("t1", tokens, limit=7)
    assert n == 7 and got[0][0].shape[-2] == 7
    # A change in the first block: nothing reused, even though later blocks are equal.
    assert cache.match("t1", [0, *tokens[1:]]) == 0
    assert cache.stats.hit_tokens == 19 and cache.stats.lookups == 2


def test_store_never_shares_across_tenants() -> None:
    cache = PrefixCache(budget_bytes=10**7, block_size=4)
    tokens = list(range(40))
    cache.insert("tenant-a", tokens, _kv(40))
    assert cache.match("tenant-a", tokens) == 40
    assert cache.match("tenant-b", tokens) == 0
    assert cache.lookup("tenant-b", tokens, limit=40) == (0, [])


def test_budget_is_never_exceeded_and_lru_evicts_tails_first() -> None:
    block = 4
    budget = 6 * _block_bytes(block)
    cache = PrefixCache(budget_bytes=budget, block_size=block)
    rng = random.Random(0)
    shared = list(range(8))  # 2 blocks every conversation starts with
    for conv in range(12):
        tokens = shared + [rng.randrange(100, 200) for _ in range(12)]
        cache.insert("t", tokens, _kv(20, seed=conv))
        assert cache.bytes_used <= budget
        # The shared system prompt was touched last (leaf first), so it survives.
        assert cache.match("t", [*shared, 0]) == 8
    assert cache.stats.evicted_blocks > 0
    assert len(cache) == 6


def test_zero_budget_stores_nothing_and_bad_settings_raise() -> None:
    cache = PrefixCache(budget_bytes=0)
    assert not cache.enabled
    assert cache.insert("t", list(range(64)), _kv(64)) == 0 and cache.bytes_used == 0
    with pytest.raises(ConfigError, match="-1"):
        PrefixCache(budget_bytes=-1)
    with pytest.raises(ConfigError, match="block size"):
        PrefixCache(block_size=0)
    with pytest.raises(ConfigError, match="prefix_cache_bytes"):
        TargetConfig(prefix_cache_bytes=-5)


# -- HFTarget with reuse, against a target that feeds everything ------------------------


@pytest.fixture
def reusing(tiny_model: torch.nn.Module) -> HFTarget:
    return HFTarget(tiny_model, None, "tiny-llama", "float32", "cpu",
                    PrefixCache(budget_bytes=50_000_000, block_size=8))


@pytest.fixture
def plain(tiny_model: torch.nn.Module) -> HFTarget:
    return HFTarget(tiny_model, None, "tiny-llama", "float32", "cpu")


def test_prefill_reuses_the_sessions_last_prompt_and_answer(reusing: HFTarget,
                                                            plain: HFTarget) -> None:
    assert isinstance(reusing, PrefixReuseTarget)
    rng = random.Random(1)
    history: list[int] = []
    previous = 0
    for turn in range(4):
        history += [rng.randrange(2, 96) for _ in range(rng.randrange(5, 40))]
        got = reusing.prefill(history, scope="t")
        want = plain.prefill(history)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(), want.argmax())
        if turn:
            assert reusing.reused_tokens == previous  # the whole earlier turn
        # The "answer": scored, partly rolled back, as the decode loop does.
        ans = [rng.randrange(2, 96) for _ in range(6)]
        reusing.score(ans)
        reusing.rollback(2)
        history += ans[:4]
        previous = len(history)
        # The cache holds exactly history (the next prompt starts with it).
        assert reusing.num_cached == len(history)


def test_no_scope_or_other_tenant_feeds_everything(reusing: HFTarget) -> None:
    prompt = list(range(2, 60))
    reusing.prefill(prompt, scope="a")
    reusing.prefill([*prompt, 5], scope="a")
    assert reusing.reused_tokens == len(prompt)
    reusing.prefill([*prompt, 5], scope="b")  # another tenant: nothing reused
    assert reusing.reused_tokens == 0
    reusing.prefill([*prompt, 5])  # no scope: nothing reused
    assert reusing.reused_tokens == 0
    # Tenant a's KV went to the store when b's request came: still reusable by a.
    reusing.prefill([*prompt, 7, 8], scope="a")
    assert reusing.reused_tokens == (len(prompt) + 1) // 8 * 8


def _session_turns(seed: int, turns: int = 4) -> list[list[int]]:
    """Growing prompts of one session (new user text each turn), tiny vocabulary."""
    rng = random.Random(seed)
    system = [rng.randrange(2, 96) for _ in range(30)]
    user = [[rng.randrange(2, 96) for _ in range(rng.randrange(4, 20))] for _ in range(turns)]
    return [system, *user]


def _run_session(engine: SpeculativeDecoder, parts: list[list[int]], ref: SessionRef,
                 max_tokens: int = 24) -> tuple[list[list[int]], list[int]]:
    history = list(parts[0])
    outs, cached = [], []
    for user in parts[1:]:
        history += user
        gen = engine.generate(history, max_tokens=max_tokens, session=ref)
        outs.append(gen.tokens)
        cached.append(gen.stats.cached_prompt_tokens)
        history += gen.tokens
    return outs, cached


@pytest.mark.parametrize("drafter", ["none", "prompt_lookup", "suffix_tree"])
def test_engine_output_is_identical_with_and_without_reuse(
    drafter: str, reusing: HFTarget, plain: HFTarget
) -> None:
    def make(target: HFTarget) -> SpeculativeDecoder:
        d = {"none": None, "prompt_lookup": PromptLookupDrafter(),
             "suffix_tree": SuffixDrafter(SuffixConfig(tree=True))}[drafter]
        return SpeculativeDecoder(target, d, eos_token_ids=[1],
                                  config=EngineConfig(max_draft=8))

    a, b = make(reusing), make(plain)
    for seed in range(3):  # three sessions of one tenant, interleaved turn by turn
        parts = _session_turns(seed)
        ref = SessionRef(f"s{seed}", tenant="acme")
        got, cached = _run_session(a, parts, ref)
        want, none = _run_session(b, parts, ref)
        assert got == want
        assert none == [0] * len(none)
        assert all(c > 0 for c in cached[1:])  # every later turn reused its history


def test_changed_earlier_message_reuses_only_the_shared_part(reusing: HFTarget,
                                                             plain: HFTarget) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(2, 96) for _ in range(80)]
    engine = SpeculativeDecoder(reusing, PromptLookupDrafter(), eos_token_ids=[1])
    ref = SessionRef("s", tenant="t")
    engine.generate(prompt, max_tokens=8, session=ref)
    edited = list(prompt)
    edited[37] = (edited[37] + 1) % 94 + 2  # an earlier message changed at token 37
    gen = engine.generate([*edited, 4, 5], max_tokens=16, session=ref)
    assert gen.stats.cached_prompt_tokens == 37
    want = SpeculativeDecoder(plain, None, eos_token_ids=[1]).generate([*edited, 4, 5], 16)
    assert gen.tokens == want.tokens


def test_eviction_mid_session_keeps_output_and_budget(tiny_model: torch.nn.Module,
                                                      plain: HFTarget) -> None:
    # Tiny model KV: 2 layers x (k, v) x 2 heads x 16 dims x 4 bytes = 512 bytes a token.
    budget = 60 * 512
    store = PrefixCache(budget_bytes=budget, block_size=8)
    target = HFTarget(tiny_model, None, "tiny-llama", "float32", "cpu", store)
    a = SpeculativeDecoder(target, PromptLookupDrafter(), eos_token_ids=[1])
    b = SpeculativeDecoder(plain, PromptLookupDrafter(), eos_token_ids=[1])
    sessions = [_session_turns(seed, turns=3) for seed in (10, 11)]
    refs = [SessionRef(f"s{i}", tenant="t") for i in range(2)]
    histories = [list(s[0]) for s in sessions]
    for turn in range(1, 4):  # two sessions interleaved: each evicts the other's blocks
        for i, parts in enumerate(sessions):
            histories[i] += parts[turn]
            got = a.generate(histories[i], max_tokens=16, session=refs[i])
            want = b.generate(histories[i], max_tokens=16, session=refs[i])
            assert got.tokens == want.tokens
            assert store.bytes_used <= budget
            histories[i] += got.tokens
    assert store.stats.evicted_blocks > 0


def test_tree_and_batch_scoring_keep_track_of_the_cached_tokens(reusing: HFTarget,
                                                                plain: HFTarget) -> None:
    reusing.prefill([2, 3, 4, 5], scope="t")
    reusing.score_tree([6, 7, 8, 9], [-1, 0, 0, 2])  # root 6; children 7, 8; 9 under 8
    reusing.keep_tree_path([2, 3])  # keep 6 -> 8 -> 9
    reusing.score_batch([[10, 11], [12, 13]])
    reusing.rollback(1)
    reusing.select_row(1)  # keeps 12
    reusing.prefill([2, 3, 4, 5, 6, 8, 9, 12, 40], scope="t")
    assert reusing.reused_tokens == 8
    # An unresolved tree sits after the known tokens: the live prefix is still reusable.
    prompt = [2, 3, 4, 5, 6, 8, 9, 12, 40, 6, 7, 1]
    reusing.score_tree([6, 7, 8], [-1, 0, 0])
    got = reusing.prefill(prompt, scope="t")
    assert reusing.reused_tokens == 9
    torch.testing.assert_close(got, plain.prefill(prompt), atol=1e-5, rtol=1e-5)
    # Unresolved batch rows: the live cache has K rows, only the store is used.
    reusing.score_batch([[3, 4], [5, 6]])
    got = reusing.prefill(prompt, scope="t")
    assert reusing.reused_tokens == 8
    torch.testing.assert_close(got, plain.prefill(prompt), atol=1e-5, rtol=1e-5)


# -- the disk copies: a session's prefix KV survives a restart ---------------------------


def test_spilled_blocks_restore_after_a_restart_with_identical_output(
    tiny_model: torch.nn.Module, plain: HFTarget, tmp_path
) -> None:
    from agentspec.targets.cache.kv_spill import KVSpill

    def process() -> HFTarget:  # a fresh process: empty memory, the same spill folder
        store = PrefixCache(50_000_000, block_size=8, spill=KVSpill(tmp_path, 10_000_000))
        return HFTarget(tiny_model, None, "tiny-llama", "float32", "cpu", store)

    parts = _session_turns(21, turns=2)
    ref = SessionRef("s", tenant="t")
    first = SpeculativeDecoder(process(), PromptLookupDrafter(), eos_token_ids=[1])
    history = parts[0] + parts[1]
    history += first.generate(history, max_tokens=16, session=ref).tokens
    # The next request stores the finished one's KV (in memory and on disk) ...
    first.generate([*history, 9], max_tokens=2, session=SessionRef("x", tenant="other"))
    assert any(tmp_path.glob("*.kv"))
    # ... and after a "restart" the session's next turn reads it back from disk.
    restarted = process()
    engine = SpeculativeDecoder(restarted, PromptLookupDrafter(), eos_token_ids=[1])
    history += parts[2]
    got = engine.generate(history, max_tokens=16, session=ref)
    assert got.stats.cached_prompt_tokens >= (len(history) - len(parts[2])) // 8 * 8 - 8
    assert restarted.prefix_cache is not None
    assert restarted.prefix_cache.stats.restored_blocks > 0
    want = SpeculativeDecoder(plain, PromptLookupDrafter(), eos_token_ids=[1])
    assert got.tokens == want.generate(history, max_tokens=16, session=ref).tokens
    # Another tenant finds nothing on disk either.
    other = process()
    other.prefill(history, scope="intruder")
    assert other.reused_tokens == 0


def test_corrupt_or_foreign_spill_files_are_misses(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from agentspec.targets.cache.kv_spill import KVSpill

    spill = KVSpill(tmp_path, 10_000_000)
    cache = PrefixCache(10**7, block_size=4, spill=spill)
    tokens = list(range(10, 22))
    cache.insert("t", tokens, _kv(12))
    files = sorted(tmp_path.glob("*.kv"))
    assert len(files) == 3 and spill.writes == 3
    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit: the checksum no longer matches
    files[0].write_bytes(bytes(raw))
    fresh = PrefixCache(10**7, block_size=4, spill=KVSpill(tmp_path, 10_000_000))
    n = fresh.match("t", tokens)
    assert n in (0, 4, 8)  # the chain stops at the corrupt block (recomputed, never wrong)
    assert fresh.spill is not None and fresh.spill.rejected == 1
    assert len(list(tmp_path.glob("*.kv"))) == 2  # the corrupt file is gone
    # Within its budget: old files go first.
    small = KVSpill(tmp_path / "small", budget_bytes=3000)
    PrefixCache(10**7, block_size=4, spill=small).insert("t", list(range(40)), _kv(40))
    assert small.bytes_used <= 3000 and len(list((tmp_path / "small").glob("*.kv"))) >= 1


def test_a_long_tail_after_reuse_is_fed_in_chunks_with_the_same_logits(
        reusing: HFTarget, plain: HFTarget, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentspec.targets import hf

    monkeypatch.setattr(hf, "PREFILL_CHUNK", 16)
    rng = random.Random(7)
    first = [rng.randrange(2, 96) for _ in range(120)]
    reusing.prefill(first, scope="chunks")
    prompt = first + [rng.randrange(2, 96) for _ in range(75)]  # 75 new: 5 chunks
    calls: list[int] = []
    forward = reusing.kv.forward
    monkeypatch.setattr(reusing.kv, "forward",
                        lambda toks, last_only=False, **kw: calls.append(len(toks))
                        or forward(toks, last_only, **kw))
    got = reusing.prefill(prompt, scope="chunks")
    assert reusing.reused_tokens == 120 and calls == [16, 16, 16, 16, 11]
    feats = reusing.last_features()  # (both targets hook the one model's norm)
    want = plain.prefill(prompt)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(), want.argmax())
    # Hidden states of every position (the reused ones kept with their KV), as one
    # forward would give.
    assert feats.shape[0] == len(prompt)
    torch.testing.assert_close(feats, plain.last_features(), atol=1e-4, rtol=1e-4)
    assert reusing.num_cached == len(prompt)


def test_a_tiny_shared_prefix_before_a_long_tail_is_not_reused(reusing: HFTarget) -> None:
    """Reusing 8 tokens ahead of 400 new ones would cost more (masked attention over the
    tail) than it saves: the target prefills cold and says so."""
    rng = random.Random(3)
    shared = [rng.randrange(2, 96) for _ in range(8)]
    reusing.prefill([*shared, 5, 6], scope="small")
    reusing.prefill([9, 9, 9], scope="other")  # retire the first request into the store
    lookups = reusing.prefix_cache.stats.lookups
    long_tail = shared + [rng.randrange(2, 96) for _ in range(400)]
    reusing.prefill(long_tail, scope="small")
    assert reusing.reused_tokens == 0
    assert reusing.prefix_cache.stats.lookups == lookups + 1  # counted as a miss
    # The same 8 tokens ahead of a short tail are reused.
    reusing.prefill([*shared, 7, 8, 9], scope="small")
    assert reusing.reused_tokens == 8


# -- a chain larger than memory, per-tenant shares ------------------------------------


def test_a_stored_chain_larger_than_memory_is_looked_up_without_evicting_itself(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Restoring later blocks of a chain must not evict its earlier ones (they were then
    touched by key: a KeyError, a 500 for the tenant)."""
    from agentspec.targets.cache.kv_spill import KVSpill

    tokens = list(range(100, 124))  # 6 blocks of 4
    kv = _kv(24)
    PrefixCache(10**7, block_size=4, spill=KVSpill(tmp_path, 10**7)).insert("a", tokens, kv)
    budget = 3 * _block_bytes(4)  # a "restart" with room for half the chain
    small = PrefixCache(budget, block_size=4, spill=KVSpill(tmp_path, 10**7))
    small.insert("b", list(range(8)), _kv(8, seed=1))  # another tenant's request in between
    n, got = small.lookup("a", [*tokens, 1], limit=100)
    assert 0 < n < 24 and small.bytes_used <= budget
    for layer in range(2):
        assert torch.equal(got[layer][0], kv[layer][0][..., :n, :])
        assert torch.equal(got[layer][1], kv[layer][1][..., :n, :])
    assert small.lookup("a", tokens, limit=100)[0] == n and small.stats.restored_blocks > 0


def test_a_flooding_tenant_evicts_its_own_blocks_not_anothers() -> None:
    block = 4
    budget = 12 * _block_bytes(block)
    cache = PrefixCache(budget_bytes=budget, block_size=block)
    system_b = list(range(200, 208))  # tenant b: 2 blocks, well under its share
    kv_b = _kv(8, seed=99)
    cache.insert("b", system_b, kv_b)
    rng = random.Random(4)
    for conv in range(20):  # tenant a: 80 blocks through a 12-block budget
        tokens = [rng.randrange(100) for _ in range(16)]
        cache.insert("a", tokens, _kv(16, seed=conv))
        assert cache.bytes_used <= budget
        assert cache.match("b", system_b) == 8  # (match touches nothing)
    assert cache.stats.evicted_blocks > 0
    n, got = cache.lookup("b", [*system_b, 1], limit=100)
    assert n == 8 and torch.equal(got[0][0], kv_b[0][0])
    # A new tenant still gets room: the one over its share pays.
    assert cache.insert("c", list(range(8)), _kv(8)) == 2
    assert cache.match("b", system_b) == 8 and cache.match("c", list(range(8))) == 8
    assert cache.scope_bytes("b") == 2 * _block_bytes(block)


def test_the_fair_share_keeps_the_leaf_first_order_within_a_scope() -> None:
    block = 4
    budget = 8 * _block_bytes(block)
    cache = PrefixCache(budget_bytes=budget, block_size=block)
    shared = list(range(8))
    rng = random.Random(2)
    cache.insert("b", list(range(50, 58)), _kv(8))
    for conv in range(10):
        cache.insert("a", shared + [rng.randrange(100, 200) for _ in range(8)],
                     _kv(16, seed=conv))
        assert cache.match("a", shared) == 8  # a's system prompt outlives its tails
    assert cache.match("b", list(range(50, 58))) == 8
