"""agentspec's OpenAI-compatible server in front of a vLLM engine (one node or a Ray cluster).

::

    python -m adapters.vllm.serve --model /models/Llama-3.1-8B-Instruct \\
        --proposer agentspec --tensor-parallel-size 2 --dtype bfloat16 --port 8000

Same routes, API keys, tenants and ``X-Session-Id`` sessions as ``agentspec serve`` (its
argument parser is reused); the model runs in vLLM (tensor / pipeline parallel, Ray) and
drafts with vLLM's methods or agentspec's session cache (``--proposer agentspec``), keyed
by the tenant and session of every request; vLLM's prefix cache is salted per tenant
(:mod:`adapters.vllm.cache_salt`), so tenants never share KV. ``--store`` persists
finished turns from the proposer (``AGENTSPEC_VLLM_STORE``); without it session histories
live in the workers' memory.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from adapters.openai_server.cli import add_serve_parser, build_config
from adapters.vllm import envs
from agentspec.errors import AgentSpecError


def build_parser() -> argparse.ArgumentParser:
    """``agentspec serve``'s arguments plus the vLLM engine's."""
    parser = argparse.ArgumentParser(prog="python -m adapters.vllm")
    # --drafting and --draft-model (a draft model / EAGLE-3 head folder) are serve's, with
    # the methods vLLM runs.
    p = add_serve_parser(parser.add_subparsers(dest="command", required=True),
                         drafting=("none", "prompt_lookup", "suffix", "model"))
    p.add_argument("--proposer", choices=["vllm", "agentspec"], default="agentspec",
                   help="drafts from vLLM's methods or agentspec's session cache")
    p.add_argument("--payoff", choices=["off", "cost_aware"], default="off",
                   help="agentspec proposer: cut drafts to the payoff predictor's useful length")
    p.add_argument("--max-draft", type=int, default=32, help="num_speculative_tokens")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="GPU memory share (on CPU: RAM share for the KV cache; use ~0.5)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--no-enforce-eager", action="store_true",
                   help="allow CUDA graphs / compilation (faster on GPUs, slower start)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Start the engine and serve until interrupted (exit code 2 on a configuration error)."""
    import uvicorn

    from adapters.openai_server.app import create_app
    from adapters.vllm.backend import EngineSettings, VLLMRuntime
    from agentspec.spec import AgentSpec, DraftingPolicy

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
        if args.store is not None and not args.no_store:
            os.environ[envs.STORE] = str(Path(args.store).expanduser())
        spec = AgentSpec(drafting=DraftingPolicy(
            method=args.drafting, max_draft=args.max_draft, draft_model=args.draft_model,
        ))
        settings = EngineSettings(
            dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len, enforce_eager=not args.no_enforce_eager,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
        )
        runtime = VLLMRuntime.load(args.model, spec, args.proposer, settings, args.payoff)
    except (AgentSpecError, ValueError) as exc:
        print(f"agentspec vLLM serve: error: {exc}", file=sys.stderr)
        return 2
    app = create_app(runtime, config)
    print(f"agentspec (vLLM) serve: http://{args.host}:{args.port}/v1  "
          f"model={runtime.target.name}  proposer={args.proposer}", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=10)
    finally:
        runtime.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m adapters.vllm.serve [serve] ARGS``."""
    raw = list(sys.argv[1:] if argv is None else argv)
    if not raw or raw[0] != "serve":
        raw = ["serve", *raw]
    return run(build_parser().parse_args(raw))


if __name__ == "__main__":
    sys.exit(main())
