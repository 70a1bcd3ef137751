"""Linear layers over a few rows on CPU, in the product form this machine runs fastest.

Verifying a short draft multiplies every weight matrix by 2-33 rows (the pending token plus
the draft). A one-row step reads each weight once and is bound by memory bandwidth; a few
rows should cost about the same, since the extra multiply-adds are nearly free while the
weights stream through. Whether they do depends on the BLAS kernel the shape lands on, and
that differs between CPUs and library builds: on one 2-core machine MKL's ``x @ Wᵀ``
(``torch.nn.functional.linear``) took one pass over the weights *per row* from 2 rows on,
and the transposed product ``(W @ xᵀ)ᵀ`` read them once; on another ``linear`` over 2-3
rows cost what one row costs and the transposed product twice that, while from 4 rows on
``linear`` jumped to three times one row and ``linear`` over slices of 128-512 output rows
(each slice read once, reused by every row from the core's cache) was the fastest, the best
slice size differing by layer shape. A fixed choice is right on one machine and wrong on the
next, so the choice is measured.

The forms, the same sums in different orders (logits differ in the last bits, ~1e-6
relative, as with any change of kernel; the lossless guarantee, outputs token-identical to
plain decoding, is tested as before):

- ``linear``: ``torch.nn.functional.linear`` (what the model does without this module);
- ``transposed``: ``(W @ xᵀ)ᵀ``, made contiguous;
- ``blocked128`` / ``blocked512``: ``linear`` over 128- or 512-row slices of ``W``,
  concatenated (a slice stays in the core's cache while every input row passes over it).

:func:`measure` times each form for every distinct fp32 layer shape of a model at the row
counts of :data:`ROW_POINTS` and keeps the fastest (``linear`` unless another wins by
:data:`MIN_GAIN`); a row count between two points takes the lower point's form.
:func:`install_product_forms` gives each ``nn.Linear`` a forward that asks the model's
:class:`ProductForms` which form to run. One-row forwards (plain decoding) always take
``linear``: the reference stays bit for bit what it was. Until a table is set (a model whose
costs are never measured) every row count takes ``linear``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["FORMS", "ROW_POINTS", "ProductForms", "install_product_forms", "measure"]

#: The product forms (see the module docstring); ``blockedN`` slices ``W`` by N rows.
FORMS = ("linear", "transposed", "blocked128", "blocked512")
#: Row counts at which the forms are timed (drafts of 1-32 tokens verify 2-33 rows; trees
#: and batches up to 64). Beyond the last point every layer takes ``linear``.
ROW_POINTS = (2, 3, 4, 6, 8, 12, 16, 24, 33, 64)
#: An alternative form must beat ``linear`` by this fraction to be chosen (timing noise
#: alone should not move a layer off the library's own kernel).
MIN_GAIN = 0.05

Shape = tuple[int, int]  # (out_features, in_features)
Table = dict[Shape, dict[int, str]]  # shape -> {row point: form}


class ProductForms:
    """Which product form each (layer shape, row count) runs: one per model, shared by every
    target built on it (:func:`install_product_forms` creates it once and returns it after)."""

    def __init__(self) -> None:
        self._table: Table = {}
        self._lookup: dict[Shape, list[str]] = {}  # shape -> form by row count 0..last

    @property
    def measured(self) -> bool:
        """Whether a table is set (else every row count takes ``linear``)."""
        return bool(self._table)

    def set(self, table: Table) -> None:
        """Use ``table`` (from :func:`measure` or :meth:`from_json`)."""
        self._table = {shape: dict(rows) for shape, rows in table.items()}
        self._lookup = {}
        for shape, by_rows in self._table.items():
            forms = ["linear"] * (ROW_POINTS[-1] + 1)
            form = "linear"
            for rows in range(2, ROW_POINTS[-1] + 1):
                form = by_rows.get(rows, form)  # between points: the lower point's form
                forms[rows] = form
            self._lookup[shape] = forms

    def form(self, shape: Shape, rows: int) -> str:
        """The form a layer of ``shape`` runs over ``rows`` rows."""
        forms = self._lookup.get(shape)
        if forms is None or rows < 2 or rows >= len(forms):
            return "linear"
        return forms[rows]

    def to_json(self) -> dict[str, dict[str, str]]:
        """The table as JSON (``{"out x in": {"rows": form}}``)."""
        return {f"{o}x{i}": {str(r): f for r, f in sorted(by_rows.items())}
                for (o, i), by_rows in sorted(self._table.items())}

    @staticmethod
    def from_json(data: Any) -> Table | None:
        """A table read back from :meth:`to_json`'s output; ``None`` if it is malformed."""
        if not isinstance(data, dict) or not data:
            return None
        table: Table = {}
        try:
            for key, by_rows in data.items():
                out, inp = (int(v) for v in str(key).split("x"))
                rows = {int(r): str(f) for r, f in by_rows.items()}
                if not rows or any(f not in FORMS for f in rows.values()):
                    return None
                table[(out, inp)] = rows
        except (AttributeError, TypeError, ValueError):
            return None
        return table


