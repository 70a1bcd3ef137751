"""Seeded sampling: position-keyed verification vs rejection sampling, one run.

``python -m workflows.bench.verifiers --keyed --temperature 0.7 --out results/keyed.json``

Every request is seeded (seed = its index). Two workloads on the embedded model, fp32:

* **relay**: DELEGATE-52 relays (the document re-emitted every turn), drafted by the
  session cache (``SuffixDrafter``, one session per relay).
* **open chat**: the first turn of the open-chat sessions, drafted by the EAGLE head.

Rows, per workload: plain sampling (no drafter; the keyed sampler, whose cost per token is
that of plain sampling), then the drafter verified by standard rejection sampling and by
the keyed verifier (GBV, the unseeded default, accepts as much as rejection on these
drafters: see the default run of :mod:`workflows.bench.verifiers`). On open chat, rejection
sampling is run twice: with the EAGLE head's greedy drafts (point masses, what seeded
sampling drafted before) and with its sampled drafts (the keyed Gumbel-coupled draws, an
exact sample of the head's law), so the coupling's acceptance is measured against standard
rejection sampling on the same head.

``identical`` counts the requests whose tokens equal plain keyed sampling's with the same
seed: the keyed rows must show all of them; the others follow their own generators and
change whenever the drafts change (``rejection: draft-dependent`` counts the open-chat
requests where rejection sampling's tokens differ between the two EAGLE draft kinds).
Times are one process, one pass per row: ratios are indicative on a busy machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from agentspec.chat.templates import render_prompt
from agentspec.drafters import SuffixConfig, SuffixDrafter
from agentspec.drafters.model.eagle import EagleConfig, load_default_eagle
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.interfaces import Drafter, Verifier
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.types import Draft, DraftContext, RequestStats, SamplingParams, SessionRef
from agentspec.verifiers import KeyedVerifier, RejectionVerifier
from workflows.workloads.datasets import data_dir
from workflows.workloads.delegate52 import Delegate52Workload
from workflows.workloads.open_chat import PROMPTS

__all__ = ["format_keyed", "run_keyed"]


class Uncoupled:
    """A drafter seen without the request's sampling: the EAGLE head then drafts greedily
    (point masses), as it did for every sampled request before keyed sampling."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = f"{inner.name}-greedy"
        self.wants_features = True

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """The inner drafter's draft for ``ctx`` without its sampling parameters."""
        draft: Draft = self.inner.propose(replace(ctx, sampling=None), max_tokens)
        return draft

    def __getattr__(self, name: str) -> Any:  # observe, finish, observe_features, ...
        return getattr(self.inner, name)


def _measure(engine: SpeculativeDecoder, jobs: Callable[[], Any], desc: str,
             ) -> tuple[dict[str, Any], list[list[int]]]:
    """Run the jobs ``jobs()`` yields (it may read the outputs so far: relays chain them)."""
    agg, outputs = RequestStats(), []
    t0 = time.perf_counter()
    gen = jobs()
    job = next(gen, None)
    bar = tqdm(desc=desc, leave=False, file=sys.stderr)
    while job is not None:
        prompt, max_tokens, stop, sampling, session = job
        out = engine.generate(prompt, max_tokens, stop, sampling, session)
        agg.merge(out.stats)
        outputs.append(out.tokens)
        bar.update(1)
        try:
            job = gen.send(out.text)  # a relay turns the answer into its next request
        except StopIteration:
            job = None
    bar.close()
    wall = time.perf_counter() - t0
    row = {"requests": len(outputs), "tokens": agg.generated_tokens,
           "seconds": round(agg.total_s, 2), "wall_s": round(wall, 2),
           "tokens_per_s": round(agg.tokens_per_s, 2),
           "mean_accepted_len": round(agg.mean_accepted_len, 3),
           "forwards_per_1k": round(agg.forwards_per_1k, 1)}
    return row, outputs


def _chat_jobs(target: HFTarget, n: int, max_tokens: int, temperature: float) -> Callable[[], Any]:
    prompts = [render_prompt(target.tokenizer, [{"role": "user", "content": q[0]}])
               for q in PROMPTS[:n]]

    def jobs() -> Any:
        for i, prompt in enumerate(prompts):
            yield prompt, max_tokens, (), SamplingParams(temperature, seed=i), None
    return jobs


def _relay_jobs(target: HFTarget, domains: int, turns: int, cap: int, temperature: float,
                tag: str) -> Callable[[], Any]:
    tok = target.tokenizer
    workload = Delegate52Workload(data_dir(), max_tokens=cap,
                                  count_tokens=lambda s: len(tok.encode(s)))

    def jobs() -> Any:
        index = 0
        for session in workload.sessions(domains, turns):
            ref = SessionRef(f"{session.session_id}-{tag}")
            last: str | None = None
            while (req := session.next_request(last)) is not None:
                sp = SamplingParams(temperature, seed=index)
                text = yield req.prompt_ids(tok), req.max_tokens, req.stop, sp, ref
                last = req.prefix + text
                index += 1
    return jobs


