"""The EAGLE head with prefix KV reuse: the target's final-norm features are kept with the
prefix blocks (in memory and in their disk copies), so a reused turn hands the head every
prompt position's row and decodes exactly as without reuse (tiny model, fp32)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from agentspec.drafters.model.eagle import EagleConfig, EagleDrafter, build_head
from agentspec.drafters.model.eagle_head import HeadSpec
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.targets.cache.kv_spill import KVSpill
from agentspec.targets.cache.prefix_cache import PrefixCache
from agentspec.targets.hf import HFTarget
from agentspec.types import Draft, DraftContext, SessionRef

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 8
# The tiny model per token: KV 2 layers x (k, v) x 2 heads x 16 dims x 4 B, features 64 x 4 B.
KV_BYTES, ROW_BYTES = 2 * 2 * 2 * 16 * 4, 64 * 4


def _head(model: Any) -> Any:
    from agentspec.drafters.model.distilled import embedding_checksum

    torch.manual_seed(0)
    spec = HeadSpec.for_target(model, tuple(range(model.config.vocab_size)), "tiny-llama",
                               embedding_checksum(model))
    head = build_head(model, spec)
    head.init_identity(0)
    return head.eval()


class _Eagle(EagleDrafter):
    """An EAGLE drafter that records every draft it makes and its prompts' feature rows."""

    def __init__(self, model: Any) -> None:
        super().__init__(_head(model), EagleConfig(max_tokens=4))
        self.drafts: list[list[int]] = []
        self.prompt_rows: list[torch.Tensor] = []

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        draft = super().propose(ctx, max_tokens)
        self.drafts.append(list(draft.tokens))
        return draft

    def observe_features(self, ctx: DraftContext, start: int, features: torch.Tensor) -> None:
        if start == 0:
            self.prompt_rows.append(features.clone())
        super().observe_features(ctx, start, features)


def _target(model: Any, budget: int = 50_000_000, folder: Path | None = None) -> HFTarget:
    spill = KVSpill(folder, 10**8) if folder is not None else None
    return HFTarget(model, None, "tiny-llama", "float32", "cpu",
                    PrefixCache(budget, block_size=BLOCK, spill=spill))


def _engine(target: HFTarget, drafter: Any) -> SpeculativeDecoder:
    return SpeculativeDecoder(target, drafter, eos_token_ids=[1],
                              config=EngineConfig(max_draft=4))


def _sessions(seed: int, n: int = 2, turns: int = 3) -> list[list[list[int]]]:
    """``n`` sessions of one agent: a shared system prompt, then new user text each turn."""
    rng = random.Random(seed)
    system = [rng.randrange(2, 96) for _ in range(27)]
    return [[system] + [[rng.randrange(2, 96) for _ in range(rng.randrange(5, 25))]
                        for _ in range(turns)] for _ in range(n)]


def _drive(engine: SpeculativeDecoder, sessions: list[list[list[int]]]) -> list[Any]:
    """The sessions' turns interleaved (each turn's prefix then comes from the store, the
    live cache holding the other session); per turn tokens, steps and cached tokens."""
    histories = [list(s[0]) for s in sessions]
    out = []
    for turn in range(1, len(sessions[0])):
        for i, parts in enumerate(sessions):
            histories[i] += parts[turn]
            gen = engine.generate(histories[i], max_tokens=20,
                                  session=SessionRef(f"s{i}", tenant="acme"))
            out.append((gen.tokens, [(s.source, s.draft_len, s.accepted)
                                     for s in gen.stats.steps],
                        gen.stats.cached_prompt_tokens))
            histories[i] += gen.tokens
    return out


def _drafter(kind: str, eagle: _Eagle) -> Any:
    if kind == "eagle":
        return eagle
    from agentspec.drafters import SuffixDrafter
    from agentspec.drafters.hybrid import HybridDrafter
    from agentspec.payoff.policy import ArcticRule

    return HybridDrafter(SuffixDrafter(), eagle, ArcticRule(), model_max=4)


