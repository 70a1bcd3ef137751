"""The report's PNG plots, drawn with matplotlib's object API on the Agg canvas.

Figures are built with :class:`matplotlib.figure.Figure` rather than ``pyplot``, so no
global state or display backend is touched (the report also runs inside servers and tests).
Every function returns ``None`` instead of an empty plot when its data is missing.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.ticker import MaxNLocator


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)  # attaches the Agg canvas: savefig never looks for a GUI backend
    return fig


def _value(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if math.isnan(value) or math.isinf(value) else float(value)


def plot_speedups(results: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Grouped bars: speed-up over greedy per workload (groups) and method (bars).

    Args:
        results: The ``results`` rows.
        path: Output PNG.

    Returns:
        ``path``, or ``None`` when no row has a speed-up.
    """
    table: dict[str, dict[str, float]] = defaultdict(dict)
    for r in results:
        v = _value(r.get("speedup_vs_greedy"))
        if v is not None:
            table[str(r.get("workload"))][str(r.get("method"))] = v
    if not table:
        return None
    workloads = list(table)
    methods = list(dict.fromkeys(m for per in table.values() for m in per))
    fig = _figure(max(6.0, 1.6 * len(workloads) + 2), 4.0)
    ax = fig.add_subplot()
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        offset = (i - (len(methods) - 1) / 2) * width
        # Only workloads the method ran: a missing value is not a zero speed-up.
        xs = [k + offset for k, w in enumerate(workloads) if method in table[w]]
        ys = [table[w][method] for w in workloads if method in table[w]]
        bars = ax.bar(xs, ys, width, label=method)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("speed-up vs greedy (×)")
    ax.set_title("Speed-up per workload and method")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


#: Panel titles of the latest :func:`plot_accepted_histograms` call (read by tests).
LAST_TITLES: dict[str, str] = {}


def plot_accepted_histograms(results: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """One panel per method: share of decode steps per accepted draft length.

    Histograms are summed over workloads. Keys may be strings (JSON) or integers.

    Args:
        results: The ``results`` rows.
        path: Output PNG.

    Returns:
        ``path``, or ``None`` when no row has a histogram.
    """
    hists: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    # The table's "mean accepted len" (tokens per forward), pooled over workloads the same
    # way: total tokens / total forwards, so a one-workload title equals its table row.
    tokens: dict[str, float] = defaultdict(float)
    forwards: dict[str, float] = defaultdict(float)
    for r in results:
        hist = r.get("accepted_histogram")
        if not isinstance(hist, Mapping):
            continue
        n, per = _value(r.get("tokens")), _value(r.get("mean_accepted_len"))
        if n and per:
            tokens[str(r.get("method"))] += n
            forwards[str(r.get("method"))] += n / per
        for key, count in hist.items():
            v = _value(count)
            try:
                length = int(key)
            except (TypeError, ValueError):
                continue
            if v is not None:
                hists[str(r.get("method"))][length] += v
    hists = {m: h for m, h in hists.items() if sum(h.values()) > 0}
    if not hists:
        return None
    titles: dict[str, str] = {}
    cols = min(3, len(hists))
    rows = math.ceil(len(hists) / cols)
    fig = _figure(4.0 * cols, 3.0 * rows)
    for i, (method, hist) in enumerate(hists.items()):
        ax = fig.add_subplot(rows, cols, i + 1)
        total = sum(hist.values())
        lengths = sorted(hist)
        ax.bar(lengths, [hist[k] / total for k in lengths], width=0.8)
        # Greedy has every step at 0: keep a 0..1 integer axis instead of fractional ticks.
        top = max(max(lengths), 1)
        ax.set_xlim(-0.6, top + 0.6)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=2))
        if forwards.get(method):
            mean = tokens[method] / forwards[method]
        else:  # no token counts: the histogram's own mean, plus the verifier's token
            mean = 1 + sum(k * c for k, c in hist.items()) / total
        ax.set_title(f"{method} (mean accepted len {mean:.2f})", fontsize=9)
        titles[method] = ax.get_title()
        ax.set_xlabel("accepted draft tokens per step")
        ax.set_ylabel("share of steps")
    fig.tight_layout()
    fig.savefig(path)
    LAST_TITLES.clear()
    LAST_TITLES.update(titles)
    return path


def plot_turns(
    series: Mapping[str, Mapping[str, Mapping[int, float]]], path: Path, relative: bool = True
) -> Path | None:
    """One panel per multi-turn workload: a line per method over the turn index.

    Args:
        series: ``{workload: {method: {turn: value}}}`` (see
            :func:`workflows.report.tables.turn_speedups`).
        path: Output PNG.
        relative: Values are speed-ups over greedy (else tokens/s).

    Returns:
        ``path``, or ``None`` when no workload has more than one turn.
    """
    panels = {
        w: per_method
        for w, per_method in series.items()
        if any(len(points) > 1 for points in per_method.values())
    }
    if not panels:
        return None
    fig = _figure(6.0, 3.2 * len(panels))
    for i, (workload, per_method) in enumerate(panels.items()):
        ax = fig.add_subplot(len(panels), 1, i + 1)
        for method, points in per_method.items():
            turns = sorted(points)
            ax.plot(turns, [points[t] for t in turns], marker="o", label=method)
        if relative:
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("turn")
        ax.set_ylabel("speed-up vs greedy (×)" if relative else "tokens/s")
        ax.set_title(f"{workload}: per turn")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path
