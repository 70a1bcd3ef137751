"""The vLLM adapter's pure parts (no vLLM needed): request ids, the speculative-config
mapping, counter arithmetic, and the proposer driven the way vLLM 0.32 drives it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from adapters.vllm.proposer import AgentSpecProposer
from adapters.vllm.request_ids import decode_request_id, encode_request_id
from adapters.vllm.speculative import PROPOSER_CLASS, speculative_config
from adapters.vllm.stats import SpecCounters, read_counters, request_stats
from agentspec.errors import AgentSpecError, ConfigError
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.types import SessionRef

MAX_LEN = 512


def _spec(method: str, **kw: Any) -> AgentSpec:
    return AgentSpec(drafting=DraftingPolicy(method=method, **kw))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- request ids
def test_request_id_round_trip_through_vllm_wrapping() -> None:
    ref = SessionRef("run-42", tenant="acme", agent="coder")
    rid = encode_request_id(ref, nonce="abc")
    assert rid == "agentspec|acme|coder|run-42|abc"
    # vLLM's OpenAI server prefixes, the engine appends a random suffix.
    assert decode_request_id(f"chatcmpl-{rid}-1a2b3c4d") == ref
    assert decode_request_id(encode_request_id(None)) is None
    assert decode_request_id("cmpl-123") is None
    assert decode_request_id("agentspec|bad tenant|a|s|n") is None


def test_request_id_rejects_bad_nonce() -> None:
    with pytest.raises(ConfigError, match=r"a\|b"):
        encode_request_id(None, nonce="a|b")


# --------------------------------------------------------------------------- mapping
def test_speculative_config_mapping() -> None:
    assert speculative_config(_spec("none")) is None
    ngram = speculative_config(_spec("prompt_lookup", max_draft=10))
    assert ngram is not None and ngram["method"] == "ngram"
    assert ngram["num_speculative_tokens"] == 10
    assert ngram["prompt_lookup_min"] <= ngram["prompt_lookup_max"]
    suffix = speculative_config(_spec("suffix", max_draft=24))
    assert suffix is not None and suffix["method"] == "suffix"
    assert suffix["num_speculative_tokens"] == 24
    custom = speculative_config(_spec("suffix", max_draft=24), proposer="agentspec")
    assert custom == {"method": "custom_class", "model": PROPOSER_CLASS,
                      "num_speculative_tokens": 24}


@pytest.mark.parametrize(
    ("spec", "proposer", "needle"),
    [
        (_spec("hybrid"), "vllm", "hybrid"),
        (_spec("suffix"), "sglang", "sglang"),
        (_spec("prompt_lookup"), "agentspec", "prompt_lookup"),
        (_spec("model"), "vllm", "draft_model=None"),
    ],
)
def test_speculative_config_misuse_names_the_value(
    spec: AgentSpec, proposer: str, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        speculative_config(spec, proposer)
    assert isinstance(info.value, AgentSpecError)


@pytest.mark.parametrize(("arch", "method"), [("LlamaForCausalLMEagle3", "eagle3"),
                                              ("LlamaForCausalLM", "draft_model")])
def test_model_drafting_picks_eagle3_or_draft_model(
    tmp_path: Path, arch: str, method: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    cfg = speculative_config(_spec("model", draft_model=str(tmp_path), max_draft=32))
    assert cfg == {"method": method, "model": str(tmp_path), "num_speculative_tokens": 8}


# --------------------------------------------------------------------------- counters
def test_request_stats_from_counter_difference() -> None:
    before = SpecCounters(10, 100, 40, (9, 7, 5))
    # This request: 4 drafts of 8 tokens; accepted 0, 2, 3, 3 -> per_pos (3, 3, 2).
    after = SpecCounters(14, 132, 48, (12, 10, 7))
    stats = request_stats(after - before, prompt_tokens=50, generated=20, total_s=2.0,
                          source="x")
    # 20 tokens - 8 accepted = 12 steps: 8 without a draft + 1 miss, then 2, 3, 3.
    assert stats.accepted_histogram() == {0: 9, 2: 1, 3: 2}
    assert stats.forwards == 12 and stats.generated_tokens == 20
    assert sum(s.committed for s in stats.steps) == 20
    plain = request_stats(SpecCounters(), 50, 20, 1.0, "none")
    assert plain.forwards == 20 and plain.mean_accepted_len == 1.0


def test_prefix_cache_counters_give_cached_prompt_tokens() -> None:
    """vLLM's prefix-cache counters (with or without ``_total``) are read and differenced;
    a request's hits become its ``cached_prompt_tokens``."""
    metric = SimpleNamespace
    before = read_counters([metric(name="vllm:prefix_cache_queries", value=100),
                            metric(name="vllm:prefix_cache_hits", value=40),
                            metric(name="vllm:spec_decode_num_drafts", value=3)])
    after = read_counters([metric(name="vllm:prefix_cache_queries_total", value=300),
                           metric(name="vllm:prefix_cache_hits_total", value=224),
                           metric(name="vllm:spec_decode_num_drafts", value=3)])
    delta = after - before
    assert (delta.prefix_queries, delta.prefix_hits) == (200, 184)
    assert delta.prefix_hit_rate == pytest.approx(0.92)
    assert request_stats(delta, 200, 5, 1.0, "x").cached_prompt_tokens == 184


