"""Interleaved timing of several lossless methods over a mix of workloads.

``python -m workflows.bench.interleaved --methods hybrid,suffix,arctic_rule``
``--out results/mixed.json``

The harness runs methods one after another, so a machine whose speed drifts during a long
run (a noisy neighbour, thermal limits: ~10-20 % within a day on these machines) biases
their ratios by more than the differences being measured. Here every turn of every session
is decoded by each method back to back, the order rotating from turn to turn, each method
keeping its own session state. All methods are lossless, so their outputs (and hence the
next turn's prompt) are identical; that is checked on every turn. The ratio of summed engine
times is then a drift-free speed ratio.

The default mix is ``make bench``'s: 5 DELEGATE-52 relays × 4 turns plus 3 tool-agent
sessions and 3 open chats × 2 turns. It prints a per-workload table and the pooled one
(total tokens over total seconds per method, the mixed-run figure of HVD) and each
method's pooled ratio to every other. ``oracle`` may be listed: it drafts the turn's true
continuation (taken from the other methods' common output), so it runs after them in every
turn and gives the ceiling of any drafter at this draft cap.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from agentspec.chat.formats import format_for
from agentspec.engine import EngineConfig
from agentspec.errors import BenchmarkError
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.types import RequestStats, SessionRef
from workflows.bench.harness import _warm_up, check_names
from workflows.bench.methods import MethodContext, build_method
from workflows.report.markdown import markdown_table
from workflows.workloads.registry import load_workload

DEFAULT_MIX = "delegate52:5x4,tool_agent:3x2,chat:3x2"


@dataclass(frozen=True)
class Part:
    """One workload of the mix: ``limit`` sessions of at most ``turns`` turns."""

    workload: str
    limit: int
    turns: int


def parse_mix(spec: str) -> list[Part]:
    """``"delegate52:5x4,chat:3x2"`` → parts.

    Raises:
        BenchmarkError: a malformed entry (the message names it).
    """
    parts = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        try:
            name, shape = item.split(":")
            limit, turns = (int(v) for v in shape.lower().split("x"))
        except ValueError:
            raise BenchmarkError(f"bad mix entry {item!r}: expected WORKLOAD:LIMITxTURNS, "
                                 "e.g. delegate52:5x4") from None
        if limit < 1 or turns < 1:
            raise BenchmarkError(f"bad mix entry {item!r}: limit and turns must be >= 1")
        parts.append(Part(name, limit, turns))
    if not parts:
        raise BenchmarkError("the mix is empty")
    return parts


def _stats_row(stats: RequestStats) -> dict[str, Any]:
    return {"tokens": stats.generated_tokens, "seconds": round(stats.total_s, 3),
            "tokens_per_s": round(stats.tokens_per_s, 2),
            "mean_accepted_len": round(stats.mean_accepted_len, 3),
            "forwards_per_1k": round(stats.forwards_per_1k, 1),
            "drafter_wins": stats.drafter_wins()}


def run(methods: list[str], mix: list[Part], max_draft: int = 32, progress: bool = True,
        target: HFTarget | None = None) -> dict[str, Any]:
    """Decode the mix with every method interleaved turn by turn; return the totals.

    Args:
        methods: Method names (``workflows.bench.methods``); all must be lossless.
        mix: The workloads and how many sessions and turns of each.
        max_draft: Longest draft per verification.
        progress: Show a progress bar over turns.
        target: An already loaded model (tests reuse one); the embedded model otherwise.

    Raises:
        BenchmarkError: fewer than two methods, an unknown name, or methods that disagree.
    """
    if len(methods) < 2 or len(set(methods)) != len(methods):
        raise BenchmarkError(f"--methods needs two or more distinct names, got {methods}")
    check_names(methods, [p.workload for p in mix])
    if target is None:
        target = HFTarget.load(TargetConfig())
    ctx = MethodContext(target, engine=EngineConfig(max_draft=max_draft))
    built = [build_method(m, ctx) for m in methods]
    timed = [m for m in built if m.name != "oracle"]
    oracle = [m for m in built if m.name == "oracle"]
    _warm_up(target, ctx)
    totals: dict[str, dict[str, RequestStats]] = defaultdict(
        lambda: {m: RequestStats() for m in methods})
    per_turn: list[dict[str, Any]] = []
    fmt = format_for(target.tokenizer)  # the tool agent speaks the model's tool format
    loads = [(p, list(load_workload(p.workload, None, tool_format=fmt)
                      .sessions(p.limit, p.turns))) for p in mix]
    bar = tqdm(total=sum(getattr(s, "turns", p.turns) for p, ss in loads for s in ss),
               desc="interleaved", disable=not progress, file=sys.stderr)
    step = 0
    for part, sessions in loads:
        for sess in sessions:
            last: str | None = None
            while (req := sess.next_request(last)) is not None:
                prompt = req.prompt_ids(target.tokenizer)
                shift = step % len(timed)
                order = timed[shift:] + timed[:shift]  # rotate: no method always runs first
                outs = {}
                for method in order:
                    ref = SessionRef(sess.session_id, tenant=f"il-{method.name}")
                    outs[method.name] = method.run(prompt, req, ref)
                tokens = outs[timed[0].name].tokens
                if any(o.tokens != tokens for o in outs.values()):
                    raise BenchmarkError(
                        f"methods disagree on {sess.session_id} turn {step}: "
                        + ", ".join(f"{m}={len(o.tokens)} tokens" for m, o in outs.items()))
                for method in oracle:
                    ctx.oracle.add(prompt, tokens)
                    ref = SessionRef(sess.session_id, tenant=f"il-{method.name}")
                    outs[method.name] = method.run(prompt, req, ref)
                for name, out in outs.items():
                    totals[part.workload][name].merge(out.stats)
                per_turn.append({"workload": part.workload, "session_id": sess.session_id,
                                 "tokens": len(tokens),
                                 **{f"{m}_s": round(o.stats.total_s, 4)
                                    for m, o in outs.items()}})
                last = req.prefix + outs[timed[0].name].text
                step += 1
                bar.update(1)
    bar.close()
    pooled = {m: RequestStats() for m in methods}
    for per in totals.values():
        for m, s in per.items():
            pooled[m].merge(s)
    summary = {m: _stats_row(s) for m, s in pooled.items()}
    return {
        "model": target.name, "dtype": target.dtype, "methods": methods,
        "mix": [p.__dict__ for p in mix],
        "max_draft": max_draft,
        "workloads": {w: {m: _stats_row(s) for m, s in per.items()} for w, per in totals.items()},
        "pooled": summary,
        "pooled_ratios": {f"{a}_over_{b}": round(summary[a]["tokens_per_s"]
                                                 / summary[b]["tokens_per_s"], 4)
                          for a in methods for b in methods if a != b},
        "turns": per_turn,
    }


def interleaved_table(report: dict[str, Any]) -> str:
    """Markdown: tokens/s per workload and pooled, and forwards per 1,000 tokens."""
    methods = report["methods"]
    cols = [*report["workloads"], "pooled"]
    per = [report["workloads"][w] for w in report["workloads"]] + [report["pooled"]]
    lines = [markdown_table(
        ["method", *(f"{c} tok/s" for c in cols), "pooled fwd/1k"],
        [[m, *(f"{p[m]['tokens_per_s']:.1f}" for p in per),
          f"{report['pooled'][m]['forwards_per_1k']:.0f}"] for m in methods])]
    if "greedy" in methods:
        lines += ["", markdown_table(
            ["method", *(f"{c} vs greedy" for c in cols)],
            [[m, *(f"{p[m]['tokens_per_s'] / p['greedy']['tokens_per_s']:.2f}×" for p in per)]
             for m in methods])]
    lines.append("")
    first = methods[0]
    lines += [f"{first} / {b} pooled: {report['pooled_ratios'][f'{first}_over_{b}']:.3f}"
              for b in methods[1:]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(prog="python -m workflows.bench.interleaved",
                                description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="hybrid,suffix,arctic_rule",
                   help="two or more comma-separated lossless methods; ratios are reported "
                        "for the first against the others (default hybrid,suffix,arctic_rule)")
    p.add_argument("--mix", default=DEFAULT_MIX,
                   help=f"WORKLOAD:LIMITxTURNS entries (default {DEFAULT_MIX})")
    p.add_argument("--max-draft", type=int, default=32, help="longest draft (default 32)")
    p.add_argument("--model", default=None,
                   help="target: a shipped model's name or a Hugging Face folder (default: "
                        "the embedded model)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    mix = parse_mix(args.mix)  # a malformed mix fails before the model loads
    target = HFTarget.load(TargetConfig(model=args.model)) if args.model else None
    report = run(methods, mix, args.max_draft, progress=not args.no_progress, target=target)
    emit(report, args.out)
    return 0


def emit(report: dict[str, Any], out: Path | None) -> None:
    """Write the report as JSON (when ``out`` is given) and print its table."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    print(interleaved_table(report))


if __name__ == "__main__":
    sys.exit(main())
