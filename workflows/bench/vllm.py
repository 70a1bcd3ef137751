"""vLLM plain vs vLLM's drafters vs agentspec's proposer on the same agent sessions.

Run in the vLLM environment (``make vllm-env``)::

    .venv-vllm/bin/python -m workflows.bench.vllm --out results/vllm_bench.json

Each configuration starts its own vLLM engine in a fresh subprocess (engines do not share a
process cleanly, and a crash of one must not hide the others' numbers), warms it up with one
tiny request, then replays the same sessions: DELEGATE-52 relays (each turn re-emits the
previous turn's document) and the smoke JSON-editing agent. ``vllm_plain`` runs first and
its token ids are the reference: with fp32 greedy decoding every configuration must emit
exactly the same tokens (``identical``). tokens/s is generated tokens over the requests'
wall-clock seconds (prefill included, engine start-up and warm-up excluded); ``acc.len``
(tokens per engine step) does not depend on machine load, tokens/s does: each run records
the 1-minute load average after it.

``--workloads traces`` drives the logged SWE-agent runs instead (as ``agentspec drive``;
:mod:`workflows.bench.vllm_driven`): each run a session of logged prompts, the model
answering each turn, ``--concurrency`` sessions in flight. Concurrent runs also report
vLLM's automatic prefix cache (``prefix hit``: share of looked-up prompt tokens whose KV
was reused; it stays on for every configuration) and its spec-decode counters.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentspec.errors import BenchmarkError
from agentspec.types import SamplingParams, SessionRef
from workflows.bench.vllm_driven import WORKLOAD as DRIVEN
from workflows.replay.logs import PACKAGED_TRACES
from workflows.report.markdown import markdown_table

# name -> (AgentSpec drafting.method, proposer, payoff gate)
CONFIGS: dict[str, tuple[str, str, str]] = {
    "vllm_plain": ("none", "vllm", "off"),
    "vllm_ngram": ("prompt_lookup", "vllm", "off"),
    "vllm_suffix": ("suffix", "vllm", "off"),
    "agentspec_proposer": ("suffix", "agentspec", "off"),
    "agentspec_payoff": ("suffix", "agentspec", "cost_aware"),
}
DEFAULT_CONFIGS = ("vllm_plain", "vllm_suffix", "agentspec_proposer")
REFERENCE = "vllm_plain"


def _session_id(raw: str) -> str:
    """A valid agentspec session id for a workload's session name."""
    return re.sub(r"[^A-Za-z0-9_.:@-]", "-", raw)[:128] or "session"


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start one engine, replay every session, return per-turn records (this process)."""
    from adapters.vllm.backend import EngineSettings, VLLMRuntime
    from agentspec.spec import AgentSpec, DraftingPolicy
    from workflows.workloads.registry import load_workload

    method, proposer, payoff = CONFIGS[name]
    spec = AgentSpec(drafting=DraftingPolicy(method=method, max_draft=args.max_draft))  # type: ignore[arg-type]
    settings = EngineSettings(
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len
    )
    stats_file = Path(tempfile.mkdtemp()) / "proposer_stats.json"
    from adapters.vllm import envs

    os.environ[envs.STATS] = str(stats_file)  # read by the proposer's worker
    start = time.perf_counter()
    rt = VLLMRuntime.load(args.model, spec, proposer, settings, payoff)  # type: ignore[arg-type]
    start_s = time.perf_counter() - start
    extra: dict[str, Any] = {}
    try:
        rt.chat([{"role": "user", "content": "Say hi."}], max_tokens=4)  # warm-up
        turns: list[dict[str, Any]] = []
        # Logged agent runs (``traces``) always go through the scheduler: their requests
        # carry token ids, not messages (at concurrency 1 it sends one request at a time).
        if args.concurrency > 1 or DRIVEN in args.workloads:
            from workflows.bench.vllm_concurrency import run_concurrent
            from workflows.bench.vllm_driven import (
                draftable_content,
                driven_jobs,
                driven_sessions,
                session_names,
            )

            tenant = f"bench-{name}"
            jobs: list[tuple[str, SessionRef, Any]] = []
            chains: list[Any] = []
            for wl_name in args.workloads:
                if wl_name == DRIVEN:
                    chains = driven_sessions(rt.tokenizer, args.traces, args.max_prompt,
                                             args.max_tokens, args.trace_turns)
                    jobs.extend(driven_jobs(chains, tenant))
                    continue
                jobs.extend(
                    (wl_name, SessionRef(_session_id(sess.session_id), tenant=tenant), sess)
                    for sess in load_workload(wl_name, args.data, tool_format=rt.tool_format)
                    .sessions(args.limit, args.turns))
            greedy = SamplingParams()
            before = rt.counters()
            run = run_concurrent(rt, jobs, args.concurrency, args.max_tokens,
                                 lambda n, stop: rt._sampling_params(greedy, n, stop))
            turns = run.turns
            extra = {**run.summary(), "vllm_counters": _counters(rt.counters() - before)}
            if chains:
                extra["driven_sessions"] = session_names(chains)
                extra["draftable"] = draftable_content(
                    chains, [t for t in turns if t["workload"] == DRIVEN])
        else:
            turns = _sequential_turns(rt, args, name)
        # vLLM may switch prefix caching off for some models/platforms: record what ran.
        extra["enable_prefix_caching"] = bool(
            rt.engine.vllm_config.cache_config.enable_prefix_caching)
    finally:
        rt.shutdown()
    if stats_file.is_file():  # only agentspec's proposer writes it
        extra["proposer_stats"] = json.loads(stats_file.read_text())
    return {"config": name, "method": method, "proposer": proposer, "payoff": payoff,
            "start_s": round(start_s, 2), "load_avg_1m_after": round(os.getloadavg()[0], 2),
            "concurrency": args.concurrency, "turns": turns, **extra}


def _counters(delta: Any) -> dict[str, Any]:
    """vLLM's counters over a run (a :class:`adapters.vllm.stats.SpecCounters` difference):
    spec-decode drafts and the automatic prefix cache's looked-up / hit prompt tokens."""
    return {"drafts": delta.drafts, "draft_tokens": delta.draft_tokens,
            "accepted": delta.accepted, "prefix_queries": delta.prefix_queries,
            "prefix_hits": delta.prefix_hits,
            "prefix_hit_rate": round(delta.prefix_hit_rate, 4)}


