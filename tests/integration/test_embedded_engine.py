"""The engine on the embedded SmolLM2-135M-Instruct: token-identical to transformers'
greedy generate on real prompts, with every drafter; bench smoke run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentspec.chat.stream import ResultStream
from agentspec.chat.templates import render_prompt
from agentspec.drafters import OracleDrafter, PromptLookupDrafter, SuffixDrafter
from agentspec.drafters.suffix.drafter import SuffixConfig
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import BenchmarkError, ModelLoadError
from agentspec.models import _convert_gguf, _embedded_gguf
from agentspec.targets.hf import HFTarget, TargetConfig

pytestmark = pytest.mark.integration

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "user", "content": 'Repeat this JSON exactly: {"city": "Paris", "days": 3, '
                                 '"units": "metric", "tags": ["trip", "weather"]}'}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "List three colours of the rainbow, one per line."}],
    [{"role": "user", "content": "Fix the typo and return the sentence: 'The quick brwn fox "
                                 "jumps over the lazy dog. The quick brwn fox sleeps.'"}],
    [{"role": "user", "content": "Translate to French: good morning, my friend."}],
]


def _hf_greedy(target: HFTarget, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    eos = target.tokenizer.eos_token_id
    with torch.inference_mode():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids),
                                    max_new_tokens=max_new, do_sample=False,
                                    eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


_HVD: dict[int, tuple[object, ...]] = {}


def _hvd_drafters(target: HFTarget) -> tuple[object, ...]:
    """The shipped EAGLE head alone and HVD (cache + EAGLE + cost-aware policy), built once."""
    if id(target) not in _HVD:
        from agentspec.drafters.hybrid_build import build_hybrid, load_model_drafter

        _HVD[id(target)] = (load_model_drafter(target, max_tokens=4), build_hybrid(target))
    return _HVD[id(target)]


def test_shipped_eagle_head_drafts_from_hidden_states(embedded_target: HFTarget) -> None:
    """The packaged EAGLE head loads for the embedded model and its drafts are accepted
    often enough to matter (measured ~30 % of first draft tokens on open chat)."""
    from agentspec.drafters.model.eagle import EagleDrafter

    eagle = _hvd_drafters(embedded_target)[0]
    assert isinstance(eagle, EagleDrafter)
    tok = embedded_target.tokenizer
    engine = SpeculativeDecoder(embedded_target, eagle, eos_token_ids=[tok.eos_token_id],
                                config=EngineConfig(max_draft=4))
    drafted = first_hits = 0
    for messages in PROMPTS[:3]:
        got = engine.generate(render_prompt(tok, messages), max_tokens=64)
        steps = [s for s in got.stats.steps if s.draft_len > 0]
        drafted += len(steps)
        first_hits += sum(s.accepted > 0 for s in steps)
    assert drafted > 20
    assert first_hits / drafted > 0.15


def test_real_prompts_identical_to_greedy(embedded_target: HFTarget) -> None:
    tok = embedded_target.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    hit_eos = 0
    for messages in PROMPTS:
        prompt = render_prompt(tok, messages)
        ref = _hf_greedy(embedded_target, prompt, 96)
        hit_eos += ref[-1] == tok.eos_token_id
        oracle = OracleDrafter({tuple(prompt): ref})
        # SuffixDrafter(tree=True) drafts token trees, verified branch by branch in one
        # batched forward: lossless like every chain drafter.
        tree = SuffixDrafter(SuffixConfig(tree=True, max_tokens=12))
        for drafter in (None, PromptLookupDrafter(), oracle, SuffixDrafter(), tree,
                        *_hvd_drafters(embedded_target)):
            engine = SpeculativeDecoder(embedded_target, drafter, decode=decode,
                                        eos_token_ids=[tok.eos_token_id],
                                        config=EngineConfig(max_draft=12))
            got = engine.generate(prompt, max_tokens=96)
            assert got.tokens == ref, (messages, drafter)
            assert got.text == decode(ref)
            if drafter is oracle:  # the oracle commits several tokens per forward
                assert got.stats.forwards < len(ref)
    assert hit_eos >= 3  # real answers that end on their own, not only max_tokens cuts


def test_stream_and_stop_on_embedded_model(embedded_target: HFTarget) -> None:
    tok = embedded_target.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    prompt = render_prompt(tok, PROMPTS[3])
    ref_text = decode(_hf_greedy(embedded_target, prompt, 60))
    stop = ref_text.split("\n")[1][:3] if "\n" in ref_text else ref_text[5:8]
    engine = SpeculativeDecoder(embedded_target, PromptLookupDrafter(), decode=decode,
                                eos_token_ids=[tok.eos_token_id])
    stream = ResultStream(engine.stream(prompt, 60, stop=[stop]))
    text = "".join(stream)
    assert text == ref_text[: ref_text.find(stop)]
    assert stream.result.finish_reason == "stop"


def test_truncated_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(_embedded_gguf().read_bytes()[:4096])
    with pytest.raises(ModelLoadError, match="corrupt"):
        _convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bench_smoke_json_contract(embedded_target: HFTarget, tmp_path: Path) -> None:
    from workflows.bench.harness import BenchConfig, run_bench

    out = tmp_path / "results.json"
    cfg = BenchConfig(workloads=["smoke"], methods=["greedy", "prompt_lookup",
                      "hf_prompt_lookup", "oracle"], limit=1, turns=2, out=out, progress=False)
    report = run_bench(cfg, target=embedded_target)
    data = json.loads(out.read_text())
    assert data["model"] == "smollm2-135m-instruct" and "machine" in data
    rows = {r["method"]: r for r in data["results"]}
    assert set(rows) == {"greedy", "prompt_lookup", "hf_prompt_lookup", "oracle"}
    for r in rows.values():
        for key in ("workload", "method", "requests", "tokens", "seconds", "tokens_per_s",
                    "speedup_vs_greedy", "mean_accepted_len", "forwards_per_1k",
                    "identical_to_greedy"):
            assert key in r
        assert r["identical_to_greedy"] is True, r["method"]
        assert r["requests"] == 2 and r["tokens"] == rows["greedy"]["tokens"]
    assert rows["greedy"]["speedup_vs_greedy"] == 1.0
    # The oracle is the ceiling: fewest forwards per 1,000 tokens.
    assert rows["oracle"]["forwards_per_1k"] < rows["prompt_lookup"]["forwards_per_1k"]
    assert rows["oracle"]["forwards_per_1k"] < 400
    assert out.with_suffix(".turns.jsonl").read_text().count("\n") == 8
    assert report["results"] == data["results"]


def test_cli_bench_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "agentspec.cli", "bench", "--workloads", "smoke", "--methods",
         "greedy,prompt_lookup", "--limit", "1", "--turns", "1", "--out", str(out),
         "--no-progress"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "speed-up" in proc.stdout and "prompt_lookup" in proc.stdout
    data = json.loads(out.read_text())
    assert all(r["identical_to_greedy"] for r in data["results"])
    # The default precision, auto, is reported as what it resolved to on this machine.
    assert data["config"]["dtype"] == TargetConfig().dtype != "auto"


def test_interleaved_mix_checks_agreement_and_pools(embedded_target: HFTarget) -> None:
    from workflows.bench.interleaved import Part, interleaved_table, parse_mix, run

    report = run(["prompt_lookup", "suffix", "oracle"], [Part("smoke", 1, 2)],
                 progress=False, target=embedded_target)
    assert report["dtype"] == embedded_target.dtype == "float32"
    pooled = report["pooled"]
    assert set(pooled) == {"prompt_lookup", "suffix", "oracle"}
    # Every method decoded the same tokens (checked per turn), and the pool is their sum.
    assert len({p["tokens"] for p in pooled.values()}) == 1
    assert pooled["suffix"]["tokens"] == sum(t["tokens"] for t in report["turns"]) > 0
    assert report["workloads"]["smoke"]["suffix"] == pooled["suffix"]
    # The oracle, fed the common output, is the forward-count ceiling.
    assert pooled["oracle"]["forwards_per_1k"] <= pooled["suffix"]["forwards_per_1k"]
    ratio = report["pooled_ratios"]["prompt_lookup_over_suffix"]
    assert ratio == pytest.approx(pooled["prompt_lookup"]["tokens_per_s"]
                                  / pooled["suffix"]["tokens_per_s"], rel=1e-3)
    assert "prompt_lookup / suffix pooled" in interleaved_table(report)
    assert parse_mix("delegate52:5x4, chat:3x2") == [Part("delegate52", 5, 4),
                                                      Part("chat", 3, 2)]
    for bad in ("delegate52", "chat:0x2", "chat:3y2", ""):
        with pytest.raises(BenchmarkError):
            parse_mix(bad)
    with pytest.raises(BenchmarkError, match="two or more"):
        run(["suffix"], [Part("smoke", 1, 1)], target=embedded_target)
