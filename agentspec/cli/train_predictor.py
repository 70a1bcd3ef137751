"""``agentspec train-predictor``: greedy traces -> trace replay -> payoff predictor.

Traces come from ``--traces FILE`` (a trace file, see
:mod:`agentspec.training.payoff_traces`) or are generated from the workloads' sessions (a
:class:`~agentspec.training.payoff_traces.SessionSource` that the console script hands in:
training never imports the benchmark harness) and cached under ``$AGENTSPEC_HOME/traces``
(the same settings reuse the same file, so a second run only replays and trains).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from agentspec.cli.args import add_device_arg, positive_int
from agentspec.training.payoff_traces import SessionSource, TraceSpec

_DEFAULT_WORKLOADS = ",".join(TraceSpec().workloads)


def add_train_predictor_parser(sub: Any) -> None:
    """Register the ``train-predictor`` subcommand on ``sub`` (argparse subparsers)."""
    p = sub.add_parser(
        "train-predictor", help="train the HVD payoff predictor from greedy traces",
        description="Replays greedy traces of the target: at every output position the "
                    "session cache is rebuilt, its draft is made, and the draft's oracle "
                    "accepted length is the common prefix with the true continuation. An MLP "
                    "regresses it from the runtime features (MSE); sessions are split into "
                    "train/validation (never steps); the threshold tau is chosen on "
                    "validation. Prints held-out MAE/RMSE and precision/recall of "
                    "high-payoff drafts (accepted >= 6).",
    )
    p.add_argument("--traces", type=Path, default=None,
                   help="trace file (JSON lines) to train on; default: generate greedy traces "
                        "of --workloads (cached under $AGENTSPEC_HOME/traces)")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write the predictor JSON (default: "
                        "$AGENTSPEC_HOME/payoff/<model>.json)")
    p.add_argument("--report", type=Path, default=None,
                   help="also write the training report (JSON) here")
    add_device_arg(p)
    p.add_argument("--model", default=None,
                   help="target model: a shipped model's name (default: embedded) or a "
                        "local HF folder")
    p.add_argument("--workloads", default=_DEFAULT_WORKLOADS,
                   help=f"workloads to trace (default: {_DEFAULT_WORKLOADS})")
    p.add_argument("--data", default=None,
                   help="workload data folder (default: $AGENTSPEC_DATA or the packaged fixture)")
    p.add_argument("--limit", type=positive_int, default=TraceSpec.limit,
                   help=f"sessions per workload (default {TraceSpec.limit})")
    p.add_argument("--exclude", default="",
                   help="comma-separated session ids never to trace")
    p.add_argument("--exclude-bench", action="store_true",
                   help="never trace the sessions `make bench` measures (the first 5 of each "
                        "workload in the packaged fixture), so benchmark figures stay held out")
    p.add_argument("--turns", type=positive_int, default=TraceSpec.turns,
                   help=f"turns per session (default {TraceSpec.turns})")
    p.add_argument("--max-tokens", type=positive_int, default=TraceSpec.max_tokens,
                   help=f"cap on tokens per traced turn (default {TraceSpec.max_tokens})")
    p.add_argument("--trace-tokens", type=positive_int, default=TraceSpec.max_total_tokens,
                   help="stop tracing after this many output tokens "
                        f"(default {TraceSpec.max_total_tokens}; the CPU decodes ~15-25 tok/s)")
    p.add_argument("--save-traces", type=Path, default=None,
                   help="also copy the generated traces here")
    p.add_argument("--max-draft", type=positive_int, default=32,
                   help="cache draft length during replay: the engine's max_draft (default 32, "
                        "as `agentspec bench` and `make bench` run)")
    p.add_argument("--val-fraction", type=float, default=0.3,
                   help="share of each workload's sessions held out (default 0.3)")
    p.add_argument("--epochs", type=positive_int, default=400, help="Adam epochs (default 400)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split and the MLP")
    p.add_argument("--no-residual", action="store_true",
                   help="predict the accepted length from scratch instead of as a learned "
                        "correction to the suffix tree's score (the default)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run_train_predictor(args: argparse.Namespace, sessions: SessionSource) -> int:
    """Run ``train-predictor``; AgentSpecErrors propagate to the CLI's handler.

    Args:
        args: The parsed command line (:func:`add_train_predictor_parser`).
        sessions: Where the sessions to trace come from (the workloads).
    """
    from agentspec.models import agentspec_home
    from agentspec.payoff.defaults import token_table
    from agentspec.targets.hf import HFTarget, TargetConfig
    from agentspec.training.payoff_fit import TrainConfig, train_predictor
    from agentspec.training.payoff_traces import (
        generate_traces,
        read_traces,
        tokenizer_fingerprint,
        write_traces,
    )

    cfg = TrainConfig(val_fraction=args.val_fraction, max_draft=args.max_draft,
                      epochs=args.epochs, seed=args.seed, residual=not args.no_residual)
    progress = not args.no_progress
    if args.traces is not None:
        read_traces(args.traces)  # empty / malformed files fail before the model loads
    target = HFTarget.load(TargetConfig(model=args.model, device=args.device))
    fingerprint = tokenizer_fingerprint(target.tokenizer)
    if args.traces is not None:
        path = args.traces
    else:
        workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
        exclude = tuple(x.strip() for x in args.exclude.split(",") if x.strip())
        if args.exclude_bench:
            exclude += sessions.bench_ids(workloads)
        spec = TraceSpec(
            workloads=workloads,
            limit=args.limit, turns=args.turns, max_tokens=args.max_tokens,
            max_total_tokens=args.trace_tokens, data_dir=args.data, exclude=exclude,
        )
        path = agentspec_home() / "traces" / spec.cache_key(target.name, fingerprint)
        if path.is_file():
            print(f"reusing cached traces {path}", file=sys.stderr)
        else:
            queues = sessions.select(spec)
            write_traces(generate_traces(target, spec, queues, progress=progress), path)
        if args.save_traces is not None:
            args.save_traces.parent.mkdir(parents=True, exist_ok=True)
            args.save_traces.write_text(path.read_text())
    traces = read_traces(path, vocab_size=target.vocab_size, tokenizer=fingerprint)
    print(f"traces: {len(traces.traces)} sessions, {traces.num_output_tokens} output tokens "
          f"({path})", file=sys.stderr)
    pred, report = train_predictor(traces, token_table(target), cfg, progress=progress)
    out = args.out or agentspec_home() / "payoff" / f"{target.name}.json"
    pred.save(out)
    report["predictor"] = str(out)
    report["traces"] = str(path)
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=1))
    q = report["validation"]
    print(f"held-out sessions: {report['sessions']['validation']} "
          f"({q['rows']} cache drafts, {q['positives']} with accepted >= 6)")
    print(f"MAE {q['mae']:.3f}  RMSE {q['rmse']:.3f}  tau {q['tau']:.2f}  "
          f"precision(>=6) {q['precision']:.3f}  recall(>=6) {q['recall']:.3f}")
    base = report["baseline_suffix_score"]
    print(f"baseline (suffix score as prediction): MAE {base['mae']:.3f}  "
          f"precision {base['precision']:.3f}  recall {base['recall']:.3f}")
    print(f"predictor written to {out}")
    return 0
