"""The one factory on the embedded model: ``Runtime.chat`` with a multi-draft spec runs the
multi-draft loop (and says the same as greedy decoding), and the benchmark's ``hybrid``
method is the product's HVD drafter (shipped EAGLE head and predictor) for the same spec."""

from __future__ import annotations

from typing import Any

import pytest

from agentspec.drafters.hybrid import HybridDrafter
from agentspec.drafters.multi import IIDDrafts
from agentspec.engine import EngineConfig
from agentspec.multi_engine import MultiDraftDecoder
from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec, VerifierPolicy
from agentspec.targets.hf import HFTarget
from agentspec.types import SessionRef
from workflows.bench.methods import MethodContext, build_method, method_spec

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": 'Repeat exactly: {"name": "config", "retries": 3, '
                                        '"retries_max": 3, "name_alias": "config"}'}]


def test_runtime_chat_runs_the_multi_draft_decoder(
    embedded_target: HFTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = Runtime(embedded_target)
    built: list[Any] = []
    engine_for = rt.engine_for
    monkeypatch.setattr(rt, "engine_for", lambda spec: built.append(engine_for(spec))
                        or built[-1])
    multi = AgentSpec(verifier=VerifierPolicy(sampler="multi_draft", num_drafts=2))
    got = rt.chat(MESSAGES, spec=multi, max_tokens=40, session=SessionRef("multi"))
    engine = built[-1]
    assert isinstance(engine, MultiDraftDecoder) and engine.num_drafts == 2
    assert isinstance(engine.multi_drafter, IIDDrafts)
    assert engine.multi_drafter.calls > 0  # steps went through the K-draft path
    ref = rt.chat(MESSAGES, max_tokens=40, session=SessionRef("single"))
    assert not isinstance(built[-1], MultiDraftDecoder)
    assert got.tokens == ref.tokens  # lossless: greedy requests stay greedy
    assert got.stats.mean_accepted_len > 0


def test_bench_hybrid_is_the_products_hybrid(embedded_target: HFTarget) -> None:
    bench = build_method("hybrid", MethodContext(embedded_target,
                                                 engine=EngineConfig(max_draft=32)))
    product = Runtime(embedded_target).drafter_for(method_spec("hybrid", 32))
    mine = bench.drafter  # type: ignore[attr-defined]
    assert isinstance(mine, HybridDrafter) and isinstance(product, HybridDrafter)
    assert type(mine.model) is type(product.model)
    assert mine.model.config == product.model.config  # type: ignore[attr-defined]
    assert mine.cache.config == product.cache.config  # type: ignore[attr-defined]
    assert type(mine.policy) is type(product.policy) and mine.model_max == product.model_max