def test_engine_settings_keep_prefix_caching_on() -> None:
    from adapters.vllm.backend import EngineSettings

    assert EngineSettings().llm_kwargs()["enable_prefix_caching"] is True
    off = EngineSettings(extra={"enable_prefix_caching": False}).llm_kwargs()
    assert off["enable_prefix_caching"] is False


# --------------------------------------------------------------------------- proposer
class _Batch:
    def __init__(self) -> None:
        self.req_ids: list[str] = []
        self.num_prompt_tokens = np.zeros(4, dtype=np.int32)


class FakeModelRunner:
    """Builds the proposer from its ``__init__``, as vLLM's model runner does."""

    def __init__(self, k: int = 8) -> None:
        self.input_batch = _Batch()
        config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                                 model_config=SimpleNamespace(max_model_len=MAX_LEN))
        self.drafter = AgentSpecProposer(config)
        self.rows = np.zeros((4, MAX_LEN), dtype=np.int32)
        self.lens = np.zeros(4, dtype=np.int32)

    def start(self, row: int, rid: str, prompt: list[int]) -> None:
        while len(self.input_batch.req_ids) <= row:
            self.input_batch.req_ids.append("")
        self.input_batch.req_ids[row] = rid
        self.input_batch.num_prompt_tokens[row] = len(prompt)
        self.rows[row, : len(prompt)] = prompt
        self.lens[row] = len(prompt)

    def step(self, committed: dict[int, list[int]]) -> list[list[int]]:
        """Commit tokens per row, then ask for drafts (rows absent: still prefilling)."""
        sampled: list[list[int]] = []
        for row in range(len(self.input_batch.req_ids)):
            toks = committed.get(row, [])
            n = int(self.lens[row])
            self.rows[row, n : n + len(toks)] = toks
            self.lens[row] = n + len(toks)
            sampled.append(toks)
        return self.drafter.propose(sampled, self.lens, self.rows)

    def end(self) -> None:
        self.input_batch.req_ids = []


DOC = [int(t) for t in np.random.default_rng(0).integers(100, 400, size=40)]
PROMPT = [1, 2, 3, *DOC[:10], 4]


def test_proposer_finds_its_runner_and_learns_a_session() -> None:
    runner = FakeModelRunner()
    proposer = runner.drafter
    assert proposer.runner is runner
    ref = SessionRef("s1", tenant="t")
    runner.start(0, encode_request_id(ref) + "-0000abcd", PROMPT)
    out = DOC[10:]
    for tok in out:
        drafts = runner.step({0: [tok]})
        assert len(drafts) == 1 and len(drafts[0]) <= 8
    runner.end()
    runner.start(0, encode_request_id(ref), PROMPT)  # next turn of the same session
    first = runner.step({0: [out[0]]})
    assert first[0] == out[1:9]  # drafted from the first turn, kept in the history
    assert proposer.stats.finished == 1 and proposer.stats.sessions == {"t/default/s1"}


def _drafts_alone(rid: str, prompt: list[int], out: list[int]) -> list[list[int]]:
    runner = FakeModelRunner()
    runner.start(0, rid, prompt)
    return [runner.step({0: [tok]})[0] for tok in out]