def _sequential_turns(rt: Any, args: argparse.Namespace, name: str) -> list[dict[str, Any]]:
    """One request at a time, sessions one after the other."""
    from workflows.workloads.registry import load_workload

    turns: list[dict[str, Any]] = []
    for wl_name in args.workloads:
        workload = load_workload(wl_name, args.data, tool_format=rt.tool_format)
        for sess in workload.sessions(args.limit, args.turns):
            ref = SessionRef(_session_id(sess.session_id), tenant=f"bench-{name}")
            last: str | None = None
            turn = 0
            while (req := sess.next_request(last)) is not None:
                turn += 1
                out = rt.chat(
                    req.messages, req.tools, session=ref, stop=req.stop,
                    max_tokens=min(req.max_tokens, args.max_tokens),
                    assistant_prefix=getattr(req, "prefix", ""),  # opens the answer
                )
                turns.append({
                    "workload": wl_name, "session_id": ref.session_id, "turn": turn,
                    "prompt_tokens": out.prompt_tokens, "tokens": out.tokens,
                    "seconds": out.stats.total_s, "forwards": out.stats.forwards,
                    "accepted_histogram": out.stats.accepted_histogram(),
                    "finish_reason": out.finish_reason,
                })
                last = out.text
    return turns


def _run_isolated(name: str, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """:func:`run_config` in a fresh interpreter (one engine per process)."""
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "part.json"
        cmd = [sys.executable, "-m", "workflows.bench.vllm", *argv, "--one", name,
               "--part-out", str(part)]
        proc = subprocess.run(cmd, check=False)
        if proc.returncode != 0 or not part.is_file():
            raise BenchmarkError(f"config {name!r} failed (exit {proc.returncode}); see its log")
        result: dict[str, Any] = json.loads(part.read_text())
        return result


def config_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration: tokens/s, speed-up over the reference, identity."""
    reference = next((r for r in runs if r["config"] == REFERENCE), None)
    ref_tokens = ({(t["workload"], t["session_id"], t["turn"]): t["tokens"]
                   for t in reference["turns"]} if reference else {})
    rows: list[dict[str, Any]] = []
    for run in runs:
        tokens = sum(len(t["tokens"]) for t in run["turns"])
        seconds = sum(t["seconds"] for t in run["turns"])
        forwards = sum(t.get("forwards", 0) for t in run["turns"])  # unknown when concurrent
        same = [ref_tokens.get((t["workload"], t["session_id"], t["turn"])) == t["tokens"]
                for t in run["turns"]]
        rows.append({
            "config": run["config"], "requests": len(run["turns"]), "tokens": tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
            "mean_accepted_len": round(tokens / forwards, 3) if forwards else 0.0,
            "start_s": run["start_s"], "load_avg": run.get("load_avg_1m_after"),
            "identical": bool(reference) and bool(same) and all(same),
            "concurrency": run.get("concurrency", 1),
            "step_ms_p50": run.get("step_ms_p50"),
            # Concurrent runs: tokens committed per engine step, all rows together (vLLM
            # reports no per-request acceptance there; this is comparable across configs).
            "tokens_per_engine_step": (round(tokens / run["engine_steps"], 2)
                                       if run.get("engine_steps") else None),
            "proposer_ms_per_step": (run.get("proposer_stats") or {}).get("propose_ms_per_step"),
            # vLLM's automatic prefix caching over the run (concurrent runs): share of
            # looked-up prompt tokens whose KV was reused.
            "prefix_hit_rate": (run.get("vllm_counters") or {}).get("prefix_hit_rate"),
            "draft_tokens": (run.get("vllm_counters") or {}).get("draft_tokens"),
            "accepted": (run.get("vllm_counters") or {}).get("accepted"),
        })
    base = next((r["tokens_per_s"] for r in rows if r["config"] == REFERENCE), 0.0)
    for row in rows:
        row["speedup"] = round(row["tokens_per_s"] / base, 2) if base else None
    return rows


def vllm_table(rows: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table."""
    headers = ["config", "req", "tokens", "tok/s", "speed-up", "acc.len", "tok/step",
               "prefix hit", "start s", "load", "identical"]
    cells = []
    for r in rows:
        per_step = r.get("tokens_per_engine_step")
        cells.append([
            str(r["config"]), str(r["requests"]), str(r["tokens"]), f"{r['tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-",
            f"{r['mean_accepted_len']:.2f}", str(per_step) if per_step is not None else "-",
            f"{r['prefix_hit_rate']:.1%}" if r.get("prefix_hit_rate") is not None else "-",
            f"{r['start_s']:.1f}",
            f"{r['load_avg']:.1f}" if r.get("load_avg") is not None else "-",
            str(r["identical"]),
        ])
    return markdown_table(headers, cells)


def build_parser() -> argparse.ArgumentParser:
    """Command-line arguments."""
    p = argparse.ArgumentParser(prog="python -m workflows.bench.vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--workloads", default="delegate52,smoke",
                   help=f"comma-separated workload names; {DRIVEN!r}: logged agent runs "
                        "(--traces) driven as live sessions, one request per session in "
                        "flight, prompts the logged ones")
    p.add_argument("--limit", type=int, default=1, help="sessions per workload")
    p.add_argument("--turns", type=int, default=3, help="turns per session")
    p.add_argument("--traces", nargs="*", default=[str(PACKAGED_TRACES)],
                   help=f"{DRIVEN!r}: SWE-agent .traj / JSONL files or folders (default: "
                        "the packaged SWE-agent trajectories)")
    p.add_argument("--max-prompt", type=int, default=2560,
                   help=f"{DRIVEN!r}: cut a session at its first turn whose prompt + answer "
                        "exceeds this (as `agentspec drive`)")
    p.add_argument("--trace-turns", type=int, default=30,
                   help=f"{DRIVEN!r}: most turns in all, file order (0: all)")
    p.add_argument("--max-tokens", type=int, default=160, help="cap on each turn's budget")
    p.add_argument("--max-draft", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=1,
                   help="agent sessions in flight at once (each session's turns stay in "
                        "order); > 1 reports engine step and proposer milliseconds")
    p.add_argument("--model", default=None, help="shipped model name (default: embedded) or folder")
    p.add_argument("--data", default=None, help="workload data folder")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--out", type=Path, default=None, help="write results JSON here")
    p.add_argument("--no-isolate", action="store_true",
                   help="run every engine in this process (one after the other)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part-out", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison; print the table; write JSON when ``--out`` is given.

    Raises:
        BenchmarkError: an unknown configuration, or a configuration that failed.
    """
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(raw)
    args.workloads = [w for w in args.workloads.split(",") if w]
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            raise BenchmarkError(f"unknown config {c!r}; choose from {', '.join(CONFIGS)}")
    if args.one is not None:
        if args.one not in CONFIGS or args.part_out is None:
            raise BenchmarkError(f"--one needs a known config and --part-out, got {args.one!r}")
        part = run_config(args.one, args)
        args.part_out.write_text(json.dumps(part))
        return part
    configs = sorted(configs, key=lambda c: c != REFERENCE)  # the reference first
    runs = [run_config(c, args) if args.no_isolate else _run_isolated(c, args, raw)
            for c in configs]
    rows = config_rows(runs)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": {
        k: v for k, v in vars(args).items() if k not in ("one", "part_out", "out")
    }, "results": rows, "runs": runs}
    print(vllm_table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