@pytest.mark.parametrize("kind", ["eagle", "hybrid"])
def test_eagle_decodes_a_reused_turn_exactly_as_without_reuse(tiny_model: Any,
                                                               kind: str) -> None:
    """Same tokens, same drafts, same accepted lengths per step, with reuse on (later turns
    reuse their history) and off; the head got a row for every prompt position."""
    sessions = _sessions(1)
    on, off = _Eagle(tiny_model), _Eagle(tiny_model)
    target = _target(tiny_model)
    got = _drive(_engine(target, _drafter(kind, on)), sessions)
    want = _drive(_engine(_target(tiny_model, budget=0), _drafter(kind, off)), sessions)
    assert [g[:2] for g in got] == [w[:2] for w in want]  # tokens, sources, drafts, accepts
    assert on.drafts == off.drafts and any(on.drafts)  # every drafted token
    assert any(a for _, steps, _ in got for *_, a in steps)  # some drafts were accepted
    assert [c for *_, c in want] == [0] * len(want)
    assert all(c > 0 for *_, c in got[1:])  # every turn after the first reused its prefix
    assert [r.shape for r in on.prompt_rows] == [r.shape for r in off.prompt_rows]
    for a, b in zip(on.prompt_rows, off.prompt_rows, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    from agentspec.interfaces import FeatureReuseTarget

    assert isinstance(target, FeatureReuseTarget) and target.reuse_keeps_features
    assert not _target(tiny_model, budget=0).reuse_keeps_features


def test_last_features_after_reuse_cover_every_position(tiny_model: Any) -> None:
    """After a reused prefill (live cache or stored blocks) last_features() covers the
    whole prompt: the reused rows bit-identical to those the target computed when it fed
    those positions, the whole as a full prefill's (fp32 rounding: one forward over
    positions fed in several is not bit-identical, as for the KV)."""
    target, cold = _target(tiny_model), _target(tiny_model, budget=0)
    rng = random.Random(2)
    first = [rng.randrange(2, 96) for _ in range(37)]
    target.prefill(first, scope="t")
    fed = [target.last_features().clone()]
    target.score([5, 6, 7, 8])  # an answer, partly rejected
    fed.append(target.last_features()[:2].clone())
    target.rollback(2)
    seen = torch.cat(fed)  # [39, H]: every position the cache holds, as first computed
    prompt = [*first, 5, 6, *(rng.randrange(2, 96) for _ in range(12))]
    cold.prefill(prompt)
    full = cold.last_features()
    target.prefill(prompt, scope="t")  # reuses the live cache (rows known: given too)
    live = target.last_features().clone()
    assert target.reused_tokens == 39
    assert live.shape == full.shape == (len(prompt), 64)
    assert torch.equal(live[:39], seen)
    torch.testing.assert_close(live, full, atol=1e-5, rtol=1e-5)
    target.prefill([9, 9, 9], scope="other")  # moves the live KV into the store's blocks
    target.prefill(prompt, scope="t", features=True)
    stored = target.last_features()
    assert target.reused_tokens == 48  # 6 blocks: 39 rows as first fed, 9 of the tail
    assert stored.shape == full.shape and torch.equal(stored[:48], live[:48])
    torch.testing.assert_close(stored, full, atol=1e-5, rtol=1e-5)


def test_the_rows_stay_in_step_through_trees_batches_and_rollbacks(tiny_model: Any) -> None:
    """Every way of feeding and dropping positions keeps each row at its position: a
    reused prefill's rows match a cold prefill's (a row out of place would differ by far
    more than rounding); a lost step only costs reuse, never a wrong row."""
    target, cold = _target(tiny_model), _target(tiny_model, budget=0)
    target.prefill([2, 3, 4, 5, 6, 7, 8, 9, 10, 11], scope="t")
    target.score_tree([12, 13, 14, 15], [-1, 0, 0, 2])  # root 12; children 13, 14; 15
    target.keep_tree_path([2, 3])  # keeps 12 -> 14 -> 15
    target.score_batch([[16, 17, 18], [19, 20, 21]])
    target.rollback(1)
    target.select_row(1)  # keeps 19, 20
    target.score([22, 23, 24])
    target.rollback(1)
    prompt = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 15, 19, 20, 22, 23, 40, 41]
    cold.prefill(prompt)
    want = cold.last_features().clone()  # (the targets share the model's norm hook)
    for scope, reused in (("t", 17), ("other", 0), ("t", 16), ("t", 18)):
        # The live cache (the 17 positions kept), then the stored blocks, then live again.
        target.prefill(prompt if scope == "t" else [9, 9], scope=scope, features=True)
        assert target.reused_tokens == reused
        if scope == "t":
            torch.testing.assert_close(target.last_features(), want, atol=1e-5, rtol=1e-5)


