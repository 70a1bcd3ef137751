"""The llama.cpp peer's pure parts: prefix-reuse bookkeeping (on a stand-in for llama.cpp's
C API), the turn records' rates, the context prompts and the side-by-side table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from workflows.bench.llamacpp import (
    LlamaCppRunner,
    PeerUnavailableError,
    PrefixLedger,
    TurnRecord,
    common_prefix,
    library_path,
)
from workflows.bench.llamacpp_bench import (
    LLAMA,
    agreement,
    comparison_table,
    context_prompts,
    context_row,
    median_turns,
    peer_turn_row,
    rotated,
    summarize_contexts,
    summarize_turns,
)

VOCAB = 50


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [6]) == 0


def test_the_ledger_keeps_the_common_prefix_but_never_the_whole_prompt() -> None:
    led = PrefixLedger([1, 2, 3, 4, 5])
    assert led.keep([1, 2, 3, 9]) == 3
    assert led.keep([1, 2, 3, 4, 5]) == 4  # the last token is fed again for its logits
    assert led.keep([1, 2, 3, 4, 5, 6, 7]) == 5
    assert led.keep([1, 2, 3], reuse=False) == 0
    assert led.keep([]) == 0
    led.truncate(2)
    led.extend([7, 8])
    assert led.tokens == [1, 2, 7, 8]
    led.clear()
    assert led.tokens == []


class _Batch:
    def __init__(self, n: int) -> None:
        self.n_tokens = 0
        self.token, self.pos, self.n_seq_id, self.logits = [0] * n, [0] * n, [0] * n, [0] * n
        self.seq_id = [[0] for _ in range(n)]


class _FakeLlama:
    """llama.cpp's C API as the runner calls it: a KV cache of (position, token) cells; the
    logits make the next token the last fed token plus one (mod the vocabulary)."""

    def __init__(self) -> None:
        self.cells: dict[int, int] = {}
        self.fed: list[tuple[int, int]] = []
        self.batches: list[int] = []
        self.rows: dict[int, np.ndarray] = {}

    def llama_kv_self_seq_rm(self, ctx: Any, seq: int, p0: int, p1: int) -> bool:
        assert p1 == -1
        self.cells = {p: t for p, t in self.cells.items() if p < p0}
        return True

    def llama_kv_self_clear(self, ctx: Any) -> None:
        self.cells.clear()

    def llama_decode(self, ctx: Any, b: _Batch) -> int:
        self.batches.append(b.n_tokens)
        for j in range(b.n_tokens):
            pos, tok = b.pos[j], b.token[j]
            assert pos == len(self.cells), "positions follow what the cache holds"
            self.cells[pos] = tok
            self.fed.append((pos, tok))
        self.rows = {}
        for j in range(b.n_tokens):
            if b.logits[j]:
                row = np.zeros(VOCAB, dtype=np.float32)
                row[(b.token[j] + 1) % VOCAB] = 1
                self.rows[j] = row
        return 0

    def llama_get_logits_ith(self, ctx: Any, i: int) -> np.ndarray:
        return self.rows[max(self.rows)] if i == -1 else self.rows[i]


class _FakeFfi:
    @staticmethod
    def buffer(arr: np.ndarray, size: int) -> bytes:
        return arr.tobytes()[:size]


def _runner(n_batch: int = 4, n_ctx: int = 64) -> tuple[LlamaCppRunner, _FakeLlama]:
    fake = _FakeLlama()
    r = LlamaCppRunner.__new__(LlamaCppRunner)
    r.lib, r.ffi, r.ctx = fake, _FakeFfi(), object()
    r.n_vocab, r.n_batch, r.n_ctx = VOCAB, n_batch, n_ctx
    r.batch, r.ledger = _Batch(n_batch), PrefixLedger()
    return r, fake


def test_a_turn_feeds_what_the_cache_lacks_and_decodes_greedily() -> None:
    r, fake = _runner()
    rec = r.run_turn([10, 11, 12, 13, 14, 15], max_tokens=4)
    assert rec.tokens == [16, 17, 18, 19]
    assert (rec.prompt_tokens, rec.reused, rec.new_prompt) == (6, 0, 6)
    assert fake.batches == [4, 2, 1, 1, 1]  # the prompt in n_batch chunks, then one by one
    # The cache holds the prompt and every answer token but the last (never fed).
    assert r.ledger.tokens == [10, 11, 12, 13, 14, 15, 16, 17, 18]
    assert [fake.cells[p] for p in sorted(fake.cells)] == r.ledger.tokens

    # The next prompt re-sends the first with a different answer: the common prefix stays.
    fake.batches.clear()
    rec2 = r.run_turn([10, 11, 12, 13, 14, 15, 16, 30, 31], max_tokens=2)
    assert (rec2.reused, rec2.new_prompt) == (7, 2)
    assert fake.batches == [2, 1]
    assert rec2.tokens == [32, 33]
    assert [fake.cells[p] for p in sorted(fake.cells)] == r.ledger.tokens

    # The same prompt again: all but its last token are reused.
    again = r.run_turn([10, 11, 12, 13, 14, 15, 16, 30, 31], max_tokens=1)
    assert (again.reused, again.new_prompt, again.tokens) == (8, 1, [32])
    # Without reuse everything is fed.
    cold = r.run_turn([10, 11, 12], max_tokens=1, reuse=False)
    assert (cold.reused, cold.new_prompt) == (0, 3)
    r.clear()
    assert r.ledger.tokens == [] and fake.cells == {}


def test_teacher_forcing_reads_every_rows_argmax() -> None:
    r, fake = _runner(n_batch=3)
    assert r.teacher_forced([1, 2, 3], [4, 9, 10, 11]) == [4, 5, 10, 11]
    assert fake.batches == [2, 3, 1]  # the prompt but its last token, then 4 rows in chunks
    assert r.ledger.tokens == [1, 2, 3, 4, 9, 10]


def test_a_turn_stops_after_an_end_token_and_refuses_what_does_not_fit() -> None:
    r, _ = _runner(n_ctx=12)
    rec = r.run_turn([5, 6], max_tokens=8, eos=[9])
    assert rec.tokens == [7, 8, 9]
    from agentspec.errors import BenchmarkError

    with pytest.raises(BenchmarkError, match="exceeds"):
        r.run_turn(list(range(8)), max_tokens=5)
    with pytest.raises(BenchmarkError):
        r.run_turn([], max_tokens=5)


def test_turn_record_rates() -> None:
    rec = TurnRecord(prompt_tokens=100, reused=60, new_prompt=40, prefill_s=0.5, decode_s=1.5,
                     tokens=[1, 2, 3, 4])
    assert rec.generated == 4 and rec.latency_s == 2.0
    assert rec.prefill_tok_s == 80.0
    assert rec.decode_tok_s == 2.0  # three one-token forwards after the first token
    d = rec.to_dict(with_tokens=False)
    assert "tokens" not in d and d["decode_tok_s"] == 2.0 and d["latency_s"] == 2.0
    row = peer_turn_row("s", 1, rec)
    assert (row["cached_tokens"], row["prefilled_tokens"], row["generated"]) == (60, 40, 4)


def test_context_prompts_cut_the_longest_prompt() -> None:
    prompts = [[1] * 5, list(range(20)), [2] * 10]
    assert context_prompts(prompts, [3, 20]) == {3: [0, 1, 2], 20: list(range(20))}
    from agentspec.errors import BenchmarkError

    with pytest.raises(BenchmarkError, match="fewer than"):
        context_prompts(prompts, [21])
    with pytest.raises(BenchmarkError):
        context_prompts([], [1])


def test_rotation_gives_every_system_the_first_slot() -> None:
    systems = ["a", "b", "c"]
    assert [rotated(systems, k)[0] for k in range(3)] == systems
    assert rotated(systems, 4) == ["b", "c", "a"]
    assert rotated([], 1) == []


def _report() -> dict[str, Any]:
    rows = [context_row(LLAMA, 500, rep, 0.5 + rep, 1.0, 11) for rep in range(3)]
    rows += [context_row("agentspec plain, w8a16 (auto)", 500, rep, 1.0, 2.0 + rep, 11)
             for rep in range(3)]
    turns = {
        LLAMA: [{"session": "s", "turn": t, "prompt_tokens": 900, "cached_tokens": 800,
                 "prefilled_tokens": 100, "prefill_s": 0.2, "latency_s": 2.0 + t,
                 "generated": 64, "decode_tok_s": 30.0} for t in range(3)],
        "agentspec default, w8a16 (auto)": [
            {"session": "s", "turn": t, "prompt_tokens": 900, "cached_tokens": 800,
             "prefilled_tokens": 100, "prefill_s": 0.3, "latency_s": 1.0 + t / 2,
             "generated": 64, "decode_tok_s": 50.0} for t in range(3)],
    }
    return {"settings": {"contexts": [500], "threads": 2},
            "contexts_summary": summarize_contexts(rows),
            "turns_summary": {s: summarize_turns(r) for s, r in turns.items()},
            "llamacpp": {"description": "llama 135M Q4_1", "system_info": "AVX2 = 1"},
            "agreement": {"agentspec plain, w8a16 (auto)": {"500": 7}}}


def test_context_summaries_are_medians_over_rounds() -> None:
    summary = _report()["contexts_summary"]
    assert summary[LLAMA]["500"] == {"prefill_tok_s": 333.33, "decode_tok_s": 10.0, "runs": 3}
    assert summary["agentspec plain, w8a16 (auto)"]["500"]["decode_tok_s"] == 3.33


def test_turn_summaries_and_medians_over_passes() -> None:
    s = _report()["turns_summary"][LLAMA]
    assert (s["turns"], s["later_turns"], s["later_mean_latency_s"]) == (3, 2, 3.5)
    assert s["later_mean_prefilled_tokens"] == 100 and s["later_mean_generated"] == 64
    a = [{"turn": 0, "prefill_s": 1.0, "latency_s": 3.0, "decode_tok_s": 9.0, "tokens": [1]}]
    b = [{"turn": 0, "prefill_s": 2.0, "latency_s": 1.0, "decode_tok_s": 7.0, "tokens": [2]}]
    c = [{"turn": 0, "prefill_s": 3.0, "latency_s": 2.0, "decode_tok_s": 8.0, "tokens": [3]}]
    assert median_turns([a, b, c]) == [{"turn": 0, "prefill_s": 2.0, "latency_s": 2.0,
                                        "decode_tok_s": 8.0}]


def test_the_table_puts_the_systems_side_by_side() -> None:
    table = comparison_table(_report())
    lines = table.splitlines()
    assert lines[0].startswith("| system | decode tok/s @500 | prefill tok/s @500 |")
    llama = next(ln for ln in lines if ln.startswith(f"| {LLAMA} |"))
    assert "| 10.0 | 333 | 3.50 | 1.00x | 100 / 64 |" in llama
    default = next(ln for ln in lines if ln.startswith("| agentspec default"))
    assert "| – | – | 1.75 | 2.00x |" in default  # no context points, twice as fast a turn
    assert "@500 7" in table


def test_agreement_counts_leading_tokens_per_context() -> None:
    points = {(LLAMA, 500): [1, 2, 3, 4], ("x", 500): [1, 2, 9, 4], ("x", 4000): [1]}
    assert agreement(points) == {"x": {"500": 2}}


def test_a_missing_library_is_reported_as_the_peer_being_unavailable(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTSPEC_LLAMACPP_LIB", str(tmp_path / "missing.so"))
    with pytest.raises(PeerUnavailableError, match="not a file"):
        library_path()


def test_make_llamacpp_installs_the_extra_and_the_wheel_the_loader_names() -> None:
    import tomllib

    from workflows.bench.llamacpp import LLAMACPP_WHEEL

    root = Path(__file__).resolve().parents[2]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["peers-llamacpp"]
    recipe = (root / "Makefile").read_text().split("$(LLAMACPP_STAMP): $(STAMP)")[1]
    recipe = recipe.split("\n\n")[0]
    assert f"--no-deps {LLAMACPP_WHEEL}" in recipe
    for req in extra:
        assert f'"{req}"' in recipe
