"""Agent sessions driven by real agent logs: ``agentspec drive``.

Every logged agent run (the packaged SWE-agent trajectories by default) becomes a live
session. At each assistant turn the model generates its *own* answer (greedy, ``max_tokens``)
from the logged history: the rendered prompt holds the logged system prompt, user turns,
calls and tool results, exactly as an agent platform re-sends them. Sessions run in file
order; within a turn every method decodes the same prompt, interleaved (the order rotates
turn by turn), so machine load hits all methods alike.

Methods are agentspec's decoding methods (``plain``, ``prompt_lookup``, ``suffix`` (the
product's default drafter), ``arctic_suffix``), each with prefix KV reuse on and off. All
share one loaded model; each variant has a target wrapper of its own (its own live KV and,
with reuse, its own prefix store of ``prefix_cache_bytes``) and its own tenant, so no
variant reads another's KV or drafts. Every turn goes through the product's own path:
``Runtime.chat(messages, tools, session=...)`` on a :class:`~agentspec.runtime.Runtime` per
variant (the runtime renders the messages and tools with the chat template, builds engines
as it builds them for the server, keeps its drafters and draft gates across requests).
The model loads as a server's does, measuring the cost curves on a fresh
``AGENTSPEC_HOME`` (the report's ``load_s``), never inside a request.

Per turn it records prompt tokens, reused (cached) tokens, time to first token (prefill plus
the first decode step), decode tokens/s (after the first token) and the turn latency, and
checks that every variant produced the same tokens (all methods are lossless).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from statistics import mean
from typing import Any

from agentspec.cli.args import add_device_arg, add_dtype_arg
from agentspec.errors import BenchmarkError
from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec
from agentspec.targets.cache.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.types import SessionRef
from workflows.bench.driven_sources import (
    WORKLOADS,
    DrivenSession,
    DrivenTurn,
    check_workload,
    logged_sessions,
    tool_agent_sessions,
)
from workflows.bench.methods import method_spec
from workflows.replay.ceiling import CopyCeilingDrafter
from workflows.replay.logs import PACKAGED_TRACES, ReplaySession, load_sessions

METHODS = ("plain", "prompt_lookup", "suffix", "arctic_suffix")
# Also accepted (not run by default): the session cache with its draft trees forced off
# (the best index's chain) or on, to see what trees cost over long agent contexts, and
# without its draft gate (every draft verified as drafted); and HVD (the session cache or the
# EAGLE head per step) and the head alone, for models that ship a head; and the copy ceiling:
# at every step the longest continuation of plain's answer found verbatim in the tenant's
# text (workflows.replay.ceiling), ungated, with the default's engine settings: what a cache
# drafter that always picked the right copy would give through the same path. It needs
# ``plain``, whose answer it copies: the plain variants run first in every turn.
EXTRA_METHODS = ("suffix_chain", "suffix_tree", "suffix_ungated", "hybrid", "model", "ceiling")
ALL_METHODS = METHODS + EXTRA_METHODS
#: ``--reuse``: which prefix-reuse variants of every method run.
REUSE = {"both": (True, False), "on": (True,), "off": (False,)}
LABELS = {"plain": "plain", "prompt_lookup": "prompt lookup", "suffix": "default (suffix)",
          "arctic_suffix": "arctic", "suffix_chain": "default, chain drafts",
          "suffix_tree": "default, tree drafts", "suffix_ungated": "default, no draft gate",
          "hybrid": "hybrid (HVD)", "model": "model drafter", "ceiling": "copy ceiling"}


def _spec(method: str, max_draft: int, draft_model: str | None = None) -> AgentSpec:
    # ``suffix`` is the product's default drafter (AgentSpec()'s), with the bench's length;
    # the ceiling runs with its engine settings and its own drafter (``_variant``).
    return method_spec("suffix" if method == "ceiling" else method, max_draft=max_draft,
                       draft_model=draft_model)


def _variant(method: str, target: HFTarget, spec: AgentSpec) -> tuple[Runtime, Any]:
    """The runtime of one variant and, for ``ceiling``, its copy-ceiling drafter."""
    runtime = Runtime(target, store=None, default_spec=spec)
    if method != "ceiling":
        return runtime, None
    ceiling = CopyCeilingDrafter("tenant")
    runtime.set_drafter(spec, ceiling, gate=None)
    return runtime, ceiling


def select_turns(sessions: Sequence[ReplaySession], max_prompt: int, max_tokens: int,
                 turns: int) -> list[tuple[ReplaySession, int]]:
    """``(session, turn index)`` pairs in file order: a session is cut at its first turn
    whose prompt plus answer exceeds ``max_prompt`` (later turns only grow), and the
    selection stops after ``turns`` turns (``0``: no limit)."""
    out: list[tuple[ReplaySession, int]] = []
    for sess in sessions:
        for i, turn in enumerate(sess.turns):
            if len(turn.prompt) + max_tokens > max_prompt or (turns and len(out) >= turns):
                break
            out.append((sess, i))
    return out


def driven_turns(traces: Sequence[str | Path], tokenizer: Any, max_prompt: int,
                 max_tokens: int, turns: int) -> list[tuple[ReplaySession, int]]:
    """The logged runs in ``traces``, tokenised, and their turns chosen by
    :func:`select_turns` (the one selection of every driven bench).

    Raises:
        BenchmarkError: no logged turn fits ``max_prompt``.
        TraceFormatError: see :func:`workflows.replay.logs.load_sessions`.
    """
    selected = select_turns(load_sessions(list(traces), tokenizer), max_prompt, max_tokens,
                            turns)
    if not selected:
        raise BenchmarkError(f"no logged turn fits max_prompt={max_prompt}")
    return selected


def run(methods: Sequence[str] = METHODS, traces: Sequence[str | Path] = (PACKAGED_TRACES,),
        max_tokens: int = 64, max_prompt: int = 0, turns: int = 30, max_draft: int = 32,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, target: HFTarget | None = None,
        out: Path | None = None, progress: bool = True, model: str | None = None,
        workload: str = "traces", reuse: str = "both", device: str = "auto",
        dtype: str = "auto", draft_model: str | None = None) -> dict[str, Any]:
    """Drive the sessions with every method, reuse on and off; return the report.

    ``draft_model`` is the model drafter's model under ``model`` and ``hybrid`` (``None``:
    the one the shipped target names, e.g. the 0.5B for the 1.5B).

    ``workload`` ``"traces"`` drives the logged runs in ``traces``; ``"tool_agent"`` the
    live tool agent (:mod:`workflows.bench.driven_sources`). ``max_prompt`` ``0`` (the
    default) cuts sessions where they no longer fit the model's context window, as an agent
    platform would have to.

    Raises:
        BenchmarkError: unknown method, no turn fits ``max_prompt``, a zero budget, or
            variants whose outputs differ.
    """
    if prefix_cache_bytes <= 0:
        raise BenchmarkError("prefix_cache_bytes must be > 0 (the reuse-on variants need it)")
    if max_prompt < 0:
        raise BenchmarkError(f"max_prompt must be >= 0 (0: the model's window), got {max_prompt}")
    for m in methods:
        if m not in ALL_METHODS:
            raise BenchmarkError(f"unknown method {m!r}; choose from {', '.join(ALL_METHODS)}")
    if "ceiling" in methods and "plain" not in methods:
        raise BenchmarkError("method 'ceiling' copies plain's answers: add 'plain' to methods")
    check_workload(workload)
    if reuse not in REUSE:
        raise BenchmarkError(f"reuse must be one of {', '.join(REUSE)}, got {reuse!r}")
    t_load = time.perf_counter()  # a fresh AGENTSPEC_HOME measures the cost curves here
    base = target or HFTarget.load(TargetConfig(model=model, prefix_cache_bytes=0,
                                                device=device, dtype=dtype))
    load_s = time.perf_counter() - t_load
    tok = base.tokenizer
    max_prompt = max_prompt or base.max_positions
    sessions: Sequence[DrivenSession]
    if workload == "traces":
        selected = driven_turns(traces, tok, max_prompt, max_tokens, turns)
        sessions, planned = logged_sessions(selected, max_tokens), len(selected)
    else:
        # A live session ends when it ends: ``turns`` is the most (0: as many as there are).
        sessions, planned = tool_agent_sessions(tok, max_prompt, max_tokens), turns
    # The product path: one Runtime per variant (its own target wrapper over the shared
    # weights, its own prefix store, drafters and draft gates, no session store), each turn
    # one Runtime.chat call with the turn's messages and tools, as a framework sends it.
    variants: dict[str, Runtime] = {}
    ceilings: dict[str, CopyCeilingDrafter] = {}
    stores: dict[str, PrefixCache] = {}
    for m in methods:
        spec = _spec(m, max_draft, draft_model)
        for on in REUSE[reuse]:
            name = f"{m}+reuse" if on else m
            store = PrefixCache(prefix_cache_bytes) if on else None
            tgt = HFTarget(base.model, tok, base.name, base.dtype, base.device, store,
                           base.kv.stable, prefill_rows=base.meter.prefill_rows)
            if store is not None:
                stores[name] = store
            variants[name], ceiling = _variant(m, tgt, spec)
            if ceiling is not None:
                ceilings[name] = ceiling
    names = list(variants)
    # With a ceiling, the plain variants answer first (the ceiling copies their answer).
    leads = [n for n in names if n.split("+")[0] == "plain"] if ceilings else []
    rotated = [n for n in names if n not in leads]
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    sess_out: dict[int, list[int]] = {}
    report: dict[str, Any] | None = None
    for sess, i, turn in _turns(sessions, turns, sess_out):
        k = len(rows)
        shift = k % len(rotated)
        outs: dict[str, list[int]] = {}
        row: dict[str, Any] = {"session": sess.name, "turn": i, "methods": {}}
        # Rotate: nobody always runs first (but the plain variants a ceiling copies).
        for name in leads + rotated[shift:] + rotated[:shift]:
            if name in ceilings:
                prompt, _ = variants[name].prompt_ids(list(turn.messages), turn.tools, None,
                                                      turn.prefix)
                ceilings[name].add(prompt, outs[leads[0]])
            ref = SessionRef(sess.ref.session_id, tenant=f"drive-{name.replace('+', '-')}")
            t0 = time.perf_counter()
            res = variants[name].chat(list(turn.messages), turn.tools, session=ref,
                                      max_tokens=max_tokens, assistant_prefix=turn.prefix)
            wall = time.perf_counter() - t0
            st = res.stats
            row["prompt_tokens"] = res.prompt_tokens
            first = st.steps[0].draft_s + st.steps[0].verify_s if st.steps else 0.0
            decode_s = st.total_s - st.prefill_s
            outs[name] = res.tokens
            row["methods"][name] = {
                "cached_tokens": st.cached_prompt_tokens,
                "prefilled_tokens": res.prompt_tokens - st.cached_prompt_tokens,
                "ttft_s": round(st.prefill_s + first, 4),
                "prefill_s": round(st.prefill_s, 4),
                "decode_tok_s": round(st.generated_tokens / decode_s, 3) if decode_s else 0.0,
                # The whole call a framework waits for: rendering, prefill, decoding, parsing.
                "latency_s": round(wall, 4),
                "generated": st.generated_tokens,
                "forwards": st.forwards,
                # Draft tokens verified and accepted: over a long context every verified
                # draft token costs attention over the whole cache, hit or miss.
                "draft_tokens": sum(x.draft_len for x in st.steps),
                # Offered by the drafter, before the draft gate cut or skipped them.
                "offered_tokens": sum(x.offered for x in st.steps),
                "accepted_tokens": sum(x.accepted for x in st.steps),
            }
        ref_tokens = outs[names[0]]
        row["identical"] = all(o == ref_tokens for o in outs.values())
        rows.append(row)
        sess_out[id(sess)] = ref_tokens  # the session's history goes on with this answer
        if progress:
            lat = " ".join(f"{n}={row['methods'][n]['latency_s']:.1f}s" for n in names)
            print(f"[{k + 1}/{planned} {time.perf_counter() - t_start:.0f}s] "
                  f"{sess.name[:40]} turn {i} ({row['prompt_tokens']} tok): {lat}",
                  file=sys.stderr, flush=True)
        report = summarize(rows, names, stores, dict(
            workload=workload, max_tokens=max_tokens, max_prompt=max_prompt,
            turns=planned, max_draft=max_draft, prefix_cache_bytes=prefix_cache_bytes,
            draft_model=draft_model,
            model=base.name, dtype=base.dtype, load_s=round(load_s, 2),
            path="Runtime.chat",
            traces=[str(t) for t in traces] if workload == "traces" else []))
        if out is not None:  # after every turn: a long run leaves partial results
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1))
    if report is None:
        raise BenchmarkError(f"no driven turn fits max_prompt={max_prompt}")
    if not all(r["identical"] for r in rows):
        bad = [f"{r['session']}#{r['turn']}" for r in rows if not r["identical"]]
        raise BenchmarkError(f"variants disagree on turns {bad}")
    return report


def _turns(sessions: Sequence[DrivenSession], most: int, last: dict[int, list[int]],
           ) -> Iterator[tuple[DrivenSession, int, DrivenTurn]]:
    """``(session, turn index, turn)`` in order, each session to its end, ``most`` turns in
    all (0: no limit); ``last[id(session)]`` holds the answer of its latest turn."""
    done = 0
    for sess in sessions:
        i = 0
        while not most or done < most:
            turn = sess.next_turn(last.get(id(sess)))
            if turn is None:
                break
            yield sess, i, turn
            i, done = i + 1, done + 1


def summarize(rows: list[dict[str, Any]], names: list[str], stores: dict[str, PrefixCache],
              settings: dict[str, Any]) -> dict[str, Any]:
    """Per-variant means, the prefilled share after each session's first turn, ratios."""
    later = [r for r in rows if r["turn"] > 0]
    summary: dict[str, Any] = {}
    for n in names:
        per = [r["methods"][n] for r in rows]
        share = [r["methods"][n]["prefilled_tokens"] / r["prompt_tokens"] for r in later]
        summary[n] = {
            "turns": len(per),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "cached_tokens": sum(p["cached_tokens"] for p in per),
            "forwards": sum(p["forwards"] for p in per),
            "mean_ttft_s": round(mean(p["ttft_s"] for p in per), 4),
            "mean_prefill_s": round(mean(p["prefill_s"] for p in per), 4),
            "mean_decode_tok_s": round(mean(p["decode_tok_s"] for p in per), 3),
            "mean_latency_s": round(mean(p["latency_s"] for p in per), 4),
            # A session's first turn has nothing of its own to reuse (only what other
            # sessions of the tenant share); later turns show the steady state of a session.
            "later_turns_mean_latency_s": round(
                mean(r["methods"][n]["latency_s"] for r in later), 4) if later else None,
            "later_turns_prefilled_share": round(
                sum(r["methods"][n]["prefilled_tokens"] for r in later)
                / max(1, sum(r["prompt_tokens"] for r in later)), 4),
            "later_turns_max_prefilled_share": round(max(share), 4) if share else None,
            "later_turns_over_15pct": sum(s > 0.15 for s in share),
            "store": stores[n].to_dict() if n in stores else None,
        }
    # Ratios against plain decoding without reuse, or with it when only that side ran.
    baseline = "plain" if "plain" in summary else "plain+reuse"
    base = summary.get(baseline, {}).get("mean_latency_s")
    ratios = {f"{n}_latency_vs_plain": round(base / s["mean_latency_s"], 3)
              for n, s in summary.items() if base and s["mean_latency_s"]}
    base_later = summary.get(baseline, {}).get("later_turns_mean_latency_s")
    later_ratios = {f"{n}_latency_vs_plain": round(base_later / s["later_turns_mean_latency_s"], 3)
                    for n, s in summary.items()
                    if base_later and s["later_turns_mean_latency_s"]}
    return {"settings": settings, "summary": summary, "baseline": baseline,
            "latency_speedup_vs_plain": ratios,
            "later_turns_latency_speedup_vs_plain": later_ratios,
            "all_identical": all(r["identical"] for r in rows), "rows": rows}


