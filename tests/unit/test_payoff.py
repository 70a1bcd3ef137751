"""The payoff predictor: features, trace replay oracle, session split, MLP save/load, the
source policies and the refusal of bad traces (no model needed except the CLI check)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from agentspec.drafters.suffix.drafter import SuffixConfig, SuffixDrafter
from agentspec.payoff.features import FEATURE_NAMES, NUM_FEATURES, TokenTable, features
from agentspec.payoff.policy import (
    ArcticRule,
    CopyAcceptance,
    CostAwarePolicy,
    ThresholdPolicy,
    best_length,
    expected_accepted,
    fit_copy_acceptance,
    geometric,
    solve_alpha,
)
from agentspec.payoff.predictor import PayoffPredictor, PredictorError
from agentspec.training.payoff_fit import TrainConfig, train_predictor
from agentspec.training.payoff_replay import (
    common_prefix,
    pick_tau,
    prediction_quality,
    replay_trace,
    split_sessions,
)
from agentspec.training.payoff_traces import (
    Trace,
    TraceError,
    TraceSet,
    TraceTurn,
    read_traces,
    write_traces,
)
from agentspec.types import Draft, DraftContext
from tests.conftest import TINY_VOCAB, CharDecoder

F = {name: i for i, name in enumerate(FEATURE_NAMES)}
A = CharDecoder.alphabet
TABLE = TokenTable.from_decode(CharDecoder(), TINY_VOCAB)


def ids(text: str) -> list[int]:
    return [A.index(c) for c in text]


def constant_predictor(value: float, tau: float = 6.0) -> PayoffPredictor:
    """A predictor whose ŷ is ``value`` whatever the features (zero weights, bias)."""
    return PayoffPredictor([0.0] * NUM_FEATURES, [1.0] * NUM_FEATURES,
                           [([[0.0] * NUM_FEATURES], [value])], tau)


# -- features ------------------------------------------------------------------------------

def test_features_shape_and_values() -> None:
    prompt = ids('tool: {"a": 1,\n "b": ')
    out = ids("2, ")
    tokens = prompt + out
    draft = Draft(tokens=ids('"c" '), score=2.5, match_len=3, source="suffix")
    phi = features(tokens, len(prompt), draft, [(4, 4), (5, 1)], TABLE)
    assert len(phi) == NUM_FEATURES == len(FEATURE_NAMES)
    assert phi[F["log_match_len"]] == pytest.approx(math.log1p(3))
    assert phi[F["log_draft_len"]] == pytest.approx(math.log1p(4))
    assert phi[F["log_score"]] == pytest.approx(math.log1p(2.5))
    assert phi[F["score_per_token"]] == pytest.approx(2.5 / 4)
    assert phi[F["log_position"]] == pytest.approx(math.log1p(3))
    assert phi[F["log_prompt_len"]] == pytest.approx(math.log1p(len(prompt)))
    assert phi[F["log_last_accepted"]] == pytest.approx(math.log1p(1))
    assert phi[F["log_mean_accepted"]] == pytest.approx(math.log1p(2.5))
    assert phi[F["full_accept_share"]] == pytest.approx(0.5)
    assert phi[F["inside_json"]] == 1.0  # '{' never closed
    assert phi[F["inside_code"]] == 0.0
    assert phi[F["draft_space_share"]] == pytest.approx(1 / 4)
    assert phi[F["draft_punct_share"]] == pytest.approx(2 / 4)  # the two quotes
    # Tokens since the newline: ' "b": 2, ' = 9 characters.
    assert phi[F["log_newline_dist"]] == pytest.approx(math.log1p(9))
    closed = features(ids('{"a": 1}') + ids(" ok"), 8, Draft(), [], TABLE)
    assert closed[F["inside_json"]] == 0.0 and closed[F["log_draft_len"]] == 0.0


# -- replay --------------------------------------------------------------------------------

def _hand_trace() -> Trace:
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 2, 10, 11]
    return Trace("s1", "wl", [
        TraceTurn(prompt, [12, 13, 14, 99, 5]),
        TraceTurn([50, 13], [14, 99, 5]),  # the history holds "13 14 99 5" from turn 1
    ])


def test_replay_oracle_lengths_on_a_hand_made_trace() -> None:
    trace = _hand_trace()
    # The Python index breaks count ties by recency (the hand-made numbers rely on it).
    cfg = SuffixConfig(backend="python")
    samples = replay_trace(trace, TABLE, max_draft=8, config=cfg)
    assert len(samples) == trace.num_output_tokens == 8
    # Turn 1: "10 11" matches the prompt: draft 12 13 14 15 ... vs truth 12 13 14 99.
    assert samples[0].accepted == 3
    assert samples[3].accepted == 0  # draft continues 15, the truth is 99
    # Turn 2 starts from the history index: 13 -> 14 99 5 is the whole continuation.
    assert samples[5].accepted == 3
    # Every oracle equals a fresh drafter's draft against the true continuation.
    for turn_i, start in ((0, 0), (1, 5)):
        turn = trace.turns[turn_i]
        for p in range(len(turn.output)):
            fresh = SuffixDrafter(cfg)
            if turn_i == 1:
                t0 = trace.turns[0]
                fresh.finish(DraftContext(t0.prompt + t0.output, len(t0.prompt), _ref()))
            ctx = list(turn.prompt) + turn.output[:p]
            d = fresh.propose(DraftContext(ctx, len(turn.prompt), _ref()), 8)
            assert samples[start + p].accepted == common_prefix(d.tokens, turn.output[p:])
    # The cache-only walk: its first step (accepted 3) completes at position 4.
    assert all(s.phi[F["log_last_accepted"]] == 0.0 for s in samples[:4])
    assert samples[4].phi[F["log_last_accepted"]] == pytest.approx(math.log1p(3))


def _ref():  # type: ignore[no-untyped-def]
    from agentspec.types import SessionRef

    return SessionRef("replay")


def test_split_is_by_session_never_by_step() -> None:
    traces = [Trace(f"{wl}-{i}", wl, [TraceTurn([1, 2, 3], [1, 2, 3])])
              for wl in ("a", "b") for i in range(5)]
    train, val = split_sessions(traces, 0.3, seed=0)
    assert train and val and not train & val
    assert train | val == {t.session_id for t in traces}
    assert {s.split("-")[0] for s in val} == {"a", "b"}  # every workload is validated
    assert split_sessions(traces, 0.3, seed=0) == (train, val)  # seeded
    with pytest.raises(ValueError, match="val_fraction"):
        split_sessions(traces, 1.5)


# -- predictor -----------------------------------------------------------------------------

def _synthetic(n: int, seed: int) -> tuple[list[list[float]], list[float]]:
    import random

    rng = random.Random(seed)
    xs = [[rng.random() * 3 for _ in range(NUM_FEATURES)] for _ in range(n)]
    return xs, [2.0 * x[0] + (3.0 if x[9] > 1.5 else 0.0) for x in xs]


def test_residual_predictor_corrects_the_suffix_score(tmp_path: Path) -> None:
    import math

    score = FEATURE_NAMES.index("log_score")
    x, _ = _synthetic(300, 0)
    xv, _ = _synthetic(100, 1)

    def truth(r: list[float]) -> float:  # the tree's score, corrected by a context feature
        return math.expm1(r[score]) + (4.0 if r[9] > 1.5 else -1.0)

    y, yv = [truth(r) for r in x], [truth(r) for r in xv]
    pred = PayoffPredictor.fit(x, y, xv, yv, epochs=300, seed=0)
    assert pred.residual
    as_score = [math.expm1(r[score]) for r in xv]
    err = prediction_quality(pred.predict_many(xv), [round(v) for v in yv], 6).mae
    assert err < 0.4 * prediction_quality(as_score, [round(v) for v in yv], 6).mae
    pred.save(tmp_path / "r.json")
    back = PayoffPredictor.load(tmp_path / "r.json")
    assert back.residual and back.predict(xv[0]) == pytest.approx(pred.predict(xv[0]), abs=1e-3)


def test_predictor_fits_and_round_trips(tmp_path: Path) -> None:
    x, y = _synthetic(300, 0)
    xv, yv = _synthetic(100, 1)
    pred = PayoffPredictor.fit(x, y, xv, yv, epochs=300, seed=0, residual=False)
    mean = sum(y) / len(y)
    assert prediction_quality(pred.predict_many(xv), [round(v) for v in yv], 6).mae < \
        0.65 * prediction_quality([mean] * len(yv), [round(v) for v in yv], 6).mae
    pred.tau, pred.meta = 4.5, {"vocab_size": 96}
    path = tmp_path / "p.json"
    pred.save(path)
    assert path.stat().st_size < 16_000
    back = PayoffPredictor.load(path)
    assert back.tau == 4.5 and back.meta == {"vocab_size": 96}
    for row in xv[:20]:
        assert back.predict(row) == pytest.approx(pred.predict(row), abs=1e-3)
    assert back.predict_many(xv[:5]) == pytest.approx([back.predict(r) for r in xv[:5]],
                                                     abs=1e-4)
    data = json.loads(path.read_text())
    data["features"] = data["features"][:-1]
    path.write_text(json.dumps(data))
    with pytest.raises(PredictorError, match="features"):
        PayoffPredictor.load(path)


def test_pick_tau_and_quality() -> None:
    pred = [0.5, 1.0, 7.0, 8.0, 6.5, 2.0]
    true = [0, 1, 9, 6, 2, 7]
    tau = pick_tau(pred, true)
    q = prediction_quality(pred, true, tau)
    # F1 is best predicting the top four: 3 of 4 are >= 6 and all three positives are found.
    assert tau == 2.0 and q.precision == pytest.approx(3 / 4) and q.recall == 1.0


# -- policies ------------------------------------------------------------------------------

def test_acceptance_model_inverts() -> None:
    for y in (0.3, 2.0, 7.5):
        assert expected_accepted(solve_alpha(y, 12), 12) == pytest.approx(y, abs=1e-6)
    assert solve_alpha(0.0, 5) == 0.0 and solve_alpha(9.0, 5) == 1.0


def test_copy_mixture_matches_the_prediction_and_keeps_likely_copies_whole() -> None:
    # E_n of the fitted mixture is ŷ, above and below the refuted-draft curve G_n(β).
    for y in (0.4, 0.9, 5.0, 20.0, 31.5):
        mix = fit_copy_acceptance(y, 32, 0.5)
        assert mix.expected(32) == pytest.approx(y, abs=1e-6)
        assert (mix.full > 0) == (y > expected_accepted(0.5, 32))
    assert fit_copy_acceptance(0.0, 32, 0.5) == CopyAcceptance(0.0, 0.0)
    # CPU-like c(k) (the embedded model's measured curve, roughly): a copy predicted to be
    # accepted ~13 of 32 tokens is kept whole under the mixture, because a 32-token verify
    # costs little more than a 16-token one. The geometric model alone (one rate solved
    # from the same ŷ) cuts it, which is what lost 18 % on the relay.
    def cpu(k: int) -> float:
        return 0.04 + 0.0019 * k

    k_mix, _ = best_length(fit_copy_acceptance(13.0, 32, 0.5).expected, 32, cpu)
    k_geo, _ = best_length(geometric(solve_alpha(13.0, 32)), 32, cpu)
    assert k_mix == 32 and k_geo < 24
    # A refuted-looking draft is still cut when verification is expensive.
    k_low, _ = best_length(fit_copy_acceptance(0.8, 32, 0.5).expected, 32, lambda k: float(k))
    assert k_low <= 2


def test_cost_aware_policy_learns_the_refuted_rate_from_cache_steps() -> None:
    pol = CostAwarePolicy(constant_predictor(4.0), lambda k: 1.0 + 0.05 * k, miss_rate=0.5)
    for _ in range(40):
        pol.update("cache", 16, 1, 0.0)  # refuted after one token: β -> 1/2
    assert pol.miss_rate == pytest.approx(0.5, abs=0.02)
    for _ in range(40):
        pol.update("cache", 16, 9, 0.0)  # refuted after nine: β -> 0.9
    assert pol.miss_rate > 0.8
    before = pol.miss_rate
    pol.update("cache", 16, 16, 0.0)  # a fully accepted draft is not a refuted sample
    pol.update("model", 4, 0, 0.01)   # nor is a model step
    assert pol.miss_rate == before
    with pytest.raises(ValueError, match="miss_rate"):
        CostAwarePolicy(constant_predictor(1.0), float, miss_rate=0.0)


def test_cost_aware_policy_picks_the_higher_tokens_per_cost_source() -> None:
    def cost(k: int) -> float:
        return 1.0 + 0.05 * k  # CPU-like: long verifies cost little more

    cache = Draft(tokens=list(range(12)), score=3.0, match_len=4, source="suffix")
    phi = [0.0] * NUM_FEATURES
    for y_hat, want in ((10.0, "cache"), (0.2, "model")):
        pol = CostAwarePolicy(constant_predictor(y_hat), cost, model_alpha=0.6)
        choice = pol.choose(cache, 6, phi)
        mix = fit_copy_acceptance(min(y_hat, 12), 12, pol.miss_rate)
        _, rc = best_length(mix.expected, 12, cost)
        _, rm = best_length(geometric(pol.model_alpha), 6, cost)
        assert choice.source == want == ("cache" if rc >= rm else "model")
        assert choice.predicted == pytest.approx(y_hat)
    # Expensive verification truncates a doubtful cache draft at its useful length.
    pol = CostAwarePolicy(constant_predictor(1.5), lambda k: float(k), model_alpha=0.05)
    choice = pol.choose(cache, 6, phi)
    assert choice.source in ("cache", "none") and choice.length < 12
    # The model's acceptance is learned from its verified steps.
    pol = CostAwarePolicy(constant_predictor(0.0), cost, model_alpha=0.6)
    for _ in range(30):
        pol.update("model", 6, 0, 0.6)  # 0.1 s of drafting per token
    assert pol.model_alpha < 0.2
    # A rarely right, costly model draft loses to plain decoding.
    assert pol.choose(Draft(), 6, phi).source == "none"


def test_cost_aware_policy_prices_each_step_at_its_context_length() -> None:
    """With the target's c(k, L), the same draft is verified whole over a short context and
    cut over a long one, where every verified token attends to the whole cache."""
    def flat(k: int) -> float:
        return 1.0  # the quiet curve at one context: verifying 13 tokens costs one step

    def live(k: int, context: int) -> float:
        return 1.0 + k * context / 10_000  # attention over the cache, per verified row

    cache = Draft(tokens=list(range(12)), score=3.0, match_len=4, source="suffix")
    phi = [0.0] * NUM_FEATURES
    pol = CostAwarePolicy(constant_predictor(3.0), flat, context_cost=live)
    short, long = pol.choose(cache, 0, phi, context=100), pol.choose(cache, 0, phi, 40_000)
    assert short.source == "cache" and short.length == 12
    assert long.length < short.length
    mix = fit_copy_acceptance(3.0, 12, pol.miss_rate)
    want, _ = best_length(mix.expected, 12, lambda k: live(k, 40_000))
    rate = (mix.expected(want) + 1) / live(want + 1, 40_000)
    assert long.length == (want if rate > 1 / live(1, 40_000) else 0)
    # Without it the measured curve prices every context alike.
    base = CostAwarePolicy(constant_predictor(3.0), flat)
    assert base.choose(cache, 0, phi, 40_000).length == 12


def test_threshold_and_arctic_rules() -> None:
    cache = Draft(tokens=[1, 2, 3, 4], score=4.0, source="suffix")
    phi = [0.0] * NUM_FEATURES
    assert ThresholdPolicy(constant_predictor(7.0), tau=6.0).choose(cache, 5, phi).source == \
        "cache"
    assert ThresholdPolicy(constant_predictor(2.0), tau=6.0).choose(cache, 5, phi).source == \
        "model"
    rule = ArcticRule()
    assert rule.choose(cache, 4, None).source == "cache"  # score 4 >= model length 4
    assert rule.choose(cache, 5, None).source == "model"
    assert rule.choose(Draft(), 5, None).source == "model"
    with pytest.raises(ValueError, match="model_alpha"):
        CostAwarePolicy(constant_predictor(1.0), float, model_alpha=1.0)


# -- traces and training -------------------------------------------------------------------

def _trace_set(n_sessions: int = 6) -> TraceSet:
    traces = []
    for i in range(n_sessions):
        doc = [(7 * i + j) % 40 + 2 for j in range(30)]
        traces.append(Trace(f"s{i}", "copy" if i % 2 else "edit", [
            TraceTurn([0, *doc, 1], [*doc[:20], i % 5 + 50, *doc[21:]]),
            TraceTurn([0, *doc[5:]], doc[10:]),
        ]))
    return TraceSet("tiny", TINY_VOCAB, "none", traces)


def test_train_predictor_end_to_end_on_synthetic_traces(tmp_path: Path) -> None:
    ts = _trace_set()
    write_traces(ts, tmp_path / "t.jsonl")
    back = read_traces(tmp_path / "t.jsonl", vocab_size=TINY_VOCAB)
    assert back == ts
    pred, report = train_predictor(back, TABLE, TrainConfig(epochs=40), progress=False)
    assert report["rows"]["train"] > 0 and report["rows"]["validation"] > 0
    assert set(report["validation"]) >= {"mae", "rmse", "precision", "recall", "tau"}
    assert pred.meta["vocab_size"] == TINY_VOCAB
    with pytest.raises(TraceError, match="at least 2 sessions"):
        train_predictor(TraceSet("tiny", TINY_VOCAB, "none", ts.traces[:1]), TABLE)


def test_bad_traces_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TraceError, match="empty"):
        read_traces(empty)
    good = tmp_path / "good.jsonl"
    write_traces(_trace_set(2), good)
    with pytest.raises(TraceError, match="vocab_size=96"):
        read_traces(good, vocab_size=49152)
    header, *rows = good.read_text().splitlines()
    h = json.loads(header)
    h["tokenizer"] = "0123abcd"
    (tmp_path / "tok.jsonl").write_text("\n".join([json.dumps(h), *rows]))
    with pytest.raises(TraceError, match="0123abcd"):
        read_traces(tmp_path / "tok.jsonl", vocab_size=96, tokenizer="ffff")
    (tmp_path / "range.jsonl").write_text(header + "\n" + rows[0].replace("[0,", "[500,", 1))
    with pytest.raises(TraceError, match="token id 500"):
        read_traces(tmp_path / "range.jsonl")
    (tmp_path / "none.jsonl").write_text(header + "\n")
    with pytest.raises(TraceError, match="no output tokens"):
        read_traces(tmp_path / "none.jsonl")


def test_train_predictor_cli_help_and_refusal(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from agentspec.cli import main

    with pytest.raises(SystemExit) as done:
        main(["train-predictor", "--help"])
    assert done.value.code == 0 and "--traces" in capsys.readouterr().out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["train-predictor", "--traces", str(empty), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "train-predictor: error" in err and "empty.jsonl" in err and "empty" in err


def test_traced_sessions_leave_out_the_benchmarked_ones() -> None:
    from agentspec.training.payoff_traces import TraceSpec
    from workflows.workloads.training_data import bench_session_ids, select_sessions

    bench = bench_session_ids(["delegate52", "chat"])
    assert len(bench) == 10 and "chat-00" in bench and "delegate52-accounting" in bench
    spec = TraceSpec(workloads=("delegate52", "chat"), limit=2, turns=1, exclude=bench)
    picked = [s.session_id for q in select_sessions(spec) for _, s in q]
    assert len(picked) == 4 and not set(picked) & set(bench)
    assert picked[2:] == ["chat-05", "chat-06"]  # the next ones, in order
    assert spec.cache_key("m", "t") != TraceSpec(workloads=("delegate52", "chat"), limit=2,
                                                 turns=1).cache_key("m", "t")


def test_cost_aware_policy_calibrates_the_predictor_online() -> None:
    """A predictor that overrates (or underrates) drafts on the traffic at hand is rescaled
    by r = Σ y / Σ ŷ over full-length outcomes; other steps leave r alone."""
    cache = Draft(tokens=list(range(20)), score=3.0, match_len=4, source="suffix")
    phi = [0.0] * NUM_FEATURES

    def cost(k: int) -> float:
        return 0.04 + 0.0019 * k

    over = CostAwarePolicy(constant_predictor(6.0), cost)
    assert over.calibration == 1.0
    first = over.choose(cache, 2, phi)
    assert first.raw == first.predicted == 6.0
    for _ in range(30):
        over.outcome(6.0, 1)  # rated 6, right for 1 token
    assert over.calibration < 0.4
    assert over.choose(cache, 2, phi).predicted < 6.0 * 0.4  # ŷ is rescaled
    assert over.choose(cache, 2, phi).raw == 6.0
    under = CostAwarePolicy(constant_predictor(4.0), cost)
    for _ in range(30):
        under.outcome(4.0, 20)  # rated 4, the whole 20-token draft was right
    assert under.calibration > 2.0 and under.choose(cache, 2, phi).length == 20
    for _ in range(200):  # verified steps are not outcomes: r keeps its value
        under.update("model", 2, 1, 0.002)
        under.update("cache", 20, 3, 0.0)
    assert under.calibration > 2.0
    under.outcome(math.nan, 0)  # no prediction: ignored
    assert under.calibration > 2.0
    with pytest.raises(ValueError, match="calibration"):
        CostAwarePolicy(constant_predictor(1.0), cost, calibration_decay=0.0)


def test_cost_aware_policy_falls_back_to_the_cache_score_when_the_predictor_is_off() -> None:
    """A predictor that cannot rank drafts (here: the same ŷ for drafts that copy 20
    tokens and drafts that miss at once), which no scale factor fixes, loses the gate to
    the cache's own score once cutting by the score would have committed more tokens per
    second on recent drafts; the whole 20-token draft is then verified again. While the
    predictor's decisions are the better ones, it keeps the gate."""
    good = Draft(tokens=list(range(20)), score=18.0, match_len=30, source="suffix")
    bad = Draft(tokens=list(range(20)), score=0.5, match_len=1, source="suffix")
    phi = [0.0] * NUM_FEATURES

    def cost(k: int) -> float:
        return 0.04 + 0.0019 * k

    # No margin: the score's edge over whole drafts here is small (c(1) is half of c(21));
    # test_gate_margin_keeps_whole_drafts_against_a_cut_that_only_ties covers the margin.
    policy = CostAwarePolicy(constant_predictor(3.0), cost, gate_margin=0.0)
    assert policy.estimator == "predictor"
    policy.outcome(3.0, 20)  # no score, no length: nothing to compare, the predictor stays
    assert policy.estimator == "predictor"
    for _ in range(10):
        policy.outcome(3.0, 20, good.score, 20)
        policy.outcome(3.0, 0, bad.score, 20)
    assert policy.estimator == "score"
    choice = policy.choose(good, 2, phi)
    assert choice.source == "cache" and choice.length == 20 and choice.predicted > 15
    assert choice.raw == 3.0 and choice.score == 18.0
    assert policy.choose(bad, 2, phi).predicted < 1.0

    trusted = CostAwarePolicy(Ranked(), cost, gate_margin=0.0)  # ŷ = the truth; score reversed
    for _ in range(10):
        trusted.outcome(20.0, 20, 0.5, 20)
        trusted.outcome(0.0, 0, 18.0, 20)
    assert trusted.estimator == "predictor"


