"""The benchmark harness behind ``agentspec bench``.

Every method replays fresh copies of the same sessions on the same loaded model, one after
the other in one process, so speed-ups are ratios measured in the same run. ``greedy`` runs
first: its outputs are the reference for ``identical_to_greedy`` and the oracle's drafts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from agentspec.chat.formats import format_for
from agentspec.chat.grammar import GrammarCompiler
from agentspec.chat.templates import render_prompt
from agentspec.engine import EngineConfig
from agentspec.errors import BenchmarkError
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.types import RequestStats, SessionRef
from workflows.bench.methods import MethodContext, build_method
from workflows.bench.repetition import loop_share
from workflows.workloads.registry import WORKLOADS, load_workload

QUICK_MAX_TOKENS = 160  # per-request cap under --quick


@dataclass
class BenchConfig:
    """What to run.

    Attributes:
        workloads: Workload names.
        methods: Method names (``greedy`` is added first if missing: it is the reference).
        limit: Sessions per workload (``None``: the workload's default).
        turns: Turns per session.
        out: Path of the JSON results (``None``: do not write).
        model: Model name or folder.
        dtype: ``auto`` (the default; see :class:`~agentspec.targets.hf.TargetConfig`),
            ``float32`` (the reference, by name), ``bfloat16``, ``int8``, ``w8a8`` or
            ``w8a16`` (CPU only); the report's ``config.dtype`` is the precision it
            resolved to.
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        max_draft: Longest draft per verification.
        draft_model: Draft model of the ``model`` and ``hybrid`` methods (``None``: the
            shipped target's own choice, see :func:`agentspec.factory.draft_model_name`).
        data_dir: Data folder for the workloads that read files.
        progress: Show progress bars.
        quick: At most 2 sessions of 2 turns per workload and at most
            :data:`QUICK_MAX_TOKENS` tokens per request (about 5 minutes in all).
        relay_prompt: DELEGATE-52 prompt style, ``"compact"`` or ``"template"``.
        constrained: Decode tool calls under their grammar; ``greedy`` is then the
            engine's constrained greedy decoding (see ``MethodContext.grammars``).
    """

    workloads: list[str] = field(default_factory=lambda: ["smoke"])
    methods: list[str] = field(default_factory=lambda: ["greedy", "prompt_lookup", "oracle"])
    limit: int | None = None
    turns: int = 3
    out: Path | None = None
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_draft: int = 16
    draft_model: str | None = None
    data_dir: str | None = None
    progress: bool = True
    quick: bool = False
    relay_prompt: str = "compact"
    constrained: bool = False

    def __post_init__(self) -> None:
        if self.quick:
            self.limit = min(self.limit or 2, 2)
            self.turns = min(self.turns, 2)


def check_names(methods: list[str], workloads: list[str]) -> None:
    """Raise :class:`BenchmarkError` for unknown method or workload names."""
    from workflows.bench.methods import METHODS

    for m in methods:
        if m not in METHODS:
            raise BenchmarkError(f"unknown method {m!r}; choose from {', '.join(sorted(METHODS))}")
    for w in workloads:
        if w not in WORKLOADS:
            raise BenchmarkError(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")


def machine_info() -> dict[str, Any]:
    """Where the numbers were measured."""
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _first_divergence(reference: list[int] | None, tokens: list[int]) -> int | None:
    """Index of the first token that differs from greedy's (``None``: identical or no
    reference); a prefix of the other differs at the shorter length."""
    if reference is None or reference == tokens:
        return None
    pairs = zip(reference, tokens, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(reference), len(tokens)))


def _aggregate(
    workload: str, method: str, turns: list[dict[str, Any]], stats: RequestStats
) -> dict[str, Any]:
    tokens = stats.generated_tokens
    seconds = stats.total_s
    # Divergence from greedy (approximate methods): tokens from the first differing one on.
    diverged = sum(t["tokens"] - t["first_divergence"] for t in turns
                   if t.get("first_divergence") is not None)
    passed = [t["metrics"]["tests_passed"] for t in turns if "tests_passed" in t["metrics"]]
    return {
        "workload": workload,
        "method": method,
        "requests": len(turns),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 3) if seconds else 0.0,
        "speedup_vs_greedy": None,
        "mean_accepted_len": round(stats.mean_accepted_len, 3) if stats.forwards else None,
        "forwards_per_1k": round(stats.forwards_per_1k, 1) if stats.forwards else None,
        # The drafter's host time beside the target's step (verify_s per forward).
        "drafter_ms_per_step": (round(1000 * stats.draft_s / stats.forwards, 2)
                                if stats.forwards else None),
        "target_ms_per_step": (round(1000 * stats.verify_s / stats.forwards, 2)
                               if stats.forwards else None),
        "identical_to_greedy": all(t["identical_to_greedy"] for t in turns),
        "identical_turns": sum(bool(t["identical_to_greedy"]) for t in turns),
        "diverged_token_share": round(diverged / tokens, 4) if tokens else 0.0,
        "exceptions": stats.exceptions,
        "exceptions_per_1k": round(1000 * stats.exceptions / tokens, 2) if tokens else 0.0,
        "regret": round(stats.regret, 4),
        "tests_passed": f"{sum(passed)}/{len(passed)}" if passed else None,
        "accepted_histogram": {str(k): v for k, v in stats.accepted_histogram().items()},
        "drafter_wins": stats.drafter_wins(),
        "time_split_s": {
            "prefill": round(stats.prefill_s, 3),
            "draft": round(stats.draft_s, 3),
            "verify": round(stats.verify_s, 3),
            "overhead": round(stats.overhead_s, 3),
        },
    }


def run_bench(cfg: BenchConfig, target: HFTarget | None = None) -> dict[str, Any]:
    """Run every method on every workload; return (and optionally write) the results.

    Args:
        cfg: What to run.
        target: An already loaded model (tests reuse one); loaded from ``cfg`` otherwise.
    """
    methods = list(dict.fromkeys(["greedy", *cfg.methods]))
    check_names(methods, cfg.workloads)  # before the model loads: fail fast
    if target is None:
        target = HFTarget.load(TargetConfig(model=cfg.model, dtype=cfg.dtype,
                                            device=cfg.device))
    grammars = (GrammarCompiler.from_hf(target.tokenizer, target.vocab_size)
                if cfg.constrained else None)
    ctx = MethodContext(target, engine=EngineConfig(max_draft=cfg.max_draft), grammars=grammars,
                        draft_model=cfg.draft_model)
    built = [build_method(m, ctx) for m in methods]  # fail fast on unknown names
    fmt = format_for(target.tokenizer)  # the tool agent speaks the model's tool format
    workloads = [
        load_workload(w, cfg.data_dir, prompt_style=cfg.relay_prompt, tool_format=fmt)
        for w in cfg.workloads
    ]
    _warm_up(target, ctx)
    results: list[dict[str, Any]] = []
    turn_records: list[dict[str, Any]] = []
    step_records: list[dict[str, Any]] = []
    for wl in workloads:
        reference: dict[tuple[str, int], list[int]] = {}
        for method in built:
            sessions = list(wl.sessions(cfg.limit, cfg.turns))
            agg = RequestStats()
            records: list[dict[str, Any]] = []
            bar = tqdm(
                total=sum(getattr(s, "turns", cfg.turns) for s in sessions),
                desc=f"{wl.name}/{method.name}", disable=not cfg.progress, leave=False,
                file=sys.stderr,
            )
            for sess in sessions:
                ref = SessionRef(sess.session_id, tenant=f"bench-{method.name}")
                last: str | None = None
                turn = 0
                while (req := sess.next_request(last)) is not None:
                    turn += 1
                    if cfg.quick and req.max_tokens > QUICK_MAX_TOKENS:
                        req = dataclasses.replace(req, max_tokens=QUICK_MAX_TOKENS)
                    prompt = req.prompt_ids(target.tokenizer)
                    out = method.run(prompt, req, ref)
                    text = req.prefix + out.text
                    key = (sess.session_id, turn)
                    if method.name == "greedy":
                        reference[key] = out.tokens
                    rec = {
                        "workload": wl.name, "method": method.name,
                        "session_id": sess.session_id, "turn": turn,
                        "prompt_tokens": len(prompt), "tokens": len(out.tokens),
                        "seconds": round(out.stats.total_s, 4),
                        "tokens_per_s": round(out.stats.tokens_per_s, 3),
                        "mean_accepted_len": round(out.stats.mean_accepted_len, 3),
                        "identical_to_greedy": reference.get(key) == out.tokens,
                        "first_divergence": _first_divergence(reference.get(key), out.tokens),
                        # Compares outputs across runs (e.g. two bf16 runs) without the ids.
                        "output_sha": hashlib.sha256(str(out.tokens).encode()).hexdigest()[:16],
                        "exceptions": out.stats.exceptions,
                        "loop_share": round(loop_share(out.tokens), 4),
                        "metrics": sess.turn_metrics(req, text),
                    }
                    records.append(rec)
                    step_records.extend(
                        {"workload": wl.name, "method": method.name,
                         "session_id": sess.session_id, "turn": turn, "step": i,
                         "source": s.source, "draft_len": s.draft_len, "accepted": s.accepted,
                         "committed": s.committed}
                        for i, s in enumerate(out.stats.steps)
                    )
                    agg.merge(out.stats)
                    last = text
                    bar.update(1)
            bar.close()
            results.append(_aggregate(wl.name, method.name, records, agg))
            turn_records.extend(records)
    _add_ratios(results)
    _add_loop_free(results, turn_records)
    report = {
        "machine": machine_info(),
        "model": target.name,
        "config": {
            "workloads": cfg.workloads, "methods": methods, "limit": cfg.limit,
            "turns": cfg.turns, "dtype": target.dtype,
            "max_draft": cfg.max_draft,
            "draft_model": cfg.draft_model,
            "relay_prompt": cfg.relay_prompt, "constrained": cfg.constrained,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "results": results,
        "turns": turn_records,
    }
    if cfg.out is not None:
        write_results(report, step_records, cfg.out)
    return report


def _add_ratios(results: list[dict[str, Any]]) -> None:
    """Speed-up against greedy and fraction of the oracle's speed-up, per workload."""
    by_wl: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        by_wl.setdefault(r["workload"], {})[r["method"]] = r
    for rows in by_wl.values():
        base = rows.get("greedy", {}).get("tokens_per_s")
        oracle = rows.get("oracle", {}).get("tokens_per_s")
        for r in rows.values():
            if base:
                r["speedup_vs_greedy"] = round(r["tokens_per_s"] / base, 3)
            if base and oracle and oracle > base:
                r["oracle_fraction"] = round((r["tokens_per_s"] - base) / (oracle - base), 3)


def _add_loop_free(results: list[dict[str, Any]], turns: list[dict[str, Any]]) -> None:
    """Loop share per method, and the speed-up over greedy on turns whose greedy output
    has no degenerate repetition, so no headline rests on looping output."""
    clean: set[tuple[str, str, int]] = {
        (t["workload"], t["session_id"], t["turn"])
        for t in turns if t["method"] == "greedy" and t["loop_share"] == 0.0
    }
    sums: dict[tuple[str, str], list[float]] = {}
    for t in turns:
        acc = sums.setdefault((t["workload"], t["method"]), [0.0, 0.0, 0.0, 0.0])
        acc[0] += t["tokens"] * t["loop_share"]
        acc[1] += t["tokens"]
        if (t["workload"], t["session_id"], t["turn"]) in clean:
            acc[2] += t["tokens"]
            acc[3] += t["seconds"]
    for r in results:
        loop_tokens, tokens, free_tokens, free_s = sums.get(
            (r["workload"], r["method"]), [0.0, 0.0, 0.0, 0.0]
        )
        r["loop_share"] = round(loop_tokens / tokens, 4) if tokens else 0.0
        r["loop_free_tokens_per_s"] = round(free_tokens / free_s, 3) if free_s else None
    by_wl = {(r["workload"], r["method"]): r for r in results}
    for r in results:
        base = by_wl.get((r["workload"], "greedy"), {}).get("loop_free_tokens_per_s")
        mine = r["loop_free_tokens_per_s"]
        r["speedup_loop_free"] = round(mine / base, 3) if base and mine else None


def write_results(report: dict[str, Any], steps: Iterable[dict[str, Any]], out: Path) -> None:
    """Write the results JSON plus per-turn and per-step JSONL files beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    with out.with_suffix(".turns.jsonl").open("w") as f:
        for rec in report["turns"]:
            f.write(json.dumps(rec) + "\n")
    with out.with_suffix(".steps.jsonl").open("w") as f:
        for rec in steps:
            f.write(json.dumps(rec) + "\n")


def _warm_up(target: HFTarget, ctx: MethodContext) -> None:
    """One short generate, then one verification forward of every row count the product
    forms are timed at and one small tree, so the first measured method does not pay
    one-off costs: a row count's first forward costs 1.5-2x its later ones (kernel set-up),
    and which method first verifies 2, 5 or 33 rows would otherwise pay it for the rest;
    so would its int8 kernel trials (:func:`~agentspec.targets.kernels.int8_mm.settle`)."""
    from agentspec.targets.kernels import int8_mm
    from agentspec.targets.kernels.linear import ROW_POINTS

    ids = render_prompt(target.tokenizer, [{"role": "user", "content": "Hello"}])
    with torch.inference_mode():
        target.model.generate(
            torch.tensor([ids], device=target.device), max_new_tokens=4, do_sample=False,
            pad_token_id=ctx.eos_ids[0],
        )
        target.prefill(ids)  # no scope: nothing of the warm-up is kept for reuse
        for rows in (1, *ROW_POINTS):
            target.score(ids[:1] * rows)  # [rows, V]
            target.rollback(rows)
        # Each int8 row bucket's kernel trials, to their end.
        int8_mm.settle(target, (1, 2, 4, 8, 16, 32), token=ids[0])
        target.score_tree(ids[:4], [-1, 0, 0, 1])  # [4, V]
        target.keep_tree_path([1])
        target.prefill(ids[:1])
