"""The EAGLE drafter on the tiny model: feature plumbing, the head's cache, losslessness,
training and artifacts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agentspec.drafters.model.eagle import (
    EagleConfig,
    EagleDrafter,
    build_head,
    load_eagle,
    save_eagle,
)
from agentspec.drafters.model.eagle_head import HeadSpec
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError, ModelLoadError, RequestStateError
from agentspec.training.eagle import TrainEagleConfig, extract_features, train_head
from agentspec.types import DraftContext
from tests.conftest import run_interleaved

pytestmark = pytest.mark.usefixtures("one_thread")


def _head(model: Any, seed: int = 0) -> Any:
    from agentspec.drafters.model.distilled import embedding_checksum

    torch.manual_seed(seed)
    vocab = tuple(range(model.config.vocab_size))
    spec = HeadSpec.for_target(model, vocab, "tiny-llama", embedding_checksum(model))
    head = build_head(model, spec)
    head.init_identity(seed)
    return head.eval()


class _Recorder:
    """A FeatureDrafter that drafts nothing and records each position's feature row."""

    name = "recorder"
    wants_features = True

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}
        self.starts: list[int] = []

    def observe_features(self, ctx: DraftContext, start: int, features: torch.Tensor) -> None:
        self.starts.append(start)
        for i in range(features.shape[0]):
            self.rows[start + i] = features[i]

    def propose(self, ctx: DraftContext, max_tokens: int) -> Any:
        from agentspec.types import Draft

        # Draft the true greedy continuation's first tokens sometimes wrong: a fixed guess.
        return Draft(tokens=[(len(ctx.tokens) * 7) % 96, 3, 5][:max_tokens], source="guess")

    def observe(self, ctx: Any, result: Any) -> None: ...

    def finish(self, ctx: Any) -> None: ...


def test_target_features_match_a_full_forward(tiny_target: Any, tiny_model: Any) -> None:
    """The engine feeds exactly the committed positions' final-norm hidden states, in order,
    through prefill, partial accepts and rollbacks."""
    rec = _Recorder()
    eng = SpeculativeDecoder(tiny_target, rec, config=EngineConfig(max_draft=3))
    prompt = [5, 17, 33, 2, 8, 40, 12]
    gen = eng.generate(prompt, max_tokens=20)
    context = prompt + gen.tokens
    with torch.inference_mode():
        full = tiny_model.model(input_ids=torch.tensor([context])).last_hidden_state[0]
    # Every committed position but the last (the pending token) arrived exactly once.
    assert sorted(rec.rows) == list(range(len(context) - 1))
    assert rec.starts[0] == 0
    for pos, row in rec.rows.items():
        torch.testing.assert_close(row, full[pos], atol=1e-4, rtol=1e-4)


def test_head_cache_equals_a_full_causal_pass(tiny_model: Any) -> None:
    """Catching up in chunks through the head's KV cache gives the same outputs as one
    causal pass over all pairs (masks, positions and cache growth are right)."""
    from agentspec.drafters.model.eagle_head import HeadCache

    head = _head(tiny_model)
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 300, tiny_model.config.hidden_size, generator=gen)
    toks = torch.randint(0, 96, (1, 300), generator=gen)
    with torch.no_grad():
        full = head(feats, toks, torch.arange(300))  # [1, 300, H]
        cache = HeadCache(head.spec.kv_heads, head.spec.head_dim, capacity=8)
        parts, i = [], 0
        for n in (1, 5, 1, 40, 253):  # crosses several capacity doublings
            parts.append(head(feats[:, i : i + n], toks[:, i : i + n],
                              torch.arange(i, i + n), cache))
            i += n
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_eagle_drafter_is_lossless(tiny_target: Any, char_decode: Any) -> None:
    """An untrained head drafts junk; the output is still exactly greedy."""
    plain = SpeculativeDecoder(tiny_target, decode=char_decode)
    drafter = EagleDrafter(_head(tiny_target.model), EagleConfig(max_tokens=5))
    eng = SpeculativeDecoder(tiny_target, drafter, decode=char_decode,
                             config=EngineConfig(max_draft=5))
    for prompt in ([3, 9, 27, 81, 50, 11], [1, 2, 3, 4, 5, 6, 7, 8] * 6, [42, 43]):
        want = plain.generate(prompt, max_tokens=40).tokens
        got = eng.generate(prompt, max_tokens=40)
        assert got.tokens == want
        assert any(s.draft_len > 0 for s in got.stats.steps)  # it did draft
    assert drafter.forwards > 0