def test_proposer_keeps_two_requests_of_one_session_apart() -> None:
    # Two in-flight requests of one session, interleaved step by step in one batch, each
    # draft exactly what they draft alone, and each keeps one request index throughout
    # (keyed by vLLM request id, not rebuilt because the other request ran in between).
    ref = SessionRef("s1", tenant="t")
    rid_a, rid_b = encode_request_id(ref, nonce="aaaa"), encode_request_id(ref, nonce="bbbb")
    prompt_a, out_a = [1, *DOC[:20], 2], DOC[:20]
    prompt_b, out_b = [3, *DOC[20:], *DOC[5:15], 4], [*DOC[20:], *DOC[5:15]]
    alone_a = _drafts_alone(rid_a, prompt_a, out_a)
    alone_b = _drafts_alone(rid_b, prompt_b, out_b)
    assert any(alone_a) and any(alone_b)
    runner = FakeModelRunner()
    runner.start(0, rid_a, prompt_a)
    runner.start(1, rid_b, prompt_b)
    got_a, got_b = [], []
    for i in range(max(len(out_a), len(out_b))):
        committed = {}
        if i < len(out_a):
            committed[0] = [out_a[i]]
        if i < len(out_b):
            committed[1] = [out_b[i]]
        drafts = runner.step(committed)
        if i < len(out_a):
            got_a.append(drafts[0])
        if i < len(out_b):
            got_b.append(drafts[1])
    assert got_a == alone_a and got_b == alone_b
    drafter = runner.drafter.drafter
    assert drafter.requests_started == 2
    assert drafter.stats()["active_requests"] == 2


def test_proposer_isolates_sessions_and_anonymous_requests() -> None:
    runner = FakeModelRunner()
    ref = SessionRef("s1", tenant="t")
    runner.start(0, encode_request_id(ref), PROMPT)
    for tok in DOC[10:]:
        runner.step({0: [tok]})
    runner.end()
    for rid in (encode_request_id(SessionRef("s1", tenant="other")), "cmpl-anonymous"):
        runner.start(0, rid, PROMPT)
        assert runner.step({0: [DOC[10]]}) == [[]]  # nothing to copy from another tenant
        runner.end()


def test_proposer_batches_rows_and_skips_prefill_rows() -> None:
    runner = FakeModelRunner(k=4)
    runner.start(0, "a", PROMPT + PROMPT[:3])
    runner.start(1, "b", PROMPT)
    drafts = runner.step({0: [PROMPT[3]]})  # row 1 still prefilling: no sampled tokens
    assert drafts[0] == PROMPT[4:8] and drafts[1] == []


def test_proposer_gate_withholds_low_score_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTSPEC_VLLM_MIN_SCORE", "1000")
    runner = FakeModelRunner()
    runner.start(0, "a", PROMPT + PROMPT[:3])
    assert runner.step({0: [PROMPT[3]]}) == [[]]
    assert runner.drafter.stats.gated == 1


def test_proposer_bad_env_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTSPEC_VLLM_MIN_SCORE", "lots")
    with pytest.raises(ConfigError, match="lots"):
        FakeModelRunner()


def test_proposer_drafts_chains_and_reads_the_spec_offset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    default = FakeModelRunner().drafter.drafter.config
    assert default.tree is False and default.max_spec_offset == 8.0  # vLLM verifies chains
    monkeypatch.setenv("AGENTSPEC_VLLM_SPEC_OFFSET", "0")
    assert FakeModelRunner().drafter.drafter.config.max_spec_offset == 0.0
    for bad in ("far", "nan"):
        monkeypatch.setenv("AGENTSPEC_VLLM_SPEC_OFFSET", bad)
        with pytest.raises(ConfigError, match="AGENTSPEC_VLLM_SPEC_OFFSET"):
            FakeModelRunner()


def test_proposer_outputs_index_shares_answers_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """``AGENTSPEC_VLLM_OUTPUTS=1``: a request drafts from another session's answer while
    that answer is still being generated (vLLM commits the tokens; the proposer only sees
    longer rows). Without it the other request has nothing to draft from."""
    fresh = [int(t) for t in np.random.default_rng(1).integers(500, 900, size=30)]
    for flag, expect in (("1", fresh[10:18]), ("0", [])):
        monkeypatch.setenv("AGENTSPEC_VLLM_OUTPUTS", flag)
        runner = FakeModelRunner()
        runner.start(0, encode_request_id(SessionRef("s1", tenant="t"), nonce="aaaa"), [1, 2])
        for tok in fresh:  # session s1 generates `fresh`, still in flight
            runner.step({0: [tok]})
        runner.start(1, encode_request_id(SessionRef("s2", tenant="t"), nonce="bbbb"),
                     [5, 6, *fresh[:9]])
        drafts = runner.step({0: [7], 1: [fresh[9]]})
        assert drafts[1] == expect, flag
    monkeypatch.setenv("AGENTSPEC_VLLM_OUTPUTS", "yes")
    with pytest.raises(ConfigError, match="AGENTSPEC_VLLM_OUTPUTS"):
        FakeModelRunner()


