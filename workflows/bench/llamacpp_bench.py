"""agentspec and llama.cpp side by side: ``agentspec peer llamacpp``.

Two measurements on one model, the peer (:mod:`workflows.bench.llamacpp`) on the model's
GGUF, agentspec on the model it converts from the same GGUF, both fed the same token ids
(agentspec's tokenizer and chat template):

* **Context points**: a prompt of ``n`` tokens (for each ``--contexts``, the start of the
  longest logged SWE-agent prompt), prefilled cold, then ``--decode-tokens`` greedy tokens
  decoded whatever they are (no end token stops them). Prefill tokens/s and plain decode
  tokens/s (one-token forwards per second after the first token) for llama.cpp and for
  agentspec's plain loop in each ``--dtypes`` precision, after a warm-up of each (a short
  decode; agentspec's int8 kernel trials run to their end). Every repeat runs every context
  and system back to back, the order rotating; the table shows medians.
* **Agent turns**: the turns ``agentspec drive`` runs (the packaged SWE-agent logs, sessions
  cut at ``--max-prompt``, ``--turns`` turns, ``--max-tokens`` answers, prefix reuse on).
  llama.cpp gets each turn's prompt as ``Runtime.chat`` renders it and keeps its longest
  common prefix with the previous prompt and answer (one slot, as llama-server); agentspec
  runs ``agentspec drive --reuse on`` with ``--methods`` (plain and the default) in each
  precision. A turn's seconds: llama.cpp's prefill plus decode; agentspec's whole
  ``Runtime.chat`` call (rendering and parsing included).

``agentspec drive`` stops an answer at the model's end token; so does the peer here, so the
answers' lengths can differ where the GGUF's quantized weights and agentspec's precision
choose different tokens: the report gives each side's answer tokens per turn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, median
from typing import Any

from agentspec.cli.args import csv_list, non_negative_int, positive_int
from agentspec.errors import BenchmarkError
from agentspec.models import assembled_gguf, load_tokenizer, resolve_model, shipped_model
from workflows.bench.llamacpp import LlamaCppRunner, TurnRecord, common_prefix
from workflows.replay.logs import PACKAGED_TRACES

PEERS = ("llamacpp",)
LLAMA = "llama.cpp"
#: agentspec's methods by the names ``agentspec drive`` reports (reuse on).
LABELS = {"plain": "plain", "suffix": "default"}


@dataclass
class PeerConfig:
    """What ``agentspec peer llamacpp`` runs.

    Attributes:
        model: A shipped model's name (``None``: the embedded model) or a local folder.
        gguf: The peer's GGUF (default: the shipped model's own, assembled from its chunks).
        contexts: Prompt lengths of the context points.
        decode_tokens: Tokens decoded at every context point.
        repeats: Rounds of context points (medians over them).
        dtypes: agentspec's precisions (``()``: llama.cpp alone).
        methods: agentspec's methods on the agent turns (``()``: none).
        turns: Agent turns in all (``0``: no agent turns).
        max_prompt: Sessions are cut before a turn whose prompt plus answer exceeds this.
        max_tokens: Answer budget of an agent turn.
        turn_repeats: Rounds of the agent turns (per-turn medians over them).
        threads: llama.cpp's threads (agentspec uses torch's, set by ``threads`` too).
        n_batch: llama.cpp's prompt tokens per forward.
        max_draft: The default's longest draft.
        traces: The logged runs.
        out: Where the JSON goes (written after each part).
        progress: Progress lines on stderr.
    """

    model: str | None = None
    gguf: Path | None = None
    contexts: tuple[int, ...] = (500, 4000)
    decode_tokens: int = 64
    repeats: int = 3
    dtypes: tuple[str, ...] = ("auto", "float32")
    methods: tuple[str, ...] = ("plain", "suffix")
    turns: int = 12
    max_prompt: int = 4096
    max_tokens: int = 64
    turn_repeats: int = 1
    threads: int = 2
    n_batch: int = 512
    max_draft: int = 32
    traces: tuple[str | Path, ...] = (PACKAGED_TRACES,)
    out: Path | None = None
    progress: bool = True


def context_prompts(prompts: Sequence[Sequence[int]], contexts: Sequence[int]
                    ) -> dict[int, list[int]]:
    """For each context length ``n``, the first ``n`` tokens of the longest prompt.

    Raises:
        BenchmarkError: no prompt, or the longest is shorter than a context length.
    """
    if not prompts:
        raise BenchmarkError("no logged prompt to cut the context points from")
    longest = max(prompts, key=len)
    too_long = [n for n in contexts if n > len(longest)]
    if too_long:
        raise BenchmarkError(f"the longest logged prompt has {len(longest)} tokens, fewer than "
                             f"the context point(s) {too_long}")
    return {n: [int(t) for t in longest[:n]] for n in contexts}


def rotated(items: Sequence[str], k: int) -> list[str]:
    """``items`` rotated left by ``k`` (each round starts with another system)."""
    if not items:
        return []
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def context_row(system: str, n: int, rep: int, prefill_s: float, decode_s: float,
                generated: int) -> dict[str, Any]:
    """One context point's record: prefill and decode rates (one-token forwards after the
    first token per second)."""
    return {"system": system, "context": n, "repeat": rep, "prefill_s": round(prefill_s, 4),
            "prefill_tok_s": round(n / prefill_s, 2) if prefill_s else 0.0,
            "decode_s": round(decode_s, 4), "generated": generated,
            "decode_tok_s": round((generated - 1) / decode_s, 2) if decode_s else 0.0}


def summarize_contexts(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """``{system: {context: {prefill_tok_s, decode_tok_s, runs}}}``: medians over repeats."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in rows:
        out.setdefault(r["system"], {}).setdefault(str(r["context"]), {})
    for system, per in out.items():
        for n in per:
            mine = [r for r in rows if r["system"] == system and str(r["context"]) == n]
            per[n] = {"prefill_tok_s": round(median(r["prefill_tok_s"] for r in mine), 2),
                      "decode_tok_s": round(median(r["decode_tok_s"] for r in mine), 2),
                      "runs": len(mine)}
    return out