def run_keyed(args: argparse.Namespace) -> dict[str, Any]:
    """Measure both workloads (see the module docstring); the JSON-ready report."""
    # fp32, the reference by name: what this study's tables are labelled and measured in.
    target = HFTarget.load(TargetConfig(dtype="float32"))
    eos = [target.tokenizer.eos_token_id]
    decode = lambda ids: target.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    cfg = EngineConfig(max_draft=args.draft)

    def engine(drafter: Drafter | None, verifier: Verifier,
               config: EngineConfig = cfg) -> SpeculativeDecoder:
        return SpeculativeDecoder(target, drafter, verifier, decode, eos, config)

    report: dict[str, Any] = {"model": target.name, "config": {
        "temperature": args.temperature, "draft": args.draft, "chat_prompts": args.prompts,
        "chat_max_tokens": args.max_tokens, "relay_domains": args.relay_domains,
        "relay_turns": args.relay_turns, "relay_cap": args.relay_cap,
        "relay_draft": args.relay_draft,
        "date": time.strftime("%Y-%m-%d %H:%M:%S")}, "workloads": {}}
    engine(None, KeyedVerifier()).generate([1, 2, 3], 4, sampling=SamplingParams(1.0, seed=0))

    eagle = load_default_eagle(target, EagleConfig(max_tokens=args.draft))
    chat = _chat_jobs(target, args.prompts, args.max_tokens, args.temperature)
    chat_rows: dict[str, Any] = {}
    outs: dict[str, list[list[int]]] = {}
    for name, drafter, verifier in (
        ("plain", None, KeyedVerifier()),
        ("rejection, EAGLE greedy drafts", Uncoupled(eagle), RejectionVerifier()),
        ("rejection, EAGLE sampled drafts", eagle, RejectionVerifier()),
        ("keyed, EAGLE coupled drafts", eagle, KeyedVerifier()),
    ):
        chat_rows[name], outs[name] = _measure(engine(drafter, verifier), chat, f"chat {name}")
    differ = sum(a != b for a, b in zip(outs["rejection, EAGLE greedy drafts"],
                                        outs["rejection, EAGLE sampled drafts"], strict=True))
    report["workloads"]["open chat"] = _finish(chat_rows, outs)
    report["rejection_draft_dependent"] = {"requests": len(outs["plain"]), "differ": differ}

    relay_rows: dict[str, Any] = {}
    outs = {}
    for name, verifier in (("plain", KeyedVerifier()),
                           ("rejection, session cache", RejectionVerifier()),
                           ("keyed, session cache", KeyedVerifier())):
        cache = None if name == "plain" else SuffixDrafter(SuffixConfig(
            max_tokens=args.relay_draft))
        jobs = _relay_jobs(target, args.relay_domains, args.relay_turns, args.relay_cap,
                           args.temperature, tag=name.split(",")[0])
        relay_rows[name], outs[name] = _measure(
            engine(cache, verifier, EngineConfig(max_draft=args.relay_draft)), jobs,
            f"relay {name}")
    report["workloads"]["relay"] = _finish(relay_rows, outs)
    return report


def _finish(rows: dict[str, Any], outs: dict[str, list[list[int]]]) -> dict[str, Any]:
    """Speed-ups over plain and the ``identical`` counts (see the module docstring)."""
    base = rows["plain"]["tokens_per_s"] or 1.0
    for name, row in rows.items():
        row["speedup_vs_plain"] = round(row["tokens_per_s"] / base, 3)
        row["identical_to_plain_keyed"] = sum(a == b for a, b in zip(outs[name], outs["plain"],
                                                                     strict=False))
    return rows


def format_keyed(report: dict[str, Any]) -> str:
    """The Markdown table of a keyed report."""
    c = report["config"]
    lines = [f"Seeded sampling, temperature {c['temperature']}, k = {c['draft']} (open chat), "
             f"{c['relay_draft']} (relay) ({report['model']}, fp32):", "",
             "| workload | method | tokens/s | vs plain | mean accepted len | forwards/1k "
             "| identical to plain keyed |", "|---|---|---|---|---|---|---|"]
    for workload, rows in report["workloads"].items():
        for name, r in rows.items():
            lines.append(f"| {workload} | {name} | {r['tokens_per_s']:.1f} | "
                         f"{r['speedup_vs_plain']:.2f}x | {r['mean_accepted_len']:.2f} | "
                         f"{r['forwards_per_1k']:.0f} | {r['identical_to_plain_keyed']}/"
                         f"{r['requests']} |")
    d = report["rejection_draft_dependent"]
    lines += ["", f"Rejection sampling, same seeds, EAGLE greedy vs sampled drafts: "
                  f"{d['differ']}/{d['requests']} open-chat answers differ."]
    return "\n".join(lines)