def test_features_survive_the_disk_copy(tiny_model: Any, tmp_path: Path) -> None:
    """A restarted target (empty memory, the same folder) reads the rows back with the KV
    and decodes a reused EAGLE turn exactly as without reuse."""
    sessions = _sessions(3, n=1, turns=2)
    history = sessions[0][0] + sessions[0][1]
    first = _target(tiny_model, folder=tmp_path)
    gen = _engine(first, _Eagle(tiny_model)).generate(history, 20, session=SessionRef("s", "t"))
    history += gen.tokens
    first.retire()  # the finished request's blocks go to memory and disk
    assert first.prefix_cache is not None and any(tmp_path.glob("*.kv"))
    restarted = _target(tiny_model, folder=tmp_path)
    on, off = _Eagle(tiny_model), _Eagle(tiny_model)
    prompt = [*history, *sessions[0][2]]
    got = _engine(restarted, on).generate(prompt, 20, session=SessionRef("s", "t"))
    want = _engine(_target(tiny_model, budget=0), off).generate(prompt, 20)
    assert got.stats.cached_prompt_tokens >= (len(history) - 1) // BLOCK * BLOCK > 0
    assert restarted.prefix_cache is not None
    assert restarted.prefix_cache.stats.restored_blocks == got.stats.cached_prompt_tokens // BLOCK
    assert got.tokens == want.tokens and on.drafts == off.drafts
    assert [s.accepted for s in got.stats.steps] == [s.accepted for s in want.stats.steps]
    # The rows read back are the very rows stored (fp32, bit for bit).
    stored = first.prefix_cache.fetch("t", history, len(history), features=True)
    assert stored.features is not None and stored.features.shape == (stored.n, 64)
    back = _target(tiny_model, folder=tmp_path).prefix_cache.fetch(  # type: ignore[union-attr]
        "t", history, len(history), features=True)
    assert back.n == stored.n and back.features is not None
    assert torch.equal(back.features, stored.features) and back.features.dtype == torch.float32


def test_an_old_block_without_features_loads_as_kv_and_is_recomputed_for_eagle(
        tiny_model: Any, tmp_path: Path) -> None:
    """A block file without rows (the previous version's format) is KV to a request that
    needs no features; an EAGLE request reuses only the blocks before it (never a short
    feature tensor), and storing its KV gives the block its rows, on disk too."""
    rng = random.Random(4)
    prompt = [rng.randrange(2, 96) for _ in range(41)]
    writer = _target(tiny_model, folder=tmp_path)
    writer.prefill(prompt, scope="t")
    writer.retire()
    assert writer.prefix_cache is not None
    key = writer.prefix_cache._keys("t", prompt)[2]  # the third block: positions 16..23
    spill = KVSpill(tmp_path, 10**8)
    kv = spill.load(key, prompt[16:24], "cpu")
    assert kv is not None
    (tmp_path / f"{key.hex()}.kv").unlink()
    spill.save(key, prompt[16:24], kv)  # as the previous version wrote it: KV only
    longer = [*prompt, 3, 4, 5]
    plain = _target(tiny_model, folder=tmp_path)  # no features asked: all of it is KV
    plain.prefill(longer, scope="t")
    assert plain.reused_tokens == 40 and plain.prefix_cache is not None
    assert plain.prefix_cache.to_dict()["rejected_blocks"] == 0
    # The live cache now holds positions without rows: an EAGLE request must not use it.
    on, off = _Eagle(tiny_model), _Eagle(tiny_model)
    got = _engine(plain, on).generate([*longer, 6], 12, session=SessionRef("s", "t"))
    want = _engine(_target(tiny_model, budget=0), off).generate([*longer, 6], 12)
    assert got.stats.cached_prompt_tokens == 16  # the blocks before the old one
    assert got.tokens == want.tokens and on.drafts == off.drafts
    assert on.prompt_rows[0].shape == (len(longer), 64)
    old = KVSpill(tmp_path, 10**8).read(key, prompt[16:24], "cpu")
    assert old is not None and old[1] is None  # (read as KV, not refused)
    plain.retire()  # the recomputed block is stored again, now with its rows
    fresh = PrefixCache(10**8, block_size=BLOCK, spill=KVSpill(tmp_path, 10**8))
    assert fresh.match("t", longer, features=True) == 40
    new = KVSpill(tmp_path, 10**8).read(key, prompt[16:24], "cpu")
    assert new is not None and new[1] is not None and new[1].shape == (BLOCK, 64)