def peer_turn_row(session: str, turn: int, rec: TurnRecord) -> dict[str, Any]:
    """One agent turn of the peer, in ``agentspec drive``'s field names."""
    return {"session": session, "turn": turn, "prompt_tokens": rec.prompt_tokens,
            "cached_tokens": rec.reused, "prefilled_tokens": rec.new_prompt,
            "prefill_s": round(rec.prefill_s, 4), "latency_s": round(rec.latency_s, 4),
            "generated": rec.generated, "decode_tok_s": round(rec.decode_tok_s, 2),
            "tokens": rec.tokens}


def summarize_turns(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One system's agent turns (``rows``: per turn, medians over repeats done by the
    caller): means over all turns and over later turns (a session's second turn on)."""
    later = [r for r in rows if r["turn"] > 0]

    def avg(key: str, among: Sequence[dict[str, Any]]) -> float | None:
        return round(mean(r[key] for r in among), 4) if among else None

    return {"turns": len(rows), "later_turns": len(later),
            "mean_latency_s": avg("latency_s", rows),
            "later_mean_latency_s": avg("latency_s", later),
            "later_median_latency_s": round(median(r["latency_s"] for r in later), 4)
            if later else None,
            "later_mean_prefill_s": avg("prefill_s", later),
            "later_mean_prefilled_tokens": avg("prefilled_tokens", later),
            "later_mean_generated": avg("generated", later),
            "mean_decode_tok_s": avg("decode_tok_s", rows)}


def median_turns(passes: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per turn, the median seconds and rates over the repeats' passes (same turns in the
    same order; token counts from the first pass)."""
    out = []
    for group in zip(*passes, strict=True):
        row = {k: v for k, v in group[0].items() if k != "tokens"}
        for key in ("prefill_s", "latency_s", "decode_tok_s"):
            row[key] = round(median(g[key] for g in group), 4)
        out.append(row)
    return out


def agreement(points: dict[tuple[str, int], list[int]]) -> dict[str, dict[str, int]]:
    """Per agentspec system and context, how many leading decoded tokens equal llama.cpp's
    (``points``: each ``(system, context)``'s tokens from the first round)."""
    out: dict[str, dict[str, int]] = {}
    for (system, n), tokens in points.items():
        ref = points.get((LLAMA, n))
        if system != LLAMA and ref is not None:
            out.setdefault(system, {})[str(n)] = common_prefix(tokens, ref)
    return out


def comparison_table(report: dict[str, Any]) -> str:
    """Markdown: one row per system, context points and agent turns side by side."""
    contexts = [str(n) for n in report["settings"]["contexts"]]
    ctx = report.get("contexts_summary", {})
    turns = report.get("turns_summary", {})
    base = (turns.get(LLAMA) or {}).get("later_mean_latency_s")
    head = (["system"] + [f"decode tok/s @{n}" for n in contexts]
            + [f"prefill tok/s @{n}" for n in contexts]
            + ["later turn s (mean)", "vs llama.cpp", "later turn: prefilled / answer tokens"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    systems = list(dict.fromkeys([*ctx, *turns]))
    for system in systems:
        per = ctx.get(system, {})
        t = turns.get(system) or {}
        cells = [system]
        cells += [f"{per[n]['decode_tok_s']:.1f}" if n in per else "–" for n in contexts]
        cells += [f"{per[n]['prefill_tok_s']:.0f}" if n in per else "–" for n in contexts]
        later = t.get("later_mean_latency_s")
        cells.append(f"{later:.2f}" if later else "–")
        cells.append(f"{base / later:.2f}x" if later and base else "–")
        cells.append(f"{t['later_mean_prefilled_tokens']:.0f} / {t['later_mean_generated']:.0f}"
                     if t.get("later_mean_prefilled_tokens") is not None else "–")
        lines.append("| " + " | ".join(cells) + " |")
    threads = report["settings"]["threads"]
    notes = [f"\nllama.cpp: {report['llamacpp']['description']}, {threads} "
             f"thread{'s' if threads != 1 else ''} ({report['llamacpp']['system_info']})"]
    if report.get("agreement"):
        notes.append("leading decoded tokens equal to llama.cpp's at each context point: "
                     + "; ".join(f"{s} " + ", ".join(f"@{n} {k}" for n, k in per.items())
                                 for s, per in report["agreement"].items()))
    notes.append("vs llama.cpp: llama.cpp's later-turn seconds over the row's (>1: faster)")
    return "\n".join(lines + notes)


def _log(cfg: PeerConfig, msg: str, t0: float) -> None:
    if cfg.progress:
        print(f"[{time.perf_counter() - t0:6.0f}s] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def peer_gguf(model: str | None, gguf: Path | None) -> Iterator[Path]:
    """The GGUF the peer loads: ``gguf``, else the shipped model's own (assembled from its
    chunks for the block where it ships in parts).

    Raises:
        BenchmarkError: a local model folder without ``gguf``.
    """
    if gguf is not None:
        yield Path(gguf)
        return
    shipped = shipped_model(model or "smollm2-135m-instruct")
    if shipped is None:
        raise BenchmarkError(f"model {model!r} is not shipped: give its GGUF with --gguf")
    with assembled_gguf(shipped) as path:
        yield path


def _machine() -> dict[str, Any]:
    from workflows.bench.harness import machine_info

    info = machine_info()
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
        names = [ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.startswith("model name")]
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        info["cpu"] = names[0] if names else None
        info["avx512f"] = " avx512f" in flags
    info["load_avg"] = list(os.getloadavg())
    return info


def _decoder(tokenizer: Any) -> Any:
    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    return decode


def _warm_up(runner: LlamaCppRunner, targets: dict[str, Any], engines: dict[str, Any],
             prompt: list[int]) -> dict[str, float]:
    """A short greedy decode on every system before anything is timed, and each agentspec
    target's int8 kernel trials run to their end (:func:`~agentspec.targets.kernels.int8_mm.
    settle`, as the bench's warm-up does): the context points report steady-state rates,
    and whichever system or context came first would otherwise pay one-off costs (a
    bucket's trial forwards on the slower kernel, first-touch of buffers) in its row.
    Returns each system's warm-up seconds (for the report)."""
    from agentspec.targets.kernels import int8_mm

    head = prompt[:64]
    t0 = time.perf_counter()
    runner.clear()
    runner.run_turn(head, 8, reuse=False)
    runner.clear()
    spent = {LLAMA: round(time.perf_counter() - t0, 2)}
    for name, engine in engines.items():
        t0 = time.perf_counter()
        engine.generate(head, 8)
        int8_mm.settle(targets[name], (1, 2, 4, 8, 16, 32), token=head[0])
        spent[name] = round(time.perf_counter() - t0, 2)
    return spent


def _agentspec_point(engine: Any, prompt: list[int], tokens: int
                     ) -> tuple[float, float, list[int]]:
    res = engine.generate(prompt, tokens)
    st = res.stats
    return st.prefill_s, st.total_s - st.prefill_s, list(res.tokens)


def run_peer(cfg: PeerConfig) -> dict[str, Any]:
    """Run llama.cpp and agentspec side by side (see the module); return the report.

    Raises:
        PeerUnavailableError: llama.cpp is not installed or does not load.
        BenchmarkError: bad settings, no logged turn fits, or agentspec's variants disagree.
    """
    import torch

    from agentspec.chat.api import chat_prompt_ids
    from agentspec.factory import build_drafter, build_engine
    from agentspec.targets.hf import HFTarget, TargetConfig
    from agentspec.tokens import eos_ids
    from workflows.bench.driven import run as drive
    from workflows.bench.driven import select_turns
    from workflows.bench.driven_sources import logged_sessions
    from workflows.bench.methods import method_spec
    from workflows.replay.logs import load_sessions

    if cfg.repeats < 1 or cfg.turn_repeats < 1 or cfg.decode_tokens < 2:
        raise BenchmarkError("repeats and turn_repeats must be >= 1, decode_tokens >= 2")
    for m in cfg.methods:
        if m not in LABELS:
            raise BenchmarkError(f"method {m!r}: choose from {', '.join(LABELS)}")
    t0 = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    tok = load_tokenizer(resolve_model(cfg.model))
    eos = eos_ids(tok)
    logged = load_sessions(list(cfg.traces), tok)
    points = context_prompts([t.prompt for s in logged for t in s.turns], cfg.contexts)
    selected = select_turns(logged, cfg.max_prompt, cfg.max_tokens, cfg.turns) if cfg.turns else []
    if cfg.turns and not selected:
        raise BenchmarkError(f"no logged turn fits max_prompt={cfg.max_prompt}")
    # Each turn's prompt as Runtime.chat renders it (what agentspec's variants are fed).
    turn_prompts: list[tuple[str, int, list[int]]] = []
    for sess in logged_sessions(selected, cfg.max_tokens):
        i = 0
        while (turn := sess.next_turn(None)) is not None:
            ids, _ = chat_prompt_ids(tok, turn.messages, turn.tools, None, turn.prefix)
            turn_prompts.append((sess.name, i, ids))
            i += 1
    longest = max([*cfg.contexts, *(len(p) for _, _, p in turn_prompts)])
    n_ctx = -(-(longest + max(cfg.decode_tokens, cfg.max_tokens)) // 256) * 256
    report: dict[str, Any] = {
        "machine": _machine(),
        "settings": {"model": cfg.model or "smollm2-135m-instruct", "contexts": list(cfg.contexts),
                     "decode_tokens": cfg.decode_tokens, "repeats": cfg.repeats,
                     "dtypes": list(cfg.dtypes), "methods": list(cfg.methods),
                     "turns": len(turn_prompts), "max_prompt": cfg.max_prompt,
                     "max_tokens": cfg.max_tokens, "turn_repeats": cfg.turn_repeats,
                     "threads": cfg.threads, "n_batch": cfg.n_batch, "n_ctx": n_ctx,
                     "max_draft": cfg.max_draft, "traces": [str(t) for t in cfg.traces]},
    }

    def save() -> None:
        if cfg.out is not None:
            cfg.out.parent.mkdir(parents=True, exist_ok=True)
            cfg.out.write_text(json.dumps(report, indent=1))

    with peer_gguf(cfg.model, cfg.gguf) as gguf:
        t_load = time.perf_counter()
        runner = LlamaCppRunner(gguf, n_ctx=n_ctx, threads=cfg.threads, n_batch=cfg.n_batch)
        report["llamacpp"] = {"gguf": str(cfg.gguf or gguf.name), "library": str(
            runner.module.__file__), "description": runner.description,
            "system_info": runner.system_info, "load_s": round(time.perf_counter() - t_load, 2)}
    _log(cfg, f"llama.cpp loaded: {runner.description}", t0)
    targets: dict[str, Any] = {}
    engines: dict[str, Any] = {}
    for d in cfg.dtypes:
        t_load = time.perf_counter()
        target = HFTarget.load(TargetConfig(model=cfg.model, prefix_cache_bytes=0,
                                            device="cpu", dtype=d))
        name = f"agentspec plain, {target.dtype}" + (" (auto)" if d == "auto" else "")
        targets[name] = target
        spec = method_spec("plain")
        # No end token: a context point decodes its tokens whatever they are.
        engines[name] = build_engine(spec, target, build_drafter(spec, target),
                                     decode=_decoder(target.tokenizer), eos_token_ids=[])
        report.setdefault("agentspec_load_s", {})[name] = round(time.perf_counter() - t_load, 2)
        _log(cfg, f"agentspec loaded: {name}", t0)
    systems = [LLAMA, *engines]
    report["warm_up_s"] = _warm_up(runner, targets, engines, points[min(cfg.contexts)])
    _log(cfg, "warmed up: a short decode on each system, agentspec's int8 kernel trials run", t0)

    # Context points: every round runs each context on each system, the order rotating.
    rows: list[dict[str, Any]] = []
    decoded: dict[tuple[str, int], list[int]] = {}
    for rep in range(cfg.repeats):
        for k, n in enumerate(cfg.contexts):
            for system in rotated(systems, rep + k):
                prompt = points[n]
                if system == LLAMA:
                    runner.clear()
                    rec = runner.run_turn(prompt, cfg.decode_tokens, reuse=False)
                    prefill_s, decode_s, tokens = rec.prefill_s, rec.decode_s, rec.tokens
                else:
                    prefill_s, decode_s, tokens = _agentspec_point(engines[system], prompt,
                                                                   cfg.decode_tokens)
                row = context_row(system, n, rep, prefill_s, decode_s, len(tokens))
                decoded.setdefault((system, n), tokens)
                rows.append(row)
                _log(cfg, f"context {n} round {rep + 1}: {system}: prefill "
                          f"{row['prefill_tok_s']:.0f} tok/s, decode {row['decode_tok_s']:.1f} "
                          "tok/s", t0)
        report["contexts"] = rows
        report["contexts_summary"] = summarize_contexts(rows)
        report["agreement"] = agreement(decoded)
        save()

    # Agent turns: llama.cpp with prefix reuse and `agentspec drive --reuse on` per precision.
    if turn_prompts:
        passes: dict[str, list[list[dict[str, Any]]]] = {}
        turn_systems = [LLAMA, *(targets if cfg.methods else ())]
        for rep in range(cfg.turn_repeats):
            for system in rotated(turn_systems, rep):
                if system == LLAMA:
                    runner.clear()
                    passes.setdefault(LLAMA, []).append([
                        peer_turn_row(name, i, runner.run_turn(ids, cfg.max_tokens, eos))
                        for name, i, ids in turn_prompts])
                    _log(cfg, f"agent turns round {rep + 1}: llama.cpp", t0)
                    continue
                target = targets[system]
                driven = drive(list(cfg.methods), cfg.traces, cfg.max_tokens, cfg.max_prompt,
                               cfg.turns, cfg.max_draft, target=target, progress=False,
                               reuse="on", dtype=target.dtype)
                for m in cfg.methods:
                    label = system.replace("agentspec plain", f"agentspec {LABELS[m]}")
                    passes.setdefault(label, []).append([
                        {"session": r["session"], "turn": r["turn"],
                         "prompt_tokens": r["prompt_tokens"],
                         **{k: r["methods"][f"{m}+reuse"][k] for k in (
                             "cached_tokens", "prefilled_tokens", "prefill_s", "latency_s",
                             "generated", "decode_tok_s")}} for r in driven["rows"]])
                _log(cfg, f"agent turns round {rep + 1}: {system}", t0)
        first_llama = passes[LLAMA][0]
        report["turns"] = {s: median_turns(p) for s, p in passes.items()}
        report["llamacpp_turn_tokens"] = [r["tokens"] for r in first_llama]
        report["turns_summary"] = {s: summarize_turns(r) for s, r in report["turns"].items()}
        mismatch = [(a["session"], a["turn"]) for s, rs in report["turns"].items() if s != LLAMA
                    for a, b in zip(rs, first_llama, strict=True)
                    if a["prompt_tokens"] != b["prompt_tokens"]]
        report["same_prompts"] = not mismatch
        save()
    runner.close()
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    save()
    return report


def add_peer_parser(sub: Any) -> None:
    """The ``agentspec peer`` sub-command."""
    p = sub.add_parser(
        "peer", help="run a peer (llama.cpp) beside agentspec on the same model and prompts",
        description="llama.cpp on the model's GGUF and agentspec on the same model, fed the "
                    "same token ids: prefill and plain decode tokens/s at each context length "
                    "(medians over rounds, systems interleaved), then the agent turns "
                    "`agentspec drive` runs (packaged SWE-agent logs, prefix reuse on) with "
                    "llama.cpp keeping the longest common prefix as llama-server does. "
                    "llama.cpp comes from `make llamacpp`.")
    p.add_argument("peer", choices=PEERS, help="the peer to run (llamacpp)")
    p.add_argument("--model", default=None,
                   help="shipped model name (default: the embedded model) or a local folder "
                        "(then --gguf is needed)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="the GGUF llama.cpp loads (default: the shipped model's own)")
    p.add_argument("--contexts", type=csv_list, default=["500", "4000"],
                   help="prompt lengths of the context points (default 500,4000)")
    p.add_argument("--decode-tokens", type=positive_int, default=64,
                   help="tokens decoded at each context point (default 64)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="rounds of context points; the table shows medians (default 3)")
    p.add_argument("--dtypes", default="auto,float32",
                   help="agentspec's precisions beside llama.cpp, or 'none' (default "
                        "auto,float32)")
    p.add_argument("--methods", default="plain,suffix",
                   help="agentspec's methods on the agent turns, or 'none' (default "
                        "plain,suffix: plain decoding and the default, both with reuse)")
    p.add_argument("--turns", type=non_negative_int, default=12,
                   help="agent turns (0: none; default 12)")
    p.add_argument("--max-prompt", type=positive_int, default=4096)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--turn-repeats", type=positive_int, default=1,
                   help="rounds of the agent turns (per-turn medians; default 1)")
    p.add_argument("--threads", type=positive_int, default=2,
                   help="llama.cpp's threads and torch's (default 2)")
    p.add_argument("--batch", type=positive_int, default=512,
                   help="llama.cpp's prompt tokens per forward (default 512)")
    p.add_argument("--max-draft", type=positive_int, default=32)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def _names(value: str) -> tuple[str, ...]:
    return () if value.strip().lower() == "none" else tuple(csv_list(value))


def run_peer_cli(args: argparse.Namespace) -> int:
    """Run ``agentspec peer llamacpp`` and print its table."""
    try:
        contexts = tuple(int(n) for n in args.contexts)
    except ValueError:
        raise BenchmarkError(f"--contexts takes token counts, got {args.contexts}") from None
    cfg = PeerConfig(model=args.model, gguf=args.gguf, contexts=contexts,
                     decode_tokens=args.decode_tokens, repeats=args.repeats,
                     dtypes=_names(args.dtypes), methods=_names(args.methods),
                     turns=args.turns, max_prompt=args.max_prompt, max_tokens=args.max_tokens,
                     turn_repeats=args.turn_repeats, threads=args.threads, n_batch=args.batch,
                     max_draft=args.max_draft, out=args.out, progress=not args.no_progress)
    report = run_peer(cfg)
    m = report["machine"]
    print(f"model: {report['settings']['model']}  machine: {m.get('cpu') or m['processor']}, "
          f"{m['cpus']} cpus, avx512 {'yes' if m.get('avx512f') else 'no'}")
    print(comparison_table(report))
    if args.out:
        print(f"results written to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m workflows.bench.llamacpp_bench peer llamacpp ...``."""
    parser = argparse.ArgumentParser(prog="python -m workflows.bench.llamacpp_bench")
    add_peer_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return run_peer_cli(args)
    except BenchmarkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
