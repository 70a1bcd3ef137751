"""The self-distillation EAGLE recipe (``train-drafter --kind eagle --device ...``) on the tiny
random-weight model, on the CPU: the same code the GPU run takes, in seconds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from agentspec.cli.train_drafter import add_train_drafter_parser, run_self_distill
from agentspec.drafters.model.eagle import read_head
from agentspec.training.corpus import training_prompts
from agentspec.training.eagle import (
    ScaleConfig,
    build_prompt_pool,
    extract_batch_features,
    generate_batch,
    run_recipe,
)
from agentspec.training.eagle import recipe as eagle_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURE = Path(__file__).resolve().parents[2] / "workflows" / "data"
EOS = 1


def _render(msgs: list[dict[str, Any]], tools: Any) -> list[int]:
    """A stand-in chat template for the 96-token model: a role marker, then characters."""
    ids: list[int] = []
    for m in msgs:
        ids.append({"system": 2, "user": 3, "assistant": 4}[m["role"]])
        ids += [5 + ord(c) % 90 for c in m["content"][-40:]]
    return [*ids, 4]


def _pool(seed: int = 0) -> Any:
    docs = [(f"Fix the text number {i}.", f"text {i} " * 5) for i in range(12)]
    return build_prompt_pool(_render, docs, FIXTURE, training_prompts(40, seed),
                             max_prompt=40, val_share=0.2, seed=seed)


def _cfg(**kw: Any) -> ScaleConfig:
    base: dict[str, Any] = dict(minutes=0.08, gen_batch=8, max_prompt=40, max_new_tokens=12,
                                feature_rows=4, train_rows=4, draft_vocab=48, intermediate=32,
                                steps=6, tail_s=1.0, log_every=2, eval_rows=16, val_share=0.2)
    base.update(kw)
    return ScaleConfig(**base)


def test_prompt_pool_reads_every_source_and_splits_by_group() -> None:
    pool = _pool()
    counts = pool.counts()
    sources = set(counts["train"]) | set(counts["held_out"])
    assert {"chat", "document", "relay", "delegate52", "swe_agent", "tool_agent"} <= sources
    assert pool.held_out and pool.train
    assert not {p.group for p in pool.train} & {p.group for p in pool.held_out}
    assert all(len(p.ids) <= 40 for p in pool.train + pool.held_out)


def test_batched_generation_matches_each_prompt_alone(tiny_model: Any) -> None:
    """Left padding changes nothing: greedy rows of one batch equal each prompt alone,
    and the features of right-padded rows equal a forward of each row alone."""
    prompts = [[2, 7, 9, 11, 13], [3, 8], [4, 20, 30, 40, 50, 60, 70], [5, 6, 7]]
    gen = torch.Generator().manual_seed(0)
    toks, lengths, plen = generate_batch(tiny_model, prompts, [0.0] * 4, 10, [EOS], EOS,
                                         torch.device("cpu"), gen, check_every=3)
    feats = extract_batch_features(tiny_model, toks, rows=3)
    for r, p in enumerate(prompts):
        alone, n1, _ = generate_batch(tiny_model, [p], [0.0], 10, [EOS], EOS,
                                       torch.device("cpu"), gen)
        n = int(lengths[r])
        assert int(plen[r]) == len(p) and n == int(n1[0])
        assert toks[r, :n].tolist() == alone[0, :n].tolist()
        assert toks[r, :len(p)].tolist() == p
        with torch.inference_mode():
            ref = tiny_model.model(input_ids=toks[r : r + 1, :n]).last_hidden_state[0]
        torch.testing.assert_close(feats[r, :n].float(), ref, atol=2e-2, rtol=1e-2)
    # Sampled rows run too (different draws per row, all ids in the vocabulary).
    s, ls, _ = generate_batch(tiny_model, prompts, [0.7] * 4, 10, [EOS], EOS,
                              torch.device("cpu"), gen)
    assert int(s.max()) < 96 and int(ls.min()) >= 3


def test_recipe_end_to_end_writes_head_and_report(tiny_model: Any, tmp_path: Path) -> None:
    import time

    out, rep = tmp_path / "head.safetensors", tmp_path / "train.json"
    report = run_recipe(tiny_model, _pool(), _cfg(), device="cpu", out=out,
                        target_name="tiny-llama", stop_ids=[EOS], pad_id=EOS,
                        start=time.monotonic(), report={}, report_path=rep, log=lambda s: None)
    assert report["status"] == "ok", report["errors"]
    on_disk = json.loads(rep.read_text())
    assert on_disk["status"] == "ok"
    gen = on_disk["generation"]
    assert gen["sequences"] > 0 and gen["tokens_generated"] > 0
    assert set(gen["sequences_by_source"]) <= {"chat", "document", "relay", "delegate52",
                                                "swe_agent", "tool_agent"}
    assert on_disk["train"]["steps"] == 6 and on_disk["train"]["positions_trained"] > 0
    assert on_disk["data"]["train_positions"] > 0 and on_disk["data"]["held_out_sequences"] > 0
    for key in ("top1", "top1_depth2", "top1_depth3", "top1_all", "positions"):
        assert key in on_disk["eval_after"]
    assert 0.0 <= on_disk["eval_after"]["top1"] <= 1.0
    assert {"generate_s", "train_s", "eval_s", "save_s", "total_s"} <= set(on_disk["phases_s"])
    assert on_disk["head"]["written"] and on_disk["head"]["draft_vocab"] == 48
    head = read_head(tiny_model, out)
    assert len(head.spec.draft_vocab) == 48 and head.spec.intermediate == 32
    assert EOS in head.spec.draft_vocab


def test_a_failing_phase_still_saves_the_head_and_the_report(
        tiny_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    calls = {"n": 0}
    real = eagle_recipe.evaluate_head

    def flaky(*a: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] > 1:  # the evaluation after training breaks
            raise RuntimeError("boom")
        return real(*a, **kw)

    monkeypatch.setattr(eagle_recipe, "evaluate_head", flaky)
    out, rep = tmp_path / "head.safetensors", tmp_path / "train.json"
    run_recipe(tiny_model, _pool(), _cfg(), device="cpu", out=out, target_name="tiny-llama",
               stop_ids=[EOS], pad_id=EOS, start=time.monotonic(), report={},
               report_path=rep, log=lambda s: None)
    on_disk = json.loads(rep.read_text())
    assert on_disk["status"] == "partial"
    assert on_disk["errors"][0]["phase"] == "eval" and "boom" in on_disk["errors"][0]["error"]
    assert out.is_file() and read_head(tiny_model, out) is not None


class _Data:
    def folder(self, explicit: Any) -> Path:
        return FIXTURE

    def documents(self, folder: Path, seed: int) -> list[tuple[str, str]]:
        return [(f"Copy note {i}.", f"note {i} " * 4) for i in range(8)]

    def held_out_prompts(self) -> list[str]:
        return ["What is the moon?"]


class _Tok:
    eos_token_id = EOS
    pad_token_id = EOS


class _Files:
    name = "tiny-llama"


def test_cli_runs_the_recipe_and_reports(tiny_model: Any, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import agentspec.models

    monkeypatch.setattr(agentspec.models, "load_model_and_tokenizer",
                        lambda *a, **kw: (tiny_model, _Tok(), _Files()))
    parser = argparse.ArgumentParser()
    add_train_drafter_parser(parser.add_subparsers(dest="command"))
    out, rep = tmp_path / "h.safetensors", tmp_path / "r.json"
    args = parser.parse_args([
        "train-drafter", "--kind", "eagle", "--device", "cpu", "--minutes", "0.08",
        "--out", str(out), "--report", str(rep), "--steps", "3", "--gen-batch", "8",
        "--train-batch", "4", "--max-prompt", "40", "--max-new-tokens", "8",
        "--draft-vocab", "32", "--head-intermediate", "16"])
    assert run_self_distill(args, _Data(), render=_render) == 0
    on_disk = json.loads(rep.read_text())
    assert on_disk["status"] == "ok" and on_disk["model"] == "tiny-llama"
    assert on_disk["train"]["steps"] == 3 and on_disk["phases_s"]["load_s"] >= 0
    assert read_head(tiny_model, out).spec.intermediate == 16


def test_cli_failure_before_training_writes_the_report(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import agentspec.models

    def broken(*a: Any, **kw: Any) -> Any:
        raise OSError("no model here")

    monkeypatch.setattr(agentspec.models, "load_model_and_tokenizer", broken)
    parser = argparse.ArgumentParser()
    add_train_drafter_parser(parser.add_subparsers(dest="command"))
    rep = tmp_path / "r.json"
    args = parser.parse_args(["train-drafter", "--device", "cpu", "--minutes", "0.05",
                              "--out", str(tmp_path / "h.safetensors"), "--report", str(rep)])
    assert run_self_distill(args, _Data(), render=_render) == 1
    on_disk = json.loads(rep.read_text())
    assert on_disk["status"] == "failed" and "no model here" in on_disk["errors"][0]["error"]
