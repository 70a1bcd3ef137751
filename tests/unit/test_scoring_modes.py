"""The target's scoring says which state its cache is in (a chain, an unresolved tree, an
unresolved batch) and refuses a call that does not fit that state, naming it."""

from __future__ import annotations

import pytest
import torch

from agentspec.errors import ConfigError
from agentspec.targets.hf import HFTarget
from agentspec.targets.request.scoring import CHAIN, Batch, Tree


@pytest.fixture
def target(tiny_model: torch.nn.Module) -> HFTarget:
    return HFTarget(tiny_model, None, "tiny-llama", "float32", "cpu")


def test_resolving_calls_need_what_they_resolve(target: HFTarget) -> None:
    with pytest.raises(ConfigError, match="before prefill"):
        target.score([2])
    target.prefill([2, 3, 4])
    with pytest.raises(ConfigError, match=r"keep_tree_path\(\) without a score_tree\(\)"):
        target.keep_tree_path([1])
    with pytest.raises(ConfigError, match=r"select_row\(\) without a score_batch\(\)"):
        target.select_row(0)
    target.score_batch([[5, 6], [7, 8]])
    with pytest.raises(ConfigError, match="the cache holds a batch"):
        target.keep_tree_path([1])
    target.select_row(1)
    target.score_tree([9, 10, 11], [-1, 0, 0])
    with pytest.raises(ConfigError, match="the cache holds a tree"):
        target.select_row(0)
    target.keep_tree_path([2])
    with pytest.raises(ConfigError, match="without a score_tree"):
        target.keep_tree_path([2])  # resolved once only
    assert target.scoring.mode is CHAIN and target.num_cached == 3 + 2 + 2


def test_nothing_continues_an_unresolved_tree_or_batch(target: HFTarget) -> None:
    target.prefill([2, 3, 4])
    target.score_tree([5, 6], [-1, 0])
    assert target.scoring.mode == Tree((5, 6)) and target.scoring.pending
    for call in (lambda: target.score([7]), lambda: target.score_batch([[7], [8]]),
                 lambda: target.score_tree([7], [-1])):
        with pytest.raises(ConfigError, match=r"unresolved tree: call keep_tree_path\(\)"):
            call()
    target.prefill([2, 3, 4])  # a new request starts afresh
    assert target.scoring.mode is CHAIN
    target.score_batch([[5, 6], [7, 8]])
    with pytest.raises(ConfigError, match=r"unresolved batch: call select_row\(\)"):
        target.score([9])
    assert target.num_cached == 5  # nothing was fed by the refused calls


def test_a_batch_rolled_back_past_its_rows_still_resolves(target: HFTarget) -> None:
    target.prefill([2, 3, 4, 5])
    target.score_batch([[6, 7], [8, 9]])
    target.rollback(1)
    assert target.scoring.mode == Batch(((6,), (8,)))
    target.rollback(2)  # past the rows: their tokens (and the cache's ids) are unknown
    assert target.scoring.mode == Batch(None) and target.reuse.ids is None
    target.select_row(1)
    assert target.scoring.mode is CHAIN and target.num_cached == 3
    torch.testing.assert_close(target.score([5])[-1], target.prefill([2, 3, 4, 5]))
