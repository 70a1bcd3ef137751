"""The mixed-run view of one or more harness results files: every method's tokens/s over a
set of workloads pooled together, and its ratio to the other methods.

HVD's claim is about agent traffic as a whole (relays, tool calls and open chat interleaved),
so its figure of merit is the pooled tokens/s: total tokens over total seconds across the
workloads, per method. Usage::

    python -m workflows.bench.mixed results/relay.json results/agents.json \\
        --workloads delegate52,tool_agent,chat --out results/mixed.json

It prints a Markdown table (tokens/s, speed-up vs greedy, forwards per 1,000 tokens, and
each method's ratio to ``suffix`` and ``arctic_rule``) plus every method's ratio to the best
single source per workload, and writes the same numbers as JSON. Methods missing from a
workload are left out of the pooled figure (a partial pool would not compare).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentspec.errors import BenchmarkError

SINGLE_SOURCES = ("suffix", "model")  # HVD's two sources, each alone


def load_rows(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """All result rows of the files (``{"results": [...]}`` each).

    Raises:
        BenchmarkError: a file is missing or not a harness results file.
    """
    rows: list[dict[str, Any]] = []
    for path in paths:
        try:
            rows += json.loads(Path(path).read_text())["results"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BenchmarkError(f"{path} is not a readable harness results file ({exc})") from None
    return rows


def pooled(rows: Sequence[dict[str, Any]], workloads: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per method: tokens, seconds, forwards and tokens/s pooled over ``workloads``
    (only methods that ran on every one of them)."""
    by_method: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        if r["workload"] in workloads:
            by_method[r["method"]][r["workload"]] = r
    out: dict[str, dict[str, Any]] = {}
    for method, per in by_method.items():
        if set(per) != set(workloads):
            continue
        tokens = sum(int(per[w]["tokens"]) for w in workloads)
        seconds = sum(float(per[w]["seconds"]) for w in workloads)
        forwards = sum(float(per[w]["forwards_per_1k"]) * int(per[w]["tokens"]) / 1000
                       for w in workloads)
        out[method] = {
            "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
            "forwards_per_1k": round(1000 * forwards / tokens, 1) if tokens else None,
            "identical_to_greedy": all(per[w].get("identical_to_greedy") for w in workloads),
        }
    return out


def best_single(rows: Sequence[dict[str, Any]], method: str) -> dict[str, float | None]:
    """Per workload: ``method``'s tokens/s over the best of the single sources there."""
    per: dict[str, dict[str, float]] = defaultdict(dict)
    for r in rows:
        per[r["workload"]][r["method"]] = float(r["tokens_per_s"])
    out: dict[str, float | None] = {}
    for workload, speeds in per.items():
        singles = [speeds[m] for m in SINGLE_SOURCES if m in speeds]
        out[workload] = (round(speeds[method] / max(singles), 3)
                         if method in speeds and singles else None)
    return out


def _ratio(table: dict[str, dict[str, Any]], a: str, b: str) -> str:
    if a in table and b in table and table[b]["tokens_per_s"]:
        return f"{table[a]['tokens_per_s'] / table[b]['tokens_per_s']:.2f}×"
    return "–"


def render(table: dict[str, dict[str, Any]], workloads: Sequence[str]) -> str:
    """The Markdown table of :func:`pooled`."""
    lines = [f"Pooled over {', '.join(workloads)}:", "",
             "| method | tokens | tokens/s | vs greedy | vs suffix | vs arctic_rule | fwd/1k "
             "| identical |", "|---|---|---|---|---|---|---|---|"]
    for method, row in sorted(table.items(), key=lambda kv: kv[1]["tokens_per_s"] or 0):
        lines.append(
            f"| {method} | {row['tokens']} | {row['tokens_per_s']} | "
            f"{_ratio(table, method, 'greedy')} | {_ratio(table, method, 'suffix')} | "
            f"{_ratio(table, method, 'arctic_rule')} | {row['forwards_per_1k']} | "
            f"{'yes' if row['identical_to_greedy'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="python -m workflows.bench.mixed",
        description="Pool harness results over workloads (HVD's mixed run) and compare "
                    "methods by pooled tokens/s.")
    p.add_argument("results", nargs="+", type=Path, help="harness results JSON files")
    p.add_argument("--workloads", default="delegate52,tool_agent,chat",
                   help="workloads to pool (default: delegate52,tool_agent,chat)")
    p.add_argument("--method", default="hybrid",
                   help="method compared with the best single source per workload")
    p.add_argument("--out", type=Path, default=None, help="write the numbers as JSON here")
    args = p.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    rows = load_rows(args.results)
    table = pooled(rows, workloads)
    if not table:
        raise SystemExit(f"no method ran on every one of {workloads}")
    print(render(table, workloads))
    singles = best_single(rows, args.method)
    print(f"\n{args.method} / best single source ({', '.join(SINGLE_SOURCES)}) per workload: "
          + ", ".join(f"{w} {v}" for w, v in sorted(singles.items())))
    if args.out is not None:
        args.out.write_text(json.dumps({"workloads": workloads, "pooled": table,
                                        f"{args.method}_vs_best_single": singles}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
