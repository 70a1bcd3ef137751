"""Full-length labels of cache drafts (agentspec.payoff.labels) and their two consumers'
shared use: HVD in-process (tests/unit/test_hybrid.py) and the vLLM proposer's payoff gate,
which calibrates online from the labels its rows' committed tokens decide."""

from __future__ import annotations

import math
from typing import Any

import pytest

from adapters.vllm.payoff_gate import PayoffGate
from agentspec.errors import ConfigError
from agentspec.payoff.features import TokenTable
from agentspec.payoff.labels import SHADOW_KEEP, ShadowLabels
from agentspec.payoff.policy import CACHE
from agentspec.types import Draft, DraftContext
from tests.unit.test_vllm_adapter import FakeModelRunner, _constant_predictor

Outcome = tuple[float, int, float, int]


def _recorder() -> tuple[list[Outcome], Any]:
    got: list[Outcome] = []

    def outcome(raw: float, label: int, score: float, length: int) -> None:
        got.append((raw, label, score, length))

    return got, outcome


def test_labels_arrive_in_order_once_the_committed_tokens_decide_them() -> None:
    labels = ShadowLabels()
    labels.add(3, Draft([7, 8, 9]), 1.5, 2.0)  # drafted at 3 tokens
    labels.add(4, Draft([8, 5]), 0.5, 1.0)  # drafted one token later
    got, outcome = _recorder()
    assert labels.label(outcome, [0, 1, 2], [7]) == 0  # 7: neither is decided yet
    assert got == [] and len(labels) == 2
    # 7, 8, 0: the first followed 2 tokens, the second (from 8) followed 1.
    assert labels.label(outcome, [0, 1, 2, 7], [8, 0]) == 2
    assert got == [(1.5, 2, 2.0, 3), (0.5, 1, 1.0, 2)]
    assert not labels and labels.latest is None


def test_a_later_draft_waits_behind_an_undecided_earlier_one() -> None:
    """Drafts start in order, so labelling stops at the first undecided one, as HVD's did."""
    labels = ShadowLabels()
    labels.add(0, Draft([1, 2, 3, 4]), 4.0, 4.0)
    labels.add(1, Draft([9]), 0.0, 0.0)  # refuted by the next token already
    got, outcome = _recorder()
    assert labels.label(outcome, [1, 2]) == 0
    assert len(labels) == 2
    assert labels.label(outcome, [1, 2, 3, 4]) == 2
    assert got == [(4.0, 4, 4.0, 4), (0.0, 0, 0.0, 1)]


def test_tree_drafts_are_labelled_by_their_longest_followed_path() -> None:
    labels = ShadowLabels()
    tree = Draft([5, 6, 8, 7], [-1, 0, 0, 1])  # root -> 5 -> {6 -> 7, 8}
    labels.add(0, tree, 2.0, 3.0)
    got, outcome = _recorder()
    labels.label(outcome, [5, 8, 1])
    assert got == [(2.0, 2, 3.0, 4)]


def test_shadows_are_bounded() -> None:
    labels = ShadowLabels(keep=2)
    for start in range(3):
        labels.add(start, Draft([9]), float(start), 0.0)
    assert len(labels) == 2
    got, outcome = _recorder()
    labels.label(outcome, [0, 0, 0, 0])
    assert [raw for raw, *_ in got] == [1.0, 2.0]  # the oldest was dropped unlabelled
    assert len(ShadowLabels()._shadow) == 0 and ShadowLabels()._shadow.maxlen == SHADOW_KEEP
    with pytest.raises(ConfigError, match="keep"):
        ShadowLabels(keep=0)


# --------------------------------------------------------------------------- vLLM proposer
class ScriptedDrafter:
    """A cache drafter whose drafts are scripted by the request's token count."""

    def __init__(self, drafts: dict[int, Draft]) -> None:
        self.drafts = drafts

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return self.drafts.get(len(ctx.tokens), Draft())

    def finish(self, ctx: DraftContext) -> None:
        pass

    def stop_request(self, ctx: DraftContext) -> None:
        pass

    def forget(self, ref: Any) -> None:
        pass


