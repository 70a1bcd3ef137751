"""Where a target's measured cost curves live and when they are measured.

A target measures c(k) at :data:`~agentspec.targets.costs.SHORT_CONTEXT` positions (the base
curve :meth:`HFTarget.verify_cost` reads) and, where its window allows, at one long context;
the draft gate prices drafts by both (:mod:`agentspec.targets.costs`). Measuring takes seconds
to tens of seconds, so the curves are kept in one JSON file per model, dtype, device and
machine under ``$AGENTSPEC_HOME/costs`` and measured only when that file lacks them: when the
model loads (:meth:`CostCurves.ensure`), never inside a request (:meth:`CostCurves.stored`
reads without measuring). A corrupt or partial file is measured again, never an error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentspec.models import agentspec_home
from agentspec.targets import costs
from agentspec.targets.costs import Curve

#: Times one forward over each of ``COST_POINTS`` tokens on a ``context``-position cache:
#: ``probe(context, repeats, bar) -> curve`` (``bar``: a progress bar to advance, or None).
Probe = Callable[[int, int, Any], Curve]


class CostCurves:
    """The measured curves of one target.

    Args:
        name: The model's name (progress lines).
        key: The file's name: model (name and a fingerprint of its weights, see
            :mod:`agentspec.targets.fingerprint`), dtype, device and machine (``HFTarget``
            builds it).
        max_positions: The model's window (it decides which contexts are measured).
        probe: The target's timing of one forward per draft length.
    """

    def __init__(self, name: str, key: str, max_positions: int, probe: Probe) -> None:
        self.name, self.key = name, key
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
        data = costs.read_file(self.path)
        base = costs.parse_curve(data.get("costs"))
        if base is None:
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
            data = costs.read_file(self.path)
            curve = costs.parse_curve(data.get("costs"))
            if curve is None:  # absent or corrupt: measure again
                import torch

                curve = self.probe(self.short, 5, bar)
                costs.write_file(self.path, {**data, "costs": curve,
                                             "torch": torch.__version__})
            self.base = curve
        return self.base

    def ensure(self, progress: bool = False) -> dict[int, Curve]:
        """Every curve, measuring (with a progress line when ``progress``) and storing the
        ones the file lacks."""
        stored = self.stored()
        if stored is not None:
            return stored
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(costs.COST_POINTS) * (1 if self.long is None else 2),
                       leave=False,
                       desc=f"measuring {self.name}'s verify cost (once per machine)")
        try:
            curves = {self.short: self.base_curve(bar)}
            if self.long is not None:
                data = costs.read_file(self.path)
                curve = _long_curve(data, self.long)
                if curve is None:
                    curve = self.probe(self.long, 3, bar)
                    data["long"] = {"context": self.long, "costs": curve}
                    costs.write_file(self.path, data)
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