def test_proposer_without_runner_tracks_rows_by_content() -> None:
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4),
                             model_config=SimpleNamespace(max_model_len=MAX_LEN))
    proposer = AgentSpecProposer(config, runner=object())
    rows = np.zeros((1, MAX_LEN), dtype=np.int32)
    seq = PROMPT + PROMPT[:3]
    rows[0, : len(seq)] = seq
    assert proposer.propose([[seq[-1]]], np.array([len(seq)]), rows) == [PROMPT[3:7]]
    other = [9, 9, 9, 9, 9, 8]
    rows[0, :] = 0
    rows[0, : len(other)] = other
    assert proposer.propose([[8]], np.array([len(other)]), rows) == [[]]  # a new request


# --------------------------------------------------------------------------- serve CLI
def test_serve_cli_parses_engine_arguments() -> None:
    from adapters.vllm.serve import build_parser

    args = build_parser().parse_args([
        "serve", "--proposer", "vllm", "--drafting", "prompt_lookup", "--max-draft", "8",
        "--tensor-parallel-size", "4", "--distributed-executor-backend", "ray",
    ])
    assert (args.proposer, args.drafting, args.max_draft) == ("vllm", "prompt_lookup", 8)
    assert args.tensor_parallel_size == 4 and args.distributed_executor_backend == "ray"
    assert args.host == "127.0.0.1"  # local-only unless keys are given


