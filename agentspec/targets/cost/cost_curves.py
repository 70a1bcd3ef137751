"""Where a target's measured cost curves live and when they are measured.

A target measures c(k) at :data:`~agentspec.targets.cost.costs.SHORT_CONTEXT` positions (the base
curve :meth:`HFTarget.verify_cost` reads) and, where its window allows, at one long context;
the draft gate prices drafts by both (:mod:`agentspec.targets.cost.costs`). Measuring takes seconds
to tens of seconds, so the curves are kept in one JSON file per model, dtype, device and
machine under ``$AGENTSPEC_HOME/costs`` and measured only when that file lacks them: when the
model loads (:meth:`CostCurves.ensure`), never inside a request (:meth:`CostCurves.stored`
reads without measuring). A corrupt or partial file is measured again, never an error.

The curves depend on how each layer multiplies a few rows (:mod:`agentspec.targets.kernels.linear`
measures which product form is fastest here), so the file keeps that table too, and the
table is measured first: a file without one (or one written before the table existed) is
measured again whole, forms then curves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentspec.models import agentspec_home
from agentspec.targets.base.files import read_json, write_json
from agentspec.targets.cost import costs
from agentspec.targets.cost.costs import Curve
from agentspec.targets.kernels.linear import ProductForms, Table

#: Times one forward over each of ``COST_POINTS`` tokens on a ``context``-position cache:
#: ``probe(context, repeats, bar) -> curve`` (``bar``: a progress bar to advance, or None).
Probe = Callable[[int, int, Any], Curve]


@dataclass
class FormsProbe:
    """The model's product forms and how to measure them.

    Attributes:
        forms: The model's :class:`~agentspec.targets.kernels.linear.ProductForms` (set from the
            file, or from a measurement).
        measure: ``measure(bar) -> table`` (``bar``: a progress bar to advance, or None).
        steps: Progress steps one measurement takes.
    """

    forms: ProductForms
    measure: Callable[[Any], Table]
    steps: int


class CostCurves:
    """The measured curves of one target.

    Args:
        name: The model's name (progress lines).
        key: The file's name: model (name and a fingerprint of its weights, see
            :mod:`agentspec.targets.base.fingerprint`), dtype, device and machine
            (:func:`agentspec.targets.cost.cost_meter.cost_key`).
        max_positions: The model's window (it decides which contexts are measured).
        probe: The target's timing of one forward per draft length.
        forms: The model's product forms (``None``: the model has none to choose, e.g. on
            a GPU).
    """

    def __init__(self, name: str, key: str, max_positions: int, probe: Probe,
                 forms: FormsProbe | None = None) -> None:
        self.name, self.key = name, key
        self.forms = forms
        self.short = costs.short_context(max_positions)
        self.long = costs.long_context(max_positions)
        self.probe = probe
        self.base: Curve | None = None  # the base curve, once read or measured
        self.curves: dict[int, Curve] | None = None  # {context: curve}, once complete

    @property
    def path(self) -> Path:
        """The cost file (``AGENTSPEC_HOME`` is read at each use)."""
        return agentspec_home() / "costs" / f"{self.key}.json"

    def stored(self) -> dict[int, Curve] | None:
        """Every curve this model uses, from the file; ``None`` when one is missing (nothing
        is measured here)."""
        if self.curves is not None:
            return self.curves
        data = read_json(self.path)
        base = costs.parse_curve(data.get("costs"))
        if not self._read_forms(data) or base is None:  # forms first: ensure() counts on it
            return None
        curves = {self.short: base}
        if self.long is not None:
            long = _long_curve(data, self.long)
            if long is None:
                return None
            curves[self.long] = long
        self.base, self.curves = base, curves
        return curves

    def base_curve(self, bar: Any = None) -> Curve:
        """The base curve, measured and stored first if the file lacks it."""
        if self.base is None:
            data = read_json(self.path)
            if not self._read_forms(data):
                data = self._measure_forms(bar)
            curve = costs.parse_curve(data.get("costs"))
            if curve is None:  # absent or corrupt: measure again
                import torch

                curve = self.probe(self.short, 5, bar)
                write_json(self.path, {**data, "costs": curve,
                                             "torch": torch.__version__})
            self.base = curve
        return self.base

    def _read_forms(self, data: dict[str, Any]) -> bool:
        """Use the file's product forms; ``False`` when it has none (or no valid ones)."""
        if self.forms is None:
            return True
        table = ProductForms.from_json(data.get("forms"))
        if table is None:
            return False
        if not self.forms.forms.measured:
            self.forms.forms.set(table)
        return True

    def _measure_forms(self, bar: Any) -> dict[str, Any]:
        """Measure the product forms, use them and start the file afresh with them (curves
        timed with other forms are dropped: they are measured again)."""
        import torch

        assert self.forms is not None
        self.forms.forms.set(self.forms.measure(bar))
        data = {"forms": self.forms.forms.to_json(), "torch": torch.__version__}
        write_json(self.path, data)
        return data

    def ensure(self, progress: bool = False) -> dict[int, Curve]:
        """Every curve, measuring (with a progress line when ``progress``) and storing the
        ones the file lacks."""
        stored = self.stored()
        if stored is not None:
            return stored
        bar = None
        if progress:
            from tqdm.auto import tqdm

            steps = len(costs.COST_POINTS) * (1 if self.long is None else 2)
            # (stored() has read the file's forms, if it has any: those are not measured)
            steps += self.forms.steps if self.forms and not self.forms.forms.measured else 0
            bar = tqdm(total=steps, leave=False,
                       desc=f"measuring {self.name}'s verify cost (once per machine)")
        try:
            curves = {self.short: self.base_curve(bar)}
            if self.long is not None:
                data = read_json(self.path)
                curve = _long_curve(data, self.long)
                if curve is None:
                    curve = self.probe(self.long, 3, bar)
                    data["long"] = {"context": self.long, "costs": curve}
                    write_json(self.path, data)
                curves[self.long] = curve
        finally:
            if bar is not None:
                bar.close()
        self.curves = curves
        return curves


def _long_curve(data: dict[str, Any], context: int) -> Curve | None:
    """The cost file's long-context curve if it was measured at ``context``."""
    long = data.get("long")
    if isinstance(long, dict) and long.get("context") == context:
        return costs.parse_curve(long.get("costs"))
    return None
