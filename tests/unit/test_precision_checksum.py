"""A drafter trained on a model serves that model in any precision it is loaded in, and
still refuses another model."""

from __future__ import annotations

import copy

import torch

from agentspec.drafters.model.distilled import checksum_matches, embedding_checksum
from tests.conftest import noisy_copy


def test_bf16_copy_matches_and_another_model_does_not(tiny_model: torch.nn.Module) -> None:
    trained_on = embedding_checksum(tiny_model)  # what a head file records (fp32)
    bf16 = copy.deepcopy(tiny_model).to(torch.bfloat16)
    assert embedding_checksum(bf16) != trained_on  # the rounding moved the sum...
    assert checksum_matches(bf16, trained_on)  # ...within what bf16 rounding explains
    assert checksum_matches(tiny_model, trained_on)
    other = noisy_copy(tiny_model, seed=1, scale=0.05)
    assert not checksum_matches(other, trained_on)
    assert not checksum_matches(other.to(torch.bfloat16), trained_on)
