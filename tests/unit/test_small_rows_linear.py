"""The small-rows linear forward (agentspec.targets.linear): same sums as
``torch.nn.functional.linear`` to fp32 rounding, untouched one-row and many-row forwards,
contiguous outputs (SDPA's flash kernel refuses a strided last dimension)."""

from __future__ import annotations

import torch

from agentspec.targets import linear
from agentspec.targets.hf import HFTarget


def _layers() -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(64, 96), torch.nn.Linear(64, 96, bias=False),
            torch.nn.Linear(32, linear.WIDE_OUT)]


def test_small_rows_match_linear_and_others_are_untouched() -> None:
    for layer in _layers():
        ref = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        ref.load_state_dict(layer.state_dict())
        assert linear.install(layer) == 1
        limit = linear.WIDE_ROWS if layer.out_features >= linear.WIDE_OUT else linear.BODY_ROWS
        for rows in range(1, limit + 4):
            x = torch.randn(1, rows, layer.in_features)  # [B, n, in], as a model feeds it
            with torch.inference_mode():
                got, want = layer(x), ref(x)
            assert got.shape == want.shape and got.is_contiguous()
            if 2 <= rows <= limit:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:  # one row (plain decoding) and prompts: linear's own kernel, bit for bit
                assert torch.equal(got, want)


def test_other_dtypes_and_modules_keep_linear() -> None:
    layer = torch.nn.Linear(16, 8).to(torch.bfloat16)
    linear.install(layer)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert linear.install(model) == 2


def test_the_cpu_target_installs_it(tiny_target: HFTarget) -> None:
    layers = [m for m in tiny_target.model.modules() if type(m) is torch.nn.Linear]
    assert layers and all("forward" in vars(m) for m in layers)
