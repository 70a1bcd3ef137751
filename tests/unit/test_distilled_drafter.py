"""The distilled drafter: training loop on the tiny model, the artifact round trip, lossless
decoding with it, and the errors on missing artifacts and bad training data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agentspec.cli.train_drafter import read_teacher_traces
from agentspec.drafters import DistilledDrafter, load_default_drafter
from agentspec.drafters.model.causal import ModelDrafterConfig
from agentspec.drafters.model.distilled import describe, load_distilled_drafter
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError, ModelLoadError, TrainingDataError
from agentspec.training.corpus import TeacherSeq, _topk, training_prompts
from agentspec.training.drafter import (
    TrainDrafterConfig,
    choose_draft_vocab,
    save_artifact,
    train_student,
)
from agentspec.types import DraftContext
from tests.conftest import TINY_VOCAB
from tests.unit.test_engine_lossless import hf_greedy

CFG = TrainDrafterConfig(num_layers=1, rank=4, head_rank=4, draft_vocab=64, top_k=8,
                         batch_size=4, lr=1e-2, steps=40, seed=0)


pytestmark = pytest.mark.usefixtures("one_thread")


def _teacher(model: torch.nn.Module, tokens: list[int], start: int) -> TeacherSeq:
    """Teacher-forced top-K of ``model`` on ``tokens`` from ``start`` on."""
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0, start:-1]  # [S, V]
    top_i, top_v = _topk(logits, CFG.top_k)
    return TeacherSeq(torch.tensor(tokens), start, top_i, top_v)


@pytest.fixture(scope="module")
def teacher_data(tiny_model) -> list[TeacherSeq]:  # type: ignore[no-untyped-def]
    """40 sequences: a seeded random prompt plus the tiny model's greedy continuation."""
    gen = torch.Generator().manual_seed(5)
    seqs = []
    for _ in range(40):
        prompt = torch.randint(2, TINY_VOCAB, (6,), generator=gen).tolist()
        seqs.append(_teacher(tiny_model, prompt + hf_greedy(tiny_model, prompt, 24, None), 5))
    return seqs


@pytest.fixture(scope="module")
def trained(tiny_model, teacher_data, tmp_path_factory):  # type: ignore[no-untyped-def]
    spec, tensors, report = train_student(tiny_model, teacher_data, CFG,
                                          target_name="tiny-llama", always=[1],
                                          progress=False)
    path = tmp_path_factory.mktemp("drafter") / "tiny-llama.safetensors"
    save_artifact(path, spec, tensors, report)
    return spec, path, report


def test_training_raises_agreement_with_the_target(trained) -> None:  # type: ignore[no-untyped-def]
    spec, path, report = trained
    assert report["steps"] == CFG.steps
    # A random 2-layer teacher does not generalise from 36 sequences: the loop must fit them.
    assert report["train_after"]["loss"] < report["train_before"]["loss"] - 0.1
    assert report["train_after"]["top1"] > report["train_before"]["top1"] + 0.1
    assert report["val_after"]["positions"] > 0
    assert len(spec.draft_vocab) == 64 and spec.draft_vocab[0] == 1  # EOS always kept
    info = describe(path)
    assert info["draft_vocab_size"] == 64 and info["trained_parameters"] > 0
    assert json.loads(path.with_suffix(".json").read_text())["steps"] == CFG.steps


def test_loaded_drafter_drafts_in_its_vocabulary_and_matches_training(  # type: ignore[no-untyped-def]
    tiny_target, trained, teacher_data
) -> None:
    spec, path, _ = trained
    drafter = load_distilled_drafter(tiny_target, path, ModelDrafterConfig(max_tokens=5))
    assert isinstance(drafter, DistilledDrafter)
    agree = total = 0
    for seq in teacher_data[:8]:
        ctx = seq.tokens[: seq.start + 1].tolist()
        draft = drafter.propose(DraftContext(ctx, len(ctx)), 5)
        assert len(draft.tokens) == 5 and set(draft.tokens) <= set(spec.draft_vocab)
        assert 0 < draft.score <= 5  # expected accepted length under its own probabilities
        agree += int(draft.tokens[0] == int(seq.top_ids[0, 0]))
        total += 1
    assert agree / total >= 0.5  # these sequences were trained on


def test_engine_with_the_distilled_drafter_is_token_identical_to_greedy(  # type: ignore[no-untyped-def]
    tiny_model, tiny_target, trained
) -> None:
    _, path, _ = trained
    for stop_below in (0.0, 0.3):
        drafter = load_distilled_drafter(tiny_target, path, ModelDrafterConfig(max_tokens=4),
                                         stop_below=stop_below)
        engine = SpeculativeDecoder(tiny_target, drafter, config=EngineConfig(max_draft=4))
        for prompt in ([9, 8, 7, 6], [40, 2, 33]):
            got = engine.generate(prompt, max_tokens=40)
            assert got.tokens == hf_greedy(tiny_model, prompt, 40, None)
            assert got.stats.mean_accepted_len >= 1.0


def test_missing_default_drafter_says_how_to_build_it(tiny_target, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"agentspec train-drafter.*make drafter"):
        load_default_drafter(tiny_target)


