"""Interleaved A/B timing of two lossless drafters on the DELEGATE-52 relay.

``python -m workflows.ab_relay --methods suffix,arctic_suffix --limit 5 --turns 4``

The harness runs methods one after another, so a machine whose speed drifts during a long
run (a noisy neighbour, thermal limits) biases their ratio. Here every turn is decoded by
both methods back to back, in A-B / B-A order on alternate turns, each method keeping its
own session state; both are lossless, so their outputs — and hence the next turn's prompt
— are identical (checked). The ratio of summed engine times is the drift-free speed ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from agentspec.engine import EngineConfig
from agentspec.errors import BenchmarkError
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.types import RequestStats, SessionRef
from workflows.harness import _warm_up, load_workload
from workflows.methods import MethodContext, build_method


def run(methods: list[str], limit: int, turns: int, max_draft: int) -> dict[str, Any]:
    """Decode the relay with both methods interleaved; return per-method totals."""
    if len(methods) != 2:
        raise BenchmarkError(f"--methods needs exactly two names, got {methods}")
    target = HFTarget.load(TargetConfig())
    ctx = MethodContext(target, engine=EngineConfig(max_draft=max_draft))
    built = [build_method(m, ctx) for m in methods]
    _warm_up(target, ctx)
    totals = {m: RequestStats() for m in methods}
    per_turn: list[dict[str, Any]] = []
    sessions = list(load_workload("delegate52", None).sessions(limit, turns))
    total = sum(getattr(s, "turns", turns) for s in sessions)
    bar = tqdm(total=total, desc="relay A/B", file=sys.stderr)
    step = 0
    for sess in sessions:
        last: str | None = None
        while (req := sess.next_request(last)) is not None:
            prompt = req.prompt_ids(target.tokenizer)
            order = built if step % 2 == 0 else built[::-1]
            outs = {}
            for method in order:
                ref = SessionRef(sess.session_id, tenant=f"ab-{method.name}")
                outs[method.name] = method.run(prompt, req, ref)
                totals[method.name].merge(outs[method.name].stats)
            first, second = (outs[m] for m in methods)
            if first.tokens != second.tokens:
                raise BenchmarkError(f"{methods} disagree on {sess.session_id} turn {step}")
            per_turn.append({"session_id": sess.session_id, "tokens": len(first.tokens),
                             **{f"{m}_s": round(outs[m].stats.total_s, 4) for m in methods}})
            last = req.prefix + first.text
            step += 1
            bar.update(1)
    bar.close()
    summary = {m: {"tokens": s.generated_tokens, "seconds": round(s.total_s, 3),
                   "tokens_per_s": round(s.tokens_per_s, 2),
                   "mean_accepted_len": round(s.mean_accepted_len, 3),
                   "forwards_per_1k": round(s.forwards_per_1k, 1)} for m, s in totals.items()}
    a, b = methods
    ratio = summary[a]["tokens_per_s"] / summary[b]["tokens_per_s"]
    return {"methods": methods, "turns": per_turn, "summary": summary,
            f"{a}_over_{b}": round(ratio, 4)}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(prog="python -m workflows.ab_relay", description=__doc__
                                .split("\n")[0])
    p.add_argument("--methods", default="suffix,arctic_suffix",
                   help="two comma-separated lossless methods (default suffix,arctic_suffix)")
    p.add_argument("--limit", type=int, default=5, help="relay domains (default 5)")
    p.add_argument("--turns", type=int, default=4, help="turns per relay (default 4)")
    p.add_argument("--max-draft", type=int, default=32, help="longest draft (default 32)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = p.parse_args(argv)
    report = run(args.methods.split(","), args.limit, args.turns, args.max_draft)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    for m, s in report["summary"].items():
        print(f"{m:14s} {s['tokens_per_s']:8.1f} tok/s  acc {s['mean_accepted_len']:6.2f}  "
              f"fwd/1k {s['forwards_per_1k']:5.0f}  ({s['tokens']} tokens)")
    key = next(k for k in report if k.endswith(tuple(report["methods"][1:])) and "_over_" in k)
    print(f"{key}: {report[key]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