def test_eagle_drafter_without_features_drafts_nothing(tiny_model: Any) -> None:
    drafter = EagleDrafter(_head(tiny_model))
    ctx = DraftContext([4, 5, 6], 3)
    drafter.begin_request(None, None)
    assert drafter.propose(ctx, 4).tokens == []  # no features at all
    drafter.observe_features(ctx, 0, torch.zeros(2, tiny_model.config.hidden_size))
    assert len(drafter.propose(ctx, 4).tokens) == 4
    drafter.observe_features(ctx, 7, torch.zeros(1, tiny_model.config.hidden_size))  # a gap
    assert drafter.propose(DraftContext([4, 5, 6, 7], 3), 4).tokens == []
    one = EagleDrafter(_head(tiny_model))
    first = DraftContext([4], 1)
    one.observe_features(first, 0, torch.zeros(0, tiny_model.config.hidden_size))  # 1 token
    assert one.propose(first, 4).tokens == []


def test_eagle_lifecycle_raises_on_misuse(tiny_model: Any) -> None:
    """A draft or features for a request that is not live, or one id begun twice, raise
    RequestStateError naming the request; finish releases the request's stream."""
    h = tiny_model.config.hidden_size
    drafter = EagleDrafter(_head(tiny_model))
    ctx = DraftContext([4, 5, 6], 3, request_id="r1")
    with pytest.raises(RequestStateError, match="r1"):
        drafter.propose(ctx, 4)
    with pytest.raises(RequestStateError, match="r1"):
        drafter.observe_features(ctx, 2, torch.zeros(1, h))
    drafter.begin_request(None, None, request_id="r1")
    with pytest.raises(RequestStateError, match="begun twice"):
        drafter.begin_request(None, None, request_id="r1")
    drafter.observe_features(ctx, 0, torch.zeros(2, h))
    assert len(drafter.propose(ctx, 4).tokens) == 4 and drafter.live_requests == 1
    drafter.finish(ctx)
    assert drafter.live_requests == 0
    with pytest.raises(RequestStateError, match="not live"):
        drafter.propose(ctx, 4)


def test_interleaved_requests_draft_as_each_alone(tiny_model: Any) -> None:
    """Two requests alternating steps on one EagleDrafter (each on its own target: one KV
    cache per request) take the same steps, drafts included, as each decoded alone."""
    from agentspec.targets.hf import HFTarget

    def engine(drafter: EagleDrafter) -> SpeculativeDecoder:
        target = HFTarget(tiny_model, None, "tiny-llama", "float32", "cpu")
        return SpeculativeDecoder(target, drafter, config=EngineConfig(max_draft=4))

    prompts = ([3, 9, 27, 81, 50, 11, 3, 9, 27], [1, 2, 3, 4, 5, 6, 7, 8] * 3)
    alone = []
    for prompt in prompts:
        got = engine(EagleDrafter(_head(tiny_model))).generate(prompt, max_tokens=30)
        alone.append((got.tokens, [(s.draft_len, s.accepted) for s in got.stats.steps]))
    shared = EagleDrafter(_head(tiny_model))
    both = [(g.tokens, [(s.draft_len, s.accepted) for s in g.stats.steps])
            for g in run_interleaved([engine(shared).steps(p, max_tokens=30)
                                      for p in prompts])]
    assert both == alone
    assert any(k > 0 for _, steps in alone for k, _ in steps)  # it did draft
    assert shared.live_requests == 0


def test_a_session_s_next_request_resumes_the_head_cache(tiny_model: Any) -> None:
    """The second turn of a session (its prompt extends the first turn's tokens) keeps the
    head entries of the pairs both share and feeds only the new ones; it decodes exactly
    as a drafter that never saw the first turn, drafts included."""
    from agentspec.targets.hf import HFTarget
    from agentspec.types import SessionRef

    def engine(drafter: EagleDrafter) -> SpeculativeDecoder:
        target = HFTarget(tiny_model, None, "tiny-llama", "float32", "cpu")
        return SpeculativeDecoder(target, drafter, config=EngineConfig(max_draft=4))

    sess = SessionRef("s1", tenant="t")
    carried = EagleDrafter(_head(tiny_model))
    first = [3, 9, 27, 81, 50, 11, 3, 9, 27]
    out = engine(carried).generate(first, max_tokens=20, session=sess).tokens
    assert carried.carried_pairs == 0 and carried.live_requests == 0
    second = [*first, *out, 60, 61, 3, 9]  # the conversation resent, a tool result after
    eng = engine(carried)
    got = eng.generate(second, max_tokens=20, session=sess)
    # Pairs i < len(first + out) - 1 were fed in the first turn (all but the last one's).
    assert 0 < carried.carried_pairs <= len(first) + len(out) - 1
    fresh = engine(EagleDrafter(_head(tiny_model))).generate(second, max_tokens=20,
                                                              session=sess)
    assert got.tokens == fresh.tokens
    assert ([(st.draft_len, st.accepted) for st in got.stats.steps]
            == [(st.draft_len, st.accepted) for st in fresh.stats.steps])
    # Another session, or a prompt that rewrites the history, starts from nothing.
    edited = [4, *second[1:]]
    before = carried.carried_pairs
    engine(carried).generate(edited, max_tokens=5, session=sess)
    engine(carried).generate(second, max_tokens=5, session=SessionRef("s2", tenant="t"))
    assert carried.carried_pairs == before