def test_gate_margin_keeps_whole_drafts_against_a_cut_that_only_ties() -> None:
    """A cutting rule takes the gate from whole drafts only when it would have committed
    more than ``1 + gate_margin`` times their tokens per second: with the default 10 %,
    the score's 4 % edge above keeps whole drafts; a 25 % edge (drafts that miss cost
    more to verify whole) hands the gate to the score."""
    good = Draft(tokens=list(range(20)), score=18.0, match_len=30, source="suffix")
    bad = Draft(tokens=list(range(20)), score=0.5, match_len=1, source="suffix")
    phi = [0.0] * NUM_FEATURES

    def flat(k: int) -> float:
        return 0.04 + 0.0019 * k

    def steep(k: int) -> float:
        return 0.04 + 0.01 * k

    for cost, gate in ((flat, "whole"), (steep, "score")):
        policy = CostAwarePolicy(constant_predictor(3.0), cost)
        for _ in range(10):
            policy.outcome(3.0, 20, good.score, 20)
            policy.outcome(3.0, 0, bad.score, 20)
        assert policy.estimator == gate, cost.__name__
        assert policy.choose(good, 2, phi).length == 20
        worse = policy.choose(bad, 2, phi)  # whole: verified; score: the model drafts
        assert (worse.source, worse.length) == (("cache", 20) if gate == "whole" else
                                                ("model", 2))
    with pytest.raises(ValueError, match="gate_margin"):
        CostAwarePolicy(constant_predictor(3.0), flat, gate_margin=1.0)