def test_serve_cli_refuses_public_bind_without_keys(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from adapters.vllm.serve import main

    monkeypatch.delenv("AGENTSPEC_API_KEYS", raising=False)
    assert main(["--host", "0.0.0.0"]) == 2  # before any engine starts
    assert "0.0.0.0" in capsys.readouterr().err


# --------------------------------------------------------------------------- payoff gate
def _constant_predictor(y: float) -> Any:
    from agentspec.payoff.features import NUM_FEATURES
    from agentspec.payoff.predictor import PayoffPredictor

    return PayoffPredictor([0.0] * NUM_FEATURES, [1.0] * NUM_FEATURES,
                           [([[0.0] * NUM_FEATURES], [y])])


# (ŷ, verify cost per draft token relative to a plain step, expected length): a middling
# prediction is cut when draft tokens are dear, and kept whole when they are cheap (a copy
# predicted at 2 of 8 tokens may well be a copy accepted to its end; see the policy's
# mixture acceptance model).
@pytest.mark.parametrize(("y_hat", "per_token", "expected"),
                         [(0.0, 0.04, 0), (2.0, 0.3, None), (2.0, 0.04, 8), (100.0, 0.04, 8)])
def test_payoff_gate_cuts_drafts_to_their_useful_length(
    y_hat: float, per_token: float, expected: int | None
) -> None:
    from adapters.vllm.payoff_gate import PayoffGate
    from agentspec.payoff.features import TokenTable

    runner = FakeModelRunner(k=8)
    runner.drafter.gate = PayoffGate(_constant_predictor(y_hat), TokenTable.blank(1000),
                                     cost_per_token=per_token)
    runner.start(0, "a", PROMPT + PROMPT[:3])
    (draft,) = runner.step({0: [PROMPT[3]]})
    if expected is None:  # a middling prediction: a shorter, cost-effective draft
        assert 0 < len(draft) < 8
    else:
        assert len(draft) == expected
    assert draft == PROMPT[4 : 4 + len(draft)]
    runner.step({0: PROMPT[4:6]})  # vLLM accepted one draft token, then sampled its own
    assert runner.drafter.stats.accepted == min(len(draft), 1)


def test_payoff_gate_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    from adapters.vllm.payoff_gate import PayoffGate

    assert PayoffGate.from_env(None) is None  # off by default
    monkeypatch.setenv("AGENTSPEC_VLLM_PAYOFF", "always")
    with pytest.raises(ConfigError, match="always"):
        PayoffGate.from_env(None)


def test_payoff_gate_reads_a_measured_cost_curve(tmp_path: Path) -> None:
    """``AGENTSPEC_VLLM_COST_CURVE``: ``{"k": cost}`` (or an agentspec cost file's curve),
    interpolated between the measured points; the curve decides the cut."""
    from adapters.vllm.payoff_gate import PayoffGate, load_cost_curve
    from agentspec.payoff.features import TokenTable
    from agentspec.targets.cost.costs import COST_POINTS

    bare = tmp_path / "curve.json"
    bare.write_text(json.dumps({"1": 1.0, "2": 1.1, "8": 1.7}))
    assert load_cost_curve(bare) == {1: 1.0, 2: 1.1, 8: 1.7}
    stored = tmp_path / "model.json"  # as agentspec stores a target's measured curves
    seconds = {str(k): 0.01 * (1 + k / 32) for k in COST_POINTS}
    stored.write_text(json.dumps({"forms": {}, "costs": seconds, "torch": "x"}))
    assert load_cost_curve(stored) == {int(k): v for k, v in seconds.items()}
    gate = PayoffGate(_constant_predictor(2.0), TokenTable.blank(1000),
                      curve=load_cost_curve(bare))
    assert gate.policy.cost(5) == pytest.approx(1.4)  # between 2 and 8
    assert gate.policy.cost(10) == pytest.approx(1.9)  # along the last slope
    for curve, want in (({1: 1.0, 64: 1.0}, 8), ({1: 1.0, 2: 4.0}, 0)):  # free / dear
        runner = FakeModelRunner(k=8)
        runner.drafter.gate = PayoffGate(_constant_predictor(2.0), TokenTable.blank(1000),
                                         curve=curve)
        runner.start(0, "a", PROMPT + PROMPT[:3])
        (draft,) = runner.step({0: [PROMPT[3]]})
        assert len(draft) == want, curve


@pytest.mark.parametrize(("text", "needle"), [
    (None, "cannot read"),
    ("{not json", "not JSON"),
    ("[1.0, 1.1]", "JSON object"),
    ("{}", "at least one point"),
    ('{"one": 1.0}', "'one'"),
    ('{"0": 1.0}', "'0'"),
    ('{"1": -1.0}', "-1.0"),
    ('{"1": "fast"}', "'fast'"),
    ('{"1": true}', "True"),
    ('{"1": NaN}', "nan"),
])
def test_payoff_gate_refuses_a_malformed_cost_curve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str | None, needle: str
) -> None:
    from adapters.vllm.payoff_gate import PayoffGate, load_cost_curve

    path = tmp_path / "curve.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=needle) as info:
        load_cost_curve(path)
    assert str(path) in str(info.value)
    # The environment's curve is read (and refused) before any tokenizer is loaded.
    monkeypatch.setenv("AGENTSPEC_VLLM_PAYOFF", "cost_aware")
    monkeypatch.setenv("AGENTSPEC_VLLM_COST_CURVE", str(path))
    with pytest.raises(ConfigError, match="AGENTSPEC_VLLM_COST_CURVE"):
        PayoffGate.from_env(None)


def test_payoff_gate_refuses_two_cost_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adapters.vllm.payoff_gate import PayoffGate
    from agentspec.payoff.features import TokenTable

    with pytest.raises(ConfigError, match="not both"):
        PayoffGate(_constant_predictor(1.0), TokenTable.blank(10), 0.04, {1: 1.0})
    monkeypatch.setenv("AGENTSPEC_VLLM_PAYOFF", "cost_aware")
    monkeypatch.setenv("AGENTSPEC_VLLM_COST_PER_TOKEN", "0.01")
    monkeypatch.setenv("AGENTSPEC_VLLM_COST_CURVE", str(tmp_path / "curve.json"))
    with pytest.raises(ConfigError, match=r"AGENTSPEC_VLLM_COST_PER_TOKEN.*not both"):
        PayoffGate.from_env(None)


def test_proposer_persists_sessions_in_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTSPEC_VLLM_STORE", str(tmp_path / "sessions.sqlite3"))
    ref = SessionRef("s1", tenant="t")
    first = FakeModelRunner()
    first.start(0, encode_request_id(ref), PROMPT)
    for tok in DOC[10:]:
        first.step({0: [tok]})
    first.drafter.finish_all()
    second = FakeModelRunner()  # a restarted worker: the history comes from the store
    second.start(0, encode_request_id(ref), PROMPT)
    assert second.step({0: [DOC[10]]}) == [DOC[11:19]]