def test_min_confidence_cuts_drafts(tiny_model: Any) -> None:
    h = tiny_model.config.hidden_size
    eager = EagleDrafter(_head(tiny_model), EagleConfig(max_tokens=6, min_confidence=0.0))
    shy = EagleDrafter(_head(tiny_model), EagleConfig(max_tokens=6, min_confidence=0.5))
    # A flat head: every draft probability is 1/N, below the cut.
    shy.head.logits = lambda feats: torch.zeros(*feats.shape[:-1], 96)  # type: ignore[method-assign]
    ctx = DraftContext([1, 2, 3, 4, 5, 6], 6)
    for d in (eager, shy):
        d.observe_features(ctx, 0, torch.randn(5, h,
                                               generator=torch.Generator().manual_seed(0)))
    assert len(eager.propose(ctx, 6).tokens) == 6
    assert len(shy.propose(ctx, 6).tokens) == 1  # the first token is always drafted
    with pytest.raises(ConfigError, match="min_confidence"):
        EagleConfig(min_confidence=1.5)


def test_training_learns_and_artifact_round_trips(tiny_target: Any, tmp_path: Path) -> None:
    """A few steps on the tiny target's own greedy outputs raise held-out agreement; the
    saved head loads back identical; damaged or foreign artifacts are refused."""
    model = tiny_target.model
    gen = torch.Generator().manual_seed(3)
    # Learnable data for a random model: a few repeated cycles, so the target's next
    # prediction is (nearly) a function of the recent tokens the head sees.
    cycles = [torch.randint(2, 96, (n,), generator=gen) for n in (4, 5, 6, 7)]
    seqs = []
    for i in range(32):
        cyc = cycles[i % 4]
        phase = int(torch.randint(0, len(cyc), (1,), generator=gen))
        seqs.append(cyc.roll(phase).repeat(8)[:40])
    data = extract_features(model, seqs)
    head = _head(model, seed=4)
    full = model.get_output_embeddings().weight.detach().float()
    report = train_head(head, data, full, TrainEagleConfig(steps=60, lr=3e-3, val_share=0.25),
                        deadline=time.monotonic() + 600, progress=False)
    assert report["steps"] == 60
    before, after = report["val_before"], report["val_after"]
    assert after["loss"] < before["loss"]
    assert after["top1"] > before["top1"] + 0.3  # ~0.01 -> ~0.4 in 60 steps
    path = tmp_path / "head.safetensors"
    save_eagle(path, head)
    loaded = load_eagle(tiny_target, path)
    for k, v in head.trained_state().items():
        torch.testing.assert_close(loaded.head.trained_state()[k], v.half().float())
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="damaged"):
        load_eagle(tiny_target, path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_eagle(tiny_target, tmp_path / "missing.safetensors")


def test_foreign_artifact_is_refused(tiny_target: Any, tmp_path: Path) -> None:
    head = _head(tiny_target.model)
    object.__setattr__(head.spec, "checksum", head.spec.checksum + 1.0)
    save_eagle(tmp_path / "h.safetensors", head)
    with pytest.raises(ModelLoadError, match="weights differ"):
        load_eagle(tiny_target, tmp_path / "h.safetensors")


def test_hybrid_forwards_features_to_its_eagle_drafter(tiny_target: Any) -> None:
    """HVD with an EAGLE model drafter: the features reach the head every step, whichever
    source won, and the output is exactly greedy."""
    from agentspec.drafters import SuffixDrafter
    from agentspec.drafters.hybrid import HybridDrafter
    from agentspec.payoff.policy import ArcticRule

    eagle = EagleDrafter(_head(tiny_target.model), EagleConfig(max_tokens=3))
    hybrid = HybridDrafter(SuffixDrafter(), eagle, ArcticRule(), model_max=3)
    assert hybrid.wants_features
    plain = SpeculativeDecoder(tiny_target)
    eng = SpeculativeDecoder(tiny_target, hybrid, config=EngineConfig(max_draft=8))
    prompt = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 30, 31]
    steps, fed = eng.steps(prompt, max_tokens=40), 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            got = done.value
            break
        (stream,) = eagle._streams.values()  # the one live request's
        fed = stream.n_feats
    assert got.tokens == plain.generate(prompt, max_tokens=40).tokens
    assert fed == len(prompt) + len(got.tokens) - 1  # every committed position
    assert hybrid.wins["model"] > 0
    assert eagle.live_requests == 0  # released when the request finished