def test_cost_aware_policy_verifies_whole_drafts_when_every_estimate_cuts_too_much() -> None:
    """When both estimates rate drafts far below what they turn out to copy (more than
    calibration's clip can fix), verifying them whole, as the ungated cache does, would
    have committed the most tokens per second: the policy gates that way until the
    estimates catch up."""
    draft = Draft(tokens=list(range(20)), score=0.1, match_len=2, source="suffix")
    phi = [0.0] * NUM_FEATURES

    def cost(k: int) -> float:
        return 0.04 + 0.0019 * k

    policy = CostAwarePolicy(constant_predictor(0.1), cost)
    assert policy.choose(draft, 0, phi).length < 20  # cut (or not verified) at first
    for _ in range(10):
        policy.outcome(0.1, 20, draft.score, 20)
    assert policy.estimator == "whole"
    choice = policy.choose(draft, 2, phi)
    assert choice.source == "cache" and choice.length == 20


class Ranked:
    """A stand-in predictor (only ``predict`` is read by the policy)."""

    def predict(self, phi: list[float] | None) -> float:
        return 0.0


def test_a_model_draft_needs_the_margin_to_displace_a_cache_draft() -> None:
    """The model drafter takes a step from a cache draft that would be verified only with
    ``gate_margin``'s edge: there are model acceptance rates at which a policy without the
    margin drafts with the model and one with it keeps the cache draft; a clearly better
    model still wins, and with no cache draft the model competes with plain decoding only."""
    draft = Draft(tokens=list(range(8)), score=2.0, match_len=3, source="suffix")
    phi = [0.0] * NUM_FEATURES

    def cost(k: int) -> float:
        return 0.04 + 0.0019 * k

    def source(alpha: float, margin: float, cache: Draft) -> str:
        policy = CostAwarePolicy(constant_predictor(2.0), cost, model_alpha=alpha,
                                 gate_margin=margin)
        return policy.choose(cache, 6, phi).source

    alphas = [i / 100 for i in range(5, 100)]
    without = [a for a in alphas if source(a, 0.0, draft) == "model"]
    with_margin = [a for a in alphas if source(a, 0.1, draft) == "model"]
    assert without and with_margin and min(with_margin) > min(without)
    assert set(with_margin) <= set(without)
    # Against plain decoding (no cache draft) the margin does not apply.
    assert [a for a in alphas if source(a, 0.1, Draft(source="suffix")) == "model"] == [
        a for a in alphas if source(a, 0.0, Draft(source="suffix")) == "model"]