def test_default_drafter_is_found_under_agentspec_home(tiny_target, trained, tmp_path,  # type: ignore[no-untyped-def]
                                                       monkeypatch) -> None:
    _, path, _ = trained
    (tmp_path / "drafters").mkdir()
    (tmp_path / "drafters" / "tiny-llama.safetensors").write_bytes(path.read_bytes())
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    assert isinstance(load_default_drafter(tiny_target), DistilledDrafter)


def test_artifact_of_another_target_or_a_bad_file_is_refused(tiny_model, trained,  # type: ignore[no-untyped-def]
                                                             tmp_path) -> None:
    import copy

    from agentspec.targets.hf import HFTarget

    _, path, _ = trained
    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        other.model.embed_tokens.weight.mul_(1.5)
    with pytest.raises(ModelLoadError, match="not from this target"):
        load_distilled_drafter(HFTarget(other, None, "other", "float32", "cpu"), path)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="could not read"):
        load_distilled_drafter(HFTarget(other, None, "other", "float32", "cpu"), junk)


def test_bad_training_data_is_refused(tiny_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TrainingDataError, match="no teacher sequences"):
        train_student(tiny_model, [], CFG, target_name="t", progress=False)
    wrong = TeacherSeq(torch.tensor([3, 4, TINY_VOCAB + 7]), 0, torch.tensor([[5], [6]]),
                       torch.zeros(2, 1, dtype=torch.float16))
    with pytest.raises(TrainingDataError, match=f"token id {TINY_VOCAB + 7} is outside"):
        train_student(tiny_model, [wrong], CFG, target_name="t", progress=False)
    with pytest.raises(TrainingDataError, match="does not fit"):
        TeacherSeq(torch.tensor([1, 2]), 1, torch.zeros(3, 1, dtype=torch.int32),
                   torch.zeros(3, 1))
    with pytest.raises(ConfigError, match="minutes=0"):
        TrainDrafterConfig(minutes=0)


@pytest.mark.parametrize(("content", "message"), [
    ("", "holds no trace"),
    ("[1, 2]\n", r":1: expected an object"),
    ('{"tokens": [1, 2, 3], "model": "smollm2"}\n', "made for model 'smollm2'"),
    (f'{{"tokens": [1, {TINY_VOCAB}]}}\n', f"token id {TINY_VOCAB} is outside"),
    ('{"text": "hi"}\n', "needs 'tokens' or 'user'"),
    ("{oops\n", r":1: not JSON"),
])
def test_bad_traces_files_are_refused(tiny_model, tmp_path, content, message) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "traces.jsonl"
    path.write_text(content)
    with pytest.raises(TrainingDataError, match=message):
        read_teacher_traces(path, None, "tiny-llama", TINY_VOCAB, tiny_model, 4)
    with pytest.raises(TrainingDataError, match="does not exist"):
        read_teacher_traces(tmp_path / "missing.jsonl", None, "tiny-llama", TINY_VOCAB,
                            tiny_model, 4)


def test_token_traces_become_teacher_sequences(tiny_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "traces.jsonl"
    path.write_text('{"tokens": [5, 6, 7, 8, 9], "prompt_len": 2, "model": "tiny-llama"}\n')
    (seq,) = read_teacher_traces(path, None, "tiny-llama", TINY_VOCAB, tiny_model, 4)
    assert seq.start == 1 and tuple(seq.top_ids.shape) == (3, 4)
    assert torch.equal(seq.top_ids, _teacher(tiny_model, [5, 6, 7, 8, 9], 1).top_ids[:, :4])


def test_draft_vocab_and_prompts_are_deterministic(teacher_data) -> None:  # type: ignore[no-untyped-def]
    a = choose_draft_vocab(teacher_data, 10, TINY_VOCAB, always=[1])
    assert a == choose_draft_vocab(teacher_data, 10, TINY_VOCAB, always=[1]) and a[0] == 1
    assert len(set(choose_draft_vocab(teacher_data, 500, TINY_VOCAB))) == TINY_VOCAB
    held_out = "Explain what a prime number is to a ten-year-old."
    prompts = training_prompts(10_000, seed=3, exclude=[held_out, "What is the moon?"])
    assert prompts == training_prompts(10_000, seed=3, exclude=[held_out, "What is the moon?"])
    assert "What is the moon?" not in prompts and len(prompts) > 500


def test_cli_refuses_bad_settings(capsys) -> None:  # type: ignore[no-untyped-def]
    from agentspec.cli import main

    assert main(["train-drafter", "--minutes", "0"]) != 0
    assert "minutes=0" in capsys.readouterr().err


def test_packaged_artifact_if_present_is_small() -> None:
    from agentspec.drafters.model.distilled import PACKAGED_DIR

    for path in Path(PACKAGED_DIR).glob("*.safetensors"):
        # EAGLE heads: SmolLM2 ~8 MB, Qwen2.5-0.5B ~17 MB (MLP 2,048 wide)
        limit = 24 if path.stem.endswith("-eagle") else 2.5
        assert path.stat().st_size < limit * 2**20
