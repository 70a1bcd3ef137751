"""The ``agentspec replay`` subcommand: argument parsing and output (see
workflows.replay.runner)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from workflows.replay.runner import DEFAULT_METHODS, replay_table, run_replay


def _methods(value: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list of methods")
    return items


def add_replay_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``agentspec replay``."""
    p = sub.add_parser(
        "replay", help="replay real agent logs through drafters (no model needed)",
        description="Replays every assistant turn of agent logs (SWE-agent .traj files, or a "
                    "JSONL of OpenAI-format message lists, one agent run per line) through "
                    "each drafter, taking the logged answer as the target's output: mean "
                    "accepted length, drafting cost per step and the estimated speed-up.",
    )
    p.add_argument("paths", nargs="*", type=Path,
                   help=".traj / .jsonl files or folders (default: the packaged SWE-agent "
                        "trajectories)")
    p.add_argument("--methods", type=_methods, default=_methods(DEFAULT_METHODS),
                   help=f"comma-separated methods (default: {DEFAULT_METHODS}; also "
                        "suffix_python, and ceiling_match<k> for any k >= 1: the copy "
                        "ceiling of a drafter that needs k tokens of matched context)")
    p.add_argument("--max-draft", type=int, default=32, help="longest draft (default 32)")
    p.add_argument("--model", default=None,
                   help="target whose chat template, tool format and c(k) are used: a "
                        "shipped model's name (default: embedded) or a folder")
    p.add_argument("--no-costs", action="store_true",
                   help="skip loading the target to measure c(k) (est_speedup is null)")
    p.add_argument("--cost-curve", type=Path, default=None,
                   help="c(k) JSON ({\"costs\": {\"k\": seconds}}) instead of measuring the "
                        "target now (a busy machine measures nonsense)")
    p.add_argument("--gpu-step-ms", type=float, default=15.0,
                   help="flat cost of one verification step for est_speedup_gpu (default 15)")
    p.add_argument("--context-tokens", type=int, default=0,
                   help="prefix each session's prompts with this many tokens of the other "
                        "sessions' text, to time drafting on long histories (e.g. 32768)")
    p.add_argument("--tenant", default="default", help="tenant of runs that name none")
    p.add_argument("--agent", default="default", help="agent of runs that name none")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run_replay_cli(args: argparse.Namespace) -> int:
    """Run ``agentspec replay``; print the table (and write the JSON)."""
    report = run_replay(
        args.paths, args.methods, max_draft=args.max_draft, model=args.model,
        costs=not args.no_costs, gpu_step_ms=args.gpu_step_ms, tenant=args.tenant,
        agent=args.agent, progress=not args.no_progress, context_tokens=args.context_tokens,
        cost_curve=args.cost_curve,
    )
    print(replay_table(report["results"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"results written to {args.out}")
    return 0
