"""``agentspec serve``: the OpenAI-compatible server on the command line.

Wired into :mod:`agentspec.cli` with :func:`add_serve_parser` and :func:`run_serve`. The
bind check runs before the model loads, so a refused host fails in milliseconds.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from adapters.openai_server.config import DEFAULT_MAX_REQUEST_BYTES, ServerConfig, check_bind
from agentspec.cli.args import add_device_arg, add_dtype_arg, non_negative_int, positive_int
from agentspec.errors import AgentSpecError, ConfigError

if TYPE_CHECKING:
    from agentspec.spec import AgentSpec

# agentspec.targets.cache.prefix_cache.DEFAULT_PREFIX_CACHE_BYTES in MiB, the floor of the default
# (auto-sized) budget (a unit test checks it);
# not imported here: that module pulls in torch, and a refused bind must fail in ms.
DEFAULT_PREFIX_CACHE_MB = 1024


def _positive_seconds(value: str) -> float:
    """Seconds > 0 (argparse reports a bad value as a usage error)."""
    s = float(value)
    if not s > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {value}")
    return s


def _non_negative_seconds(value: str) -> float:
    """Seconds >= 0 (0 switches the limit off)."""
    s = float(value)
    if not s >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds (0: no limit), got {value}")
    return s


#: The drafting methods ``serve --drafting`` takes (the vLLM backend takes its own subset).
DRAFTING = ("suffix", "hybrid", "model", "prompt_lookup", "none")


def add_serve_parser(subparsers: argparse._SubParsersAction,
                     drafting: tuple[str, ...] = DRAFTING) -> argparse.ArgumentParser:
    """Add the ``serve`` command to ``agentspec``'s subparsers; return its parser.
    ``drafting``: the methods ``--drafting`` takes (the backend's)."""
    from agentspec.storage.sessions import StoreConfig  # no torch: sqlite and the ids only

    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serves /v1/chat/completions (streaming, tools), /v1/models, /health and "
                    "/metrics. Sessions come from the X-Session-Id header (or `user`). Without "
                    "API keys the server is local-only and binds loopback only; with keys "
                    "(--api-keys or AGENTSPEC_API_KEYS='key=tenant,...') each key's tenant "
                    "gets its own isolated caches.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--model", default=None,
                   help="a shipped model's name (default: the embedded smollm2-135m-instruct; "
                        "`agentspec models` lists them) or a local Hugging Face folder")
    p.add_argument("--tool-format", default=None,
                   choices=["hermes", "llama3_json", "mistral", "mistral_v11", "fallback"],
                   help="the model's tool-call format (default: chosen from its chat template)")
    add_dtype_arg(p)
    p.add_argument("--drafting", default="suffix", choices=list(drafting),
                   help="where drafts come from for requests that name no agent spec: the "
                        "session cache (suffix, default), HVD's choice per step between the "
                        "cache and a draft model (hybrid), the draft model alone (model), "
                        "n-grams of the prompt (prompt_lookup) or none (plain decoding); "
                        f"this backend takes {', '.join(drafting)}")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="the draft model of hybrid / model drafting: a shipped model's name or "
                        "a local Hugging Face folder sharing the model's tokenizer (default: "
                        "the one the shipped model names, e.g. the 0.5B for the 1.5B, else "
                        "its EAGLE head or distilled drafter)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models lists (default: the model's)")
    p.add_argument("--api-keys", type=Path, default=None, metavar="FILE",
                   help='JSON or TOML file {"keys": {"<key>": "<tenant>"}}; adds to '
                        "AGENTSPEC_API_KEYS")
    store = p.add_mutually_exclusive_group()
    store.add_argument("--store", type=Path, default=None, metavar="PATH",
                       help="session store file (default: sessions.sqlite3 in AGENTSPEC_HOME)")
    store.add_argument("--no-store", action="store_true",
                       help="keep session caches in memory only")
    p.add_argument("--tenant-max-sessions", type=positive_int, default=None, metavar="N",
                   help="sessions stored per tenant; a tenant past it evicts its own least "
                        "recently used sessions (default: no per-tenant cap)")
    p.add_argument("--tenant-max-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens stored per tenant, evicting within the tenant (default: no cap)")
    p.add_argument("--store-max-tokens", type=positive_int,
                   default=StoreConfig.max_total_tokens, metavar="N",
                   help="tokens stored in the whole store (4 bytes each: the bound on its "
                        "size); past it the tenant holding the most tokens loses its least "
                        "recently used sessions (default %(default)s, about 1 GB)")
    p.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"larger request bodies get HTTP 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--default-max-tokens", type=positive_int, default=256,
                   help="completion tokens when a request sets no max_tokens (default 256)")
    p.add_argument("--max-tokens-limit", type=positive_int, default=4096,
                   help="largest max_tokens a request may ask for (default 4096)")
    p.add_argument("--max-waiting", type=positive_int, default=256,
                   help="requests that may queue for the model; more get HTTP 503 (default 256)")
    p.add_argument("--max-waiting-per-tenant", type=positive_int, default=None, metavar="N",
                   help="of those, requests one tenant (API key) may queue; more get HTTP 429 "
                        "while other tenants still get in (default: a quarter of "
                        "--max-waiting, at least 1; without API keys, all of it)")
    p.add_argument("--max-queue-wait-s", type=_positive_seconds, default=300.0, metavar="S",
                   help="a request that waited longer for the model gets HTTP 503 "
                        "queue_timeout instead of running (default 300)")
    p.add_argument("--max-generation-s", type=_non_negative_seconds, default=600.0,
                   metavar="S",
                   help="a generation running longer stops and is answered with what it has, "
                        "finish_reason 'length', its turn not stored (0: no limit; default 600)")
    add_device_arg(p)
    p.add_argument("--prefix-cache-mb", type=non_negative_int, default=None,
                   metavar="MB",
                   help="memory for prompt prefixes' KV reused across a tenant's requests "
                        "(MiB; 0 disables prefix reuse; default: a quarter of the memory "
                        f"available on the model's device, {DEFAULT_PREFIX_CACHE_MB} MiB to "
                        "8 GiB; see docs/prefix-cache.md)")
    p.add_argument("--prefix-cache-disk-mb", type=non_negative_int, default=0, metavar="MB",
                   help="disk for copies of the prefix KV under AGENTSPEC_HOME/prefix-kv, so "
                        "sessions reuse it after a restart (MiB; default 0: memory only)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    return p


def build_config(args: argparse.Namespace) -> ServerConfig:
    """The :class:`ServerConfig` of parsed ``serve`` arguments (keys loaded, bind checked).

    Raises:
        ConfigError: bad key file, or a non-loopback host without keys.
    """
    from adapters.openai_server.auth import load_keys

    keys = load_keys(args.api_keys)
    check_bind(args.host, keys)
    return ServerConfig(
        keys=keys, model_name=args.served_model_name, max_request_bytes=args.max_request_bytes,
        default_max_tokens=min(args.default_max_tokens, args.max_tokens_limit),
        max_tokens_limit=args.max_tokens_limit, max_waiting=args.max_waiting,
        max_waiting_per_tenant=args.max_waiting_per_tenant,
        max_queue_wait_s=args.max_queue_wait_s, max_generation_s=args.max_generation_s,
        owns_runtime=True,  # SIGTERM checkpoints and closes the store (see docs/reliability.md)
    )


def serve_spec(args: argparse.Namespace) -> AgentSpec:
    """The policy of requests that name no agent spec (``--drafting``, ``--draft-model``).

    Raises:
        ConfigError: the two do not go together (a draft model without a model drafter).
    """
    from agentspec.spec import AgentSpec, DraftingPolicy

    if args.draft_model is not None and args.drafting not in ("hybrid", "model"):
        raise ConfigError(f"--draft-model {args.draft_model!r} drafts under --drafting hybrid "
                          f"or model only, got --drafting {args.drafting}")
    return AgentSpec(drafting=DraftingPolicy(method=args.drafting,
                                             draft_model=args.draft_model))


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted; return the exit code (2 on a configuration error)."""
    try:
        config = build_config(args)
        spec = serve_spec(args)
    except AgentSpecError as exc:
        print(f"agentspec serve: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from adapters.openai_server.app import create_app
    from agentspec.runtime import Runtime

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from agentspec.storage.sessions import StoreConfig

    store: Path | bool = False if args.no_store else (args.store or True)
    quotas = StoreConfig(max_sessions_per_tenant=args.tenant_max_sessions,
                         max_tokens_per_tenant=args.tenant_max_tokens,
                         max_total_tokens=args.store_max_tokens)
    try:
        budget = None if args.prefix_cache_mb is None else args.prefix_cache_mb << 20
        runtime = Runtime.load(args.model, dtype=args.dtype, store=store, store_config=quotas,
                               tool_format=args.tool_format, device=args.device,
                               prefix_cache_bytes=budget,
                               prefix_spill_bytes=args.prefix_cache_disk_mb << 20)
        # The drafter of the default policy loads now: a draft model that cannot load is a
        # start-up error, not every request's.
        runtime.default_spec = spec
        runtime.drafter_for(spec)
    except AgentSpecError as exc:
        print(f"agentspec serve: error: {exc}", file=sys.stderr)
        return 2
    app = create_app(runtime, config)
    mode = "local-only (no API keys)" if config.local_only else \
        f"{len(config.keys.tenants)} tenant(s)"
    print(f"agentspec serve: http://{args.host}:{args.port}/v1  model={runtime.target.name}  "
          f"{mode}", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=10)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``serve`` on its own (``python -m adapters.openai_server.cli``)."""
    parser = argparse.ArgumentParser(prog="agentspec")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
