"""Product forms of a few-row linear layer (agentspec.targets.kernels.linear): every form computes
``torch.nn.functional.linear``'s sums to fp32 rounding with a contiguous output, one-row
forwards stay bit for bit ``linear``'s, the measured table is looked up by the lower row
point, and the cost file keeps the table: a file without one is measured again whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agentspec.targets.cost import costs
from agentspec.targets.cost.cost_curves import CostCurves, FormsProbe
from agentspec.targets.hf import HFTarget
from agentspec.targets.kernels import linear


def _layers() -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(64, 96), torch.nn.Linear(64, 96, bias=False),
            torch.nn.Linear(32, 1100)]


@pytest.mark.parametrize("form", linear.FORMS)
def test_every_form_matches_linear_and_one_row_is_untouched(form: str) -> None:
    for layer in _layers():
        ref = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        ref.load_state_dict(layer.state_dict())
        forms = linear.install_product_forms(layer)
        forms.set({(layer.out_features, layer.in_features): dict.fromkeys(linear.ROW_POINTS,
                                                                           form)})
        for rows in (1, 2, 3, 5, 33, 64, 65):
            x = torch.randn(1, rows, layer.in_features)  # [B, n, in], as a model feeds it
            with torch.inference_mode():
                got, want = layer(x), ref(x)
            assert got.shape == want.shape and got.is_contiguous()
            if rows == 1 or rows > linear.ROW_POINTS[-1] or form == "linear":
                assert torch.equal(got, want)  # linear's own kernel, bit for bit
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_lookup_takes_the_lower_point_and_defaults_to_linear() -> None:
    forms = linear.ProductForms()
    assert not forms.measured and forms.form((8, 4), 4) == "linear"
    forms.set({(8, 4): {2: "linear", 4: "transposed", 8: "blocked128", 64: "linear"}})
    assert forms.measured
    got = [forms.form((8, 4), r) for r in (1, 2, 3, 4, 7, 8, 63, 64, 65)]
    assert got == ["linear", "linear", "linear", "transposed", "transposed", "blocked128",
                   "blocked128", "linear", "linear"]
    assert forms.form((9, 4), 4) == "linear"  # a shape never measured
    table = linear.ProductForms.from_json(json.loads(json.dumps(forms.to_json())))
    assert table == {(8, 4): {2: "linear", 4: "transposed", 8: "blocked128", 64: "linear"}}
    for bad in (None, {}, {"8x4": {"2": "gemm"}}, {"8y4": {"2": "linear"}}, {"8x4": {}},
                {"8x4": ["linear"]}):
        assert linear.ProductForms.from_json(bad) is None, bad


def test_install_keeps_one_table_per_model_and_leaves_other_dtypes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    forms = linear.install_product_forms(model)
    assert linear.install_product_forms(model) is forms  # a second target on the model shares it
    assert linear.shapes(model) == 2
    layer = torch.nn.Linear(16, 8).to(torch.bfloat16)
    forms = linear.install_product_forms(layer)
    forms.set({(8, 16): dict.fromkeys(linear.ROW_POINTS, "transposed")})
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_measure_times_every_shape_at_every_point() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.Linear(300, 16),
                                torch.nn.Linear(16, 300))
    ticks: list[int] = []

    class Bar:
        def update(self, n: int) -> None:
            ticks.append(n)

    table = linear.measure(model, repeats=1, bar=Bar())
    assert set(table) == {(300, 16), (16, 300)} and len(ticks) == 2
    for by_rows in table.values():
        assert sorted(by_rows) == list(linear.ROW_POINTS)
        assert set(by_rows.values()) <= set(linear.FORMS)
    # A blocked form needs two blocks: 300 outputs never take blocked512.
    assert "blocked512" not in table[(300, 16)].values()


def test_a_cost_file_without_forms_is_measured_again(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    probed: list[int] = []
    table = {(4, 4): dict.fromkeys(linear.ROW_POINTS, "transposed")}

    curve = {k: 0.1 + 0.01 * k for k in costs.COST_POINTS}
    old = {str(k): 0.2 * k for k in costs.COST_POINTS}

    def probe(ctx: int, _repeats: int, _bar: object) -> dict[int, float]:
        probed.append(ctx)
        return curve

    def curves(forms: linear.ProductForms) -> CostCurves:
        return CostCurves("m", "m-key", 512, probe, FormsProbe(forms, lambda bar: table, 1))

    path = tmp_path / "costs" / "m-key.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"costs": old}))  # curves timed before forms
    first = linear.ProductForms()
    assert curves(first).stored() is None  # not trusted: no forms beside them
    assert curves(first).ensure() and probed  # measured again, forms first
    data = json.loads(path.read_text())
    assert data["forms"] == first.to_json() and costs.parse_curve(data["costs"]) == curve
    assert first.form((4, 4), 2) == "transposed"
    # A new process: the file's forms are used, nothing is measured.
    probed.clear()
    second = linear.ProductForms()
    assert curves(second).stored() is not None and not probed
    assert second.form((4, 4), 8) == "transposed"


def test_the_cpu_target_installs_it(tiny_target: HFTarget) -> None:
    layers = [m for m in tiny_target.model.modules() if type(m) is torch.nn.Linear]
    assert layers and all("forward" in vars(m) for m in layers)
    assert tiny_target.curves.forms is not None
    assert tiny_target.curves.forms.forms is linear.install_product_forms(tiny_target.model)