def test_feature_rows_of_the_wrong_layout_are_refused(tmp_path: Path) -> None:
    """Rows of another width, dtype or length make the file a fault (deleted, counted),
    as a KV layout mismatch does; KV-only files of the same layout are fine."""
    gen = torch.Generator().manual_seed(0)
    kv = [(torch.randn(1, 2, 4, 4, generator=gen), torch.randn(1, 2, 4, 4, generator=gen))]
    spill = KVSpill(tmp_path, 10**7)
    spill.save(b"\1" * 16, [1, 2, 3, 4], kv, torch.randn(4, 8, generator=gen))
    writer = KVSpill(tmp_path, 10**7)  # the same key: only the rows are wrong
    writer.save(b"\2" * 16, [1, 2, 3, 4], kv, torch.randn(4, 9, generator=gen))
    writer.save(b"\3" * 16, [1, 2, 3, 4], kv, torch.randn(4, 8, generator=gen).double())
    writer.save(b"\4" * 16, [1, 2, 3, 4], kv, torch.randn(5, 8, generator=gen))
    writer.save(b"\5" * 16, [1, 2, 3, 4], kv)
    assert spill.read(b"\1" * 16, [1, 2, 3, 4], "cpu") is not None
    for key in (b"\2", b"\3", b"\4"):
        assert spill.read(key * 16, [1, 2, 3, 4], "cpu") is None
        assert not (tmp_path / f"{(key * 16).hex()}.kv").exists()  # deleted
    assert spill.rejected == 3
    old = spill.read(b"\5" * 16, [1, 2, 3, 4], "cpu")  # no rows at all: KV only
    assert old is not None and old[1] is None and spill.rejected == 3


def test_the_budget_counts_feature_rows(tiny_model: Any) -> None:
    """Stored bytes are KV plus feature rows; a budget that holds 5 blocks of KV alone
    holds 3 with rows, never exceeded; a KV-only block gains its rows within it."""
    kv_block, row_block = BLOCK * KV_BYTES, BLOCK * ROW_BYTES
    target = _target(tiny_model)
    rng = random.Random(5)
    prompt = [rng.randrange(2, 96) for _ in range(43)]
    target.prefill(prompt, scope="t")
    target.retire()
    store = target.prefix_cache
    assert store is not None and len(store) == 5
    assert store.bytes_used == 5 * (kv_block + row_block)
    assert store.to_dict()["bytes_used"] == store.scope_bytes("t") == store.bytes_used
    kv = [(layer.keys, layer.values) for layer in target.kv.cache.layers]
    rows = target.last_features()  # [43, H]
    small = PrefixCache(5 * kv_block, block_size=BLOCK)
    assert small.insert("t", prompt, kv, rows) == 3 and small.bytes_used <= 5 * kv_block
    bare = PrefixCache(10**7, block_size=BLOCK)
    bare.insert("t", prompt, kv)  # KV only (as read from an old file)
    assert bare.bytes_used == 5 * kv_block and bare.match("t", prompt, features=True) == 0
    assert bare.insert("t", prompt, kv, rows, features_from=8) == 0  # only touched ...
    assert bare.bytes_used == 5 * kv_block + 4 * row_block  # ... the 4 after row 8 gained
    assert bare.match("t", prompt, features=True) == 0  # (the first block still has none)
    bare.insert("t", prompt, kv, rows)
    hit = bare.fetch("t", prompt, 100, features=True)
    assert hit.n == 40 and hit.features is not None and torch.equal(hit.features, rows[:40])


def test_the_feature_log_grows_cuts_and_forgets() -> None:
    from agentspec.errors import ConfigError
    from agentspec.targets.cache.block_features import FeatureLog

    rows = torch.arange(200 * 3, dtype=torch.float32).reshape(200, 3)
    log = FeatureLog()
    log.append(rows[:50])
    log.append(rows[50:150])  # grows past the first buffer, keeping what it held
    assert log.covers(150) and torch.equal(log.view(150), rows[:150])
    log.truncate(120)
    log.append(rows[120:200])  # a cut only moved the fill mark
    assert torch.equal(log.view(200), rows)
    log.forget(500)  # out of step: more positions than rows, none known
    assert not log.covers(1) and log.known() == (None, 0)
    log.append(rows[:10])  # positions 500..509: known, the rest still not
    known, first = log.known()
    assert first == 500 and known is not None and torch.equal(known[500:], rows[:10])
    log.reset(rows[:4])
    assert log.covers(4) and len(log) == 4
    log.reset(None, 32)
    assert not log.covers(32) and log.covers(0)
    with pytest.raises(ConfigError, match="asked of a log"):
        log.view(40)
    with pytest.raises(ConfigError, match=r"\[m, H\]"):
        log.append(rows[0])