def _product(form: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weightᵀ`` for ``x`` ``[rows, in]`` in ``form``: ``[rows, out]``, contiguous."""
    if form == "transposed":
        # [out, rows] -> [rows, out], made contiguous: a transposed view would reach
        # attention with a strided last dimension, and SDPA's flash kernel refuses it.
        return torch.matmul(weight, x.T).T.contiguous()
    block = _block_rows(form)
    if block:
        return torch.cat([torch.nn.functional.linear(x, w) for w in weight.split(block)], dim=1)
    return torch.nn.functional.linear(x, weight)


def _block_rows(form: str) -> int:
    """Rows of ``W`` per slice of a ``blockedN`` form (0: not a blocked form)."""
    return int(form[len("blocked"):]) if form.startswith("blocked") else 0


def _forward_with(forms: ProductForms) -> Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]:
    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``nn.Linear.forward`` in the measured form for a few fp32 rows."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows >= 2 and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            form = forms.form((self.out_features, self.in_features), rows)
            if form != "linear":
                y = _product(form, x.reshape(rows, x.shape[-1]), self.weight)  # [rows, out]
                if self.bias is not None:
                    y = y + self.bias
                return y.reshape(*x.shape[:-1], self.out_features)
        return torch.nn.functional.linear(x, self.weight, self.bias)

    return forward


def _linears(model: Any) -> Iterable[torch.nn.Linear]:
    return (m for m in model.modules() if type(m) is torch.nn.Linear)


def _groups(model: Any) -> dict[Shape, list[torch.nn.Linear]]:
    """The fp32 CPU layers whose form is measured, by shape, in the model's order."""
    groups: dict[Shape, list[torch.nn.Linear]] = {}
    for m in _linears(model):
        if m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
            groups.setdefault((m.out_features, m.in_features), []).append(m)
    return groups


def install_product_forms(model: Any) -> ProductForms:
    """Give every ``nn.Linear`` of ``model`` the measured-form forward; return the model's
    :class:`ProductForms` (created on the first call, the same one after).

    Only CPU models should call it (on CUDA, cuBLAS handles small batches well).
    """
    forms = getattr(model, "_agentspec_product_forms", None)
    if not isinstance(forms, ProductForms):
        forms = ProductForms()
        object.__setattr__(model, "_agentspec_product_forms", forms)  # not a submodule
    forward = _forward_with(forms)
    for module in _linears(model):
        module.forward = forward.__get__(module)  # type: ignore[method-assign]
    return forms


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _over(form: str, x: torch.Tensor, layers: list[torch.nn.Linear]) -> Callable[[], None]:
    """One product in ``form`` with each of ``layers`` in turn (a forward's order)."""

    def run() -> None:
        for layer in layers:
            _product(form, x, layer.weight)

    return run


def measure(model: Any, repeats: int = 3, bar: Any = None) -> Table:
    """Time every form for each distinct fp32 layer shape of ``model`` at each of
    :data:`ROW_POINTS` and return the fastest per point (``bar``: a progress bar advanced
    once per shape).

    A form is timed over *every* layer of the shape in turn, as a forward runs them: each
    weight is then read from memory as in a real verify. Timing one layer in a loop keeps
    its weights in the CPU's cache and favours forms that reuse them, which a forward over
    a model larger than the cache never sees.
    """
    gen = torch.Generator().manual_seed(0)
    table: Table = {}
    with torch.inference_mode():
        for shape, layers in _groups(model).items():
            _product("linear", torch.randn(2, shape[1], generator=gen), layers[0].weight)  # warm-up
            by_rows: dict[int, str] = {}
            forms = [f for f in FORMS  # a blocked form needs 2 slices at least
                     if shape[0] >= 2 * _block_rows(f)]
            for rows in ROW_POINTS:
                x = torch.randn(rows, shape[1], generator=gen)  # [rows, in]

                took = {f: _median_s(_over(f, x, layers), repeats) for f in forms}
                best = min(took, key=took.__getitem__)
                by_rows[rows] = best if took[best] < (1 - MIN_GAIN) * took["linear"] else "linear"
            table[shape] = by_rows
            if bar is not None:
                bar.update(1)
    return table


def shapes(model: Any) -> int:
    """Distinct fp32 CPU layer shapes :func:`measure` times (a progress bar's length)."""
    return len(_groups(model))
