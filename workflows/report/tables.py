"""The benchmark report: a Markdown table plus plots from a harness results file.

``agentspec report results.json [--out-dir DIR]`` calls :func:`write_report`, which writes
``results.report.md`` (machine, model, the per-method table, per-workload quality numbers)
and PNG plots named after the results file too (``results.speedup.png``, ...), so two runs
reported into one folder never overwrite each other. Plots: speed-up per method and
workload, accepted-length histograms per method, and speed-up per turn of multi-turn
workloads (the DELEGATE-52 relay). :func:`results_table` renders the same table for the
terminal.

Fields may be missing (older result files, methods without a greedy reference); they are
rendered as "–" and plots skip them.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentspec.errors import BenchmarkError
from workflows.report.markdown import markdown_table

BASELINE = "greedy"  # the method every speed-up is relative to
MISSING = "–"


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if math.isnan(value) or math.isinf(value) else float(value)


def _fmt(spec: str, suffix: str = "") -> Callable[[Any], str]:
    def render(value: Any) -> str:
        v = _num(value)
        return MISSING if v is None else f"{v:{spec}}{suffix}"

    return render


def _yes_no(value: Any) -> str:
    return MISSING if not isinstance(value, bool) else ("yes" if value else "no")


def _text(value: Any) -> str:
    return value if isinstance(value, str) and value else MISSING


# (header, results key, renderer) in table order.
COLUMNS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("tokens/s", "tokens_per_s", _fmt(".1f")),
    ("speed-up vs greedy", "speedup_vs_greedy", _fmt(".2f", "×")),
    ("mean accepted len", "mean_accepted_len", _fmt(".2f")),
    ("forwards/1k", "forwards_per_1k", _fmt(".0f")),
    ("target ms/step", "target_ms_per_step", _fmt(".1f")),
    ("drafter ms/step", "drafter_ms_per_step", _fmt(".2f")),
    ("identical to greedy", "identical_to_greedy", _yes_no),
    ("loop share", "loop_share", _fmt(".1%")),
    ("speed-up loop-free", "speedup_loop_free", _fmt(".2f", "×")),
    ("oracle fraction", "oracle_fraction", _fmt(".0%")),
    ("exceptions/1k", "exceptions_per_1k", _fmt(".2f")),
    ("diverged", "diverged_token_share", _fmt(".0%")),
    ("tests passed", "tests_passed", _text),
)


def load_results(path: str | Path) -> dict[str, Any]:
    """Read a harness results file.

    Raises:
        BenchmarkError: The file is missing, not JSON, or has no ``results`` list.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise BenchmarkError(f"{path} not found: run `agentspec bench` first") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BenchmarkError(f"{path}: not a results file ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise BenchmarkError(f"{path}: expected an object with a 'results' list")
    return data


def results_table(results: Sequence[dict[str, Any]]) -> str:
    """The per-workload, per-method table as Markdown (also readable in a terminal).

    Args:
        results: The ``results`` rows of a results file.

    Returns:
        The table, one row per result, missing values as "–".
    """
    headers = ["workload", "method"] + [c[0] for c in COLUMNS]
    rows = [
        [str(r.get("workload", MISSING)), str(r.get("method", MISSING))]
        + [render(r.get(key)) for _, key, render in COLUMNS]
        for r in results
    ]
    return markdown_table(headers, rows)


def quality_table(turns: Sequence[dict[str, Any]], workload: str) -> str | None:
    """Mean of each numeric / boolean turn metric of one workload, per method.

    Returns:
        A Markdown table, or ``None`` when the workload's turns carry no such metric.
    """
    sums: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for t in turns:
        if t.get("workload") != workload or not isinstance(t.get("metrics"), dict):
            continue
        for key, value in t["metrics"].items():
            v = float(value) if isinstance(value, bool) else _num(value)
            if v is not None:
                sums[str(t.get("method", MISSING))][key].append(v)
    keys = sorted({k for per_method in sums.values() for k in per_method})
    if not keys:
        return None
    return markdown_table(["method", *keys], [
        [method, *(_mean(per_key.get(k)) for k in keys)] for method, per_key in sums.items()
    ])


def _mean(values: list[float] | None) -> str:
    return f"{sum(values) / len(values):.3g}" if values else MISSING


def turn_speedups(turns: Sequence[dict[str, Any]], workload: str) -> dict[str, dict[int, float]]:
    """Speed-up over greedy per turn index for each method of one workload.

    For each turn index, a method's throughput is its tokens over its seconds summed over
    the sessions that greedy also ran; the speed-up is that over greedy's throughput on the
    same turns. Without greedy turns the values are plain tokens/s.

    Returns:
        ``{method: {turn: value}}`` (greedy itself omitted when it is the reference).
    """
    by_key: dict[tuple[str, str, int], dict[str, Any]] = {}
    for t in turns:
        if t.get("workload") == workload and _num(t.get("turn")) is not None:
            by_key[(str(t.get("method")), str(t.get("session_id")), int(t["turn"]))] = t
    has_base = any(m == BASELINE for m, _, _ in by_key)
    totals: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0] * 4))
    for (method, session, turn), t in by_key.items():
        if has_base and method == BASELINE:
            continue
        base = by_key.get((BASELINE, session, turn)) if has_base else None
        tok, sec = _num(t.get("tokens")), _num(t.get("seconds"))
        if tok is None or not sec or (has_base and base is None):
            continue
        acc = totals[method][turn]
        acc[0] += tok
        acc[1] += sec
        if base is not None:
            acc[2] += _num(base.get("tokens")) or 0.0
            acc[3] += _num(base.get("seconds")) or 0.0
    out: dict[str, dict[int, float]] = {}
    for method, per_turn in totals.items():
        series = {}
        for turn, (tok, sec, btok, bsec) in sorted(per_turn.items()):
            tps = tok / sec
            if not has_base:
                series[turn] = tps
            elif btok and bsec:
                series[turn] = tps / (btok / bsec)
        if series:
            out[method] = series
    return out