def driven_table(report: dict[str, Any]) -> str:
    """Markdown: one row per variant."""
    vs = "vs plain" + (" + reuse" if report.get("baseline") == "plain+reuse" else "")
    lines = ["| method | reuse | mean TTFT s | mean prefill s | decode tok/s | mean turn s | "
             f"{vs} | later turns: mean s | {vs} | forwards | cached / prompt tokens | "
             "prefilled share, later turns (max) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, s in report["summary"].items():
        m, reuse = (n[: -len("+reuse")], "on") if n.endswith("+reuse") else (n, "off")
        speed = report["latency_speedup_vs_plain"].get(f"{n}_latency_vs_plain", 0.0)
        later_speed = report.get("later_turns_latency_speedup_vs_plain", {}).get(
            f"{n}_latency_vs_plain", 0.0)
        later_s = s.get("later_turns_mean_latency_s") or 0.0
        lines.append(
            f"| {LABELS.get(m, m)} | {reuse} | {s['mean_ttft_s']:.2f} | "
            f"{s['mean_prefill_s']:.2f} | {s['mean_decode_tok_s']:.1f} | "
            f"{s['mean_latency_s']:.2f} | {speed:.2f}x | {later_s:.2f} | {later_speed:.2f}x | "
            f"{s.get('forwards', 0):,} | {s['cached_tokens']:,} / {s['prompt_tokens']:,} | "
            f"{s['later_turns_prefilled_share']:.1%} ({s['later_turns_max_prefilled_share']:.1%}) |"
        )
    ident = "identical" if report["all_identical"] else "DIFFERENT"
    done, planned = len(report["rows"]), report["settings"]["turns"]
    of = f"{done} of {planned}" if planned else f"{done}"
    lines.append(f"\n{of} turns; outputs of all variants: {ident}")
    return "\n".join(lines)


def add_drive_parser(sub: Any) -> None:
    """The ``agentspec drive`` sub-command."""
    p = sub.add_parser(
        "drive", help="drive live agent sessions from logged agent runs (prefix reuse bench)",
        description="Agent sessions driven live: with --workload traces every logged run "
                    "becomes a session and the model answers each assistant turn from the "
                    "logged history; with --workload tool_agent the live tool agent's "
                    "sessions run, the model's own answers in their history. Methods with "
                    "prefix KV reuse on and off, interleaved turn by turn, each turn one "
                    "Runtime.chat call (messages and tools, as a framework sends them) on a "
                    "runtime per variant; TTFT, decode tokens/s, turn latency. The model "
                    "loads as a server's does (cost curves measured on a fresh "
                    "AGENTSPEC_HOME: the report's load_s).")
    p.add_argument("traces", nargs="*", default=[str(PACKAGED_TRACES)],
                   help="SWE-agent .traj / JSONL files or folders (default: the packaged "
                        "SWE-agent trajectories)")
    p.add_argument("--workload", choices=WORKLOADS, default="traces",
                   help="traces: the logged runs (their logged answers stay in the "
                        "history); tool_agent: the live tool agent, whose history holds the "
                        "model's own answers (default: traces)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, each run with reuse on and off (default: "
                        f"{','.join(METHODS)}; also {', '.join(EXTRA_METHODS)}: the "
                        f"default with draft trees forced off / on)")
    p.add_argument("--model", default=None,
                   help="shipped model name (default: the embedded model; see `agentspec "
                        "models`) or a local Hugging Face folder")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=0,
                   help="cut a session at its first turn whose prompt + answer exceeds this "
                        "many tokens (default 0: the model's context window)")
    p.add_argument("--turns", type=int, default=30, help="most turns in all (0: all)")
    p.add_argument("--max-draft", type=int, default=32)
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="draft model of the model and hybrid methods: a shipped model's name "
                        "or a local Hugging Face folder sharing the model's tokenizer "
                        "(default: the one the shipped model names, e.g. the 0.5B for the "
                        "1.5B, else its EAGLE head)")
    p.add_argument("--prefix-cache-mb", type=int, default=DEFAULT_PREFIX_CACHE_BYTES >> 20,
                   help="prefix store budget per reuse variant (MiB)")
    p.add_argument("--reuse", choices=tuple(REUSE), default="both",
                   help="prefix-reuse variants of every method: both (default), on or off "
                        "(one side only halves a long run)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    add_dtype_arg(p)
    add_device_arg(p)


def run_drive_cli(args: argparse.Namespace) -> int:
    """Run ``agentspec drive`` and print its table."""
    report = run([m.strip() for m in args.methods.split(",") if m.strip()], args.traces,
                 args.max_tokens, args.max_prompt, args.turns, args.max_draft,
                 args.prefix_cache_mb << 20, out=args.out, model=args.model,
                 workload=args.workload, reuse=args.reuse, device=args.device,
                 dtype=args.dtype, draft_model=args.draft_model)
    print(driven_table(report))
    return 0
