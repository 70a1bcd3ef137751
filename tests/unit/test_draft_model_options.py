"""``--draft-model`` on bench, drive and serve: parsed, carried into the methods' agent specs
and the server's default policy, refused where no method drafts with a model."""

from __future__ import annotations

import pytest

from adapters.openai_server.cli import serve_spec
from agentspec.cli.console import build_parser
from agentspec.errors import ConfigError
from workflows.bench.methods import method_spec


def test_bench_and_drive_take_a_draft_model() -> None:
    parser = build_parser()
    bench = parser.parse_args(["bench", "--methods", "hybrid", "--draft-model", "qwen"])
    assert bench.draft_model == "qwen"
    drive = parser.parse_args(["drive", "--methods", "hybrid", "--draft-model", "/m"])
    assert drive.draft_model == "/m"
    assert parser.parse_args(["bench"]).draft_model is None  # the target's own choice


def test_the_methods_that_draft_with_a_model_carry_it() -> None:
    assert method_spec("hybrid", draft_model="qwen").drafting.draft_model == "qwen"
    assert method_spec("model", draft_model="qwen").drafting.draft_model == "qwen"
    assert method_spec("suffix", draft_model="qwen").drafting.draft_model is None
    assert method_spec("hybrid").drafting.draft_model is None


def test_serve_takes_a_drafting_method_and_its_draft_model() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--drafting", "hybrid", "--draft-model", "qwen"])
    spec = serve_spec(args)
    assert spec.drafting.method == "hybrid" and spec.drafting.draft_model == "qwen"
    assert serve_spec(parser.parse_args(["serve"])).drafting.method == "suffix"
    with pytest.raises(ConfigError, match="--draft-model 'qwen' drafts under"):
        serve_spec(parser.parse_args(["serve", "--draft-model", "qwen"]))