def write_report(results_path: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write ``<stem>.report.md`` and the PNG plots for a results file ``<stem>.json``.

    Args:
        results_path: The harness's results JSON.
        out_dir: Where to write (created if needed); defaults to the results file's folder.

    Returns:
        The written files, the Markdown report first.

    Raises:
        BenchmarkError: The results file is missing or malformed.
    """
    data = load_results(results_path)
    try:
        from workflows.report.plots import plot_accepted_histograms, plot_speedups, plot_turns
    except ImportError as exc:  # matplotlib is the optional "report" extra
        raise BenchmarkError(
            f"the report needs matplotlib ({exc}): pip install 'agentspec[report]'"
        ) from exc
    out = Path(out_dir) if out_dir is not None else Path(results_path).parent
    out.mkdir(parents=True, exist_ok=True)
    results = [r for r in data["results"] if isinstance(r, dict)]
    turns = [t for t in data.get("turns") or [] if isinstance(t, dict)]
    workloads = list(dict.fromkeys(str(r.get("workload", MISSING)) for r in results))

    plots: list[Path] = []
    stem = Path(results_path).stem  # names follow the results file: runs never collide
    for path in (
        plot_speedups(results, out / f"{stem}.speedup.png"),
        plot_accepted_histograms(results, out / f"{stem}.accepted_hist.png"),
        plot_turns({w: turn_speedups(turns, w) for w in workloads},
                   out / f"{stem}.speedup_per_turn.png",
                   relative=any(t.get("method") == BASELINE for t in turns)),
    ):
        if path is not None:
            plots.append(path)

    md = ["# agentspec benchmark report", ""]
    md += [f"- **model**: {data.get('model', MISSING)}"]
    for section in ("machine", "config"):
        value = data.get(section)
        if isinstance(value, dict) and value:
            pairs = ", ".join(f"{k}={v}" for k, v in value.items())
            md.append(f"- **{section}**: {pairs}")
    md += ["", "## Speed", "", results_table(results), ""]
    md += [
        "Speed-up is relative to plain greedy decoding on the same prompts. *Loop share* is",
        "the fraction of generated tokens that repeat a short loop (see",
        "`workflows/bench/repetition.py`); *speed-up loop-free* counts only turns without loops.",
        "*Oracle fraction* is the share of an oracle drafter's speed-up the method reaches.",
        "",
    ]
    quality = [(w, quality_table(turns, w)) for w in workloads]
    if any(q for _, q in quality):
        md += ["## Quality (means of per-turn metrics)", ""]
        for workload, table in quality:
            if table:
                md += [f"### {workload}", "", table, ""]
    if plots:
        md += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    report = out / f"{stem}.report.md"
    report.write_text("\n".join(md), encoding="utf-8")
    return [report, *plots]


def main(argv: Sequence[str] | None = None) -> int:
    """``agentspec report`` as a function: write the report and print the table."""
    parser = argparse.ArgumentParser(prog="agentspec report", description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, help="results JSON written by agentspec bench")
    parser.add_argument("--out-dir", type=Path, default=None, help="output folder")
    args = parser.parse_args(argv)
    paths = write_report(args.results, args.out_dir)
    print(results_table(load_results(args.results)["results"]))
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
