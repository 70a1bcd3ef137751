"""Per-model HVD artifacts: a narrowed EAGLE head round-trips, and each target finds its own
payoff predictor (the user's, then the packaged one, then the embedded model's default)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from agentspec.drafters.model.distilled import embedding_checksum
from agentspec.drafters.model.eagle import build_head, load_eagle, save_eagle
from agentspec.drafters.model.eagle_head import HeadSpec
from agentspec.errors import ConfigError
from agentspec.payoff import defaults
from agentspec.payoff.predictor import PredictorError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_narrowed_head_round_trips_with_its_width(tiny_target: Any, tmp_path: Path) -> None:
    model = tiny_target.model
    vocab = tuple(range(model.config.vocab_size))
    spec = HeadSpec.for_target(model, vocab, "tiny-llama", embedding_checksum(model),
                               intermediate=24)
    assert spec.intermediate == 24 != model.config.intermediate_size
    head = build_head(model, spec)
    head.init_identity(1)
    assert head.up_proj.weight.shape == (24, spec.hidden)
    save_eagle(tmp_path / "h.safetensors", head)
    loaded = load_eagle(tiny_target, tmp_path / "h.safetensors")
    assert loaded.head.spec.intermediate == 24
    for k, v in head.trained_state().items():
        torch.testing.assert_close(loaded.head.trained_state()[k], v.half().float())
    with pytest.raises(ConfigError, match="intermediate=0"):
        HeadSpec.for_target(model, vocab, "tiny-llama", 0.0, intermediate=0)


def test_each_target_finds_its_own_predictor(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path / "home"))
    packaged = tmp_path / "packaged"
    packaged.mkdir()
    monkeypatch.setattr(defaults, "PACKAGED_PREDICTORS", packaged)
    target = SimpleNamespace(name="some-model", vocab_size=10, tokenizer=None)
    assert defaults.predictor_path(target) == defaults.DEFAULT_PREDICTOR
    (packaged / "some-model.json").write_text("{}")
    assert defaults.predictor_path(target) == packaged / "some-model.json"
    own = tmp_path / "home" / "payoff" / "some-model.json"
    own.parent.mkdir(parents=True)
    own.write_text("{}")
    assert defaults.predictor_path(target) == own  # the user's retrained one wins
    # A name that is a path never selects a file outside the two folders.
    assert defaults.predictor_path(SimpleNamespace(name="../x")) == defaults.DEFAULT_PREDICTOR
    # The packaged default still refuses a target of another vocabulary, naming the file.
    with pytest.raises(PredictorError, match=r"default_predictor\.json"):
        defaults.load_predictor(SimpleNamespace(name="other", vocab_size=10, tokenizer=None))


def test_a_model_of_the_same_tokenizer_shares_its_familys_predictor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with no predictor of its own (the 1.5B) takes one shipped for a model with
    the same tokenizer (the 0.5B's); another tokenizer's is never taken, nor a damaged file."""
    from agentspec.payoff.predictor import PayoffPredictor

    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path / "home"))
    packaged = tmp_path / "packaged"
    packaged.mkdir()
    monkeypatch.setattr(defaults, "PACKAGED_PREDICTORS", packaged)
    monkeypatch.setattr(defaults, "tokenizer_fingerprint",
                        lambda tok: "none" if tok is None else f"fp-{tok}")
    source = PayoffPredictor.load(defaults.DEFAULT_PREDICTOR)
    for name, fingerprint in (("other-family", "fp-b"), ("small-sibling", "fp-a")):
        source.meta = {**source.meta, "tokenizer": fingerprint}
        source.save(packaged / f"{name}.json")
    (packaged / "a-damaged.json").write_text("{")
    big = SimpleNamespace(name="big-sibling", vocab_size=10, tokenizer="a")
    assert defaults.predictor_path(big) == packaged / "small-sibling.json"
    alien = SimpleNamespace(name="alien", vocab_size=10, tokenizer="c")
    assert defaults.predictor_path(alien) == defaults.DEFAULT_PREDICTOR
    assert defaults.predictor_path(SimpleNamespace(name="x", tokenizer=None)) == \
        defaults.DEFAULT_PREDICTOR