def _gated_runner(y_hat: float, drafts: dict[int, Draft]) -> tuple[FakeModelRunner,
                                                                    list[Outcome],
                                                                    list[tuple[str, int, int]]]:
    """A proposer with a payoff gate of constant ŷ, a scripted drafter, and a record of what
    its policy learns: outcomes ``(raw, label, score, length)`` and ``(source, k, accepted)``
    of its verified-step updates."""
    runner = FakeModelRunner(k=8)
    proposer = runner.drafter
    proposer.drafter = ScriptedDrafter(drafts)  # type: ignore[assignment]
    gate = PayoffGate(_constant_predictor(y_hat), TokenTable.blank(1000), cost_per_token=0.04)
    proposer.gate = gate
    policy = gate.policy
    outcomes: list[Outcome] = []
    updates: list[tuple[str, int, int]] = []
    real_outcome, real_update = policy.outcome, policy.update

    def outcome(raw: float, accepted: int, score: float = math.nan, length: int = 0) -> None:
        outcomes.append((raw, accepted, score, length))
        real_outcome(raw, accepted, score, length)

    def update(source: str, draft_len: int, accepted: int, draft_s: float) -> None:
        updates.append((source, draft_len, accepted))
        real_update(source, draft_len, accepted, draft_s)

    policy.outcome = outcome  # type: ignore[method-assign]
    policy.update = update  # type: ignore[method-assign]
    return runner, outcomes, updates


PROMPT = [1, 2, 3, 4, 5]
D1 = Draft([7, 8, 9, 10], score=3.0)  # drafted at 6 tokens
D2 = Draft([50, 51, 52], score=1.0)  # drafted at 9 tokens


def test_the_proposer_gate_learns_from_full_length_labels_of_sent_drafts() -> None:
    """Drafts sent whole: the gate is told each verified step (β learns from refuted ones)
    and each draft's full-length label once the committed tokens decide it."""
    runner, outcomes, updates = _gated_runner(100.0, {6: D1, 9: D2})
    runner.start(0, "a", PROMPT)
    (d1,) = runner.step({0: [6]})
    assert d1 == D1.tokens  # ŷ = 100: the whole draft
    assert outcomes == []
    (d2,) = runner.step({0: [7, 8, 42]})  # vLLM accepted 7, 8 and sampled 42
    assert outcomes == [(4.0, 2, 3.0, 4)]  # raw ŷ clipped to the draft, label 2, score 3
    assert updates == [(CACHE, 4, 2)]
    assert d2 == D2.tokens  # whole drafts have realised the most so far: sent whole
    runner.step({0: [50, 51, 52, 53]})  # all accepted, then 53
    assert outcomes[1:] == [(3.0, 3, 1.0, 3)]
    assert updates == [(CACHE, 4, 2), (CACHE, 3, 3)]
    assert runner.drafter.gate is not None and runner.drafter.gate.labelled == 2


def test_the_proposer_gate_labels_withheld_drafts_and_learns_to_send_them() -> None:
    """A gate whose predictor says 0 withholds the first copy draft; its full-length label
    (the rows' tokens followed it to its end) still reaches the policy, whose calibration
    then sends the next copy drafts: ŷ is no longer used as trained."""
    truth = [*PROMPT, *range(100, 140)]
    runner, outcomes, updates = _gated_runner(
        0.0, {n: Draft(truth[n: n + 4], score=1.0) for n in range(len(PROMPT), 30)})
    runner.start(0, "a", PROMPT)
    n, draft, sent = len(PROMPT), [], []
    for _ in range(12):  # vLLM: the draft's right prefix, then one token of its own
        acc = 0
        while acc < len(draft) and draft[acc] == truth[n + acc]:
            acc += 1
        commit = truth[n: n + acc + 1]
        n += len(commit)
        (draft,) = runner.step({0: commit})
        sent.append(draft)
    assert sent[0] == []  # withheld as trained
    assert outcomes[0] == (0.0, 4, 1.0, 4)  # labelled at full length all the same
    assert all(label == 4 for _, label, _, _ in outcomes)
    assert any(sent[1:])  # calibrated: copy drafts are sent
    assert all((src, k) == (CACHE, acc) for src, k, acc in updates)  # all accepted
