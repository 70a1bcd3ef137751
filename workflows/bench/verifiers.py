"""Lossless sampling verifiers on the embedded model: rejection vs block (GBV), SpecTr-GBV K.

``python -m workflows.bench.verifiers --out results/verifiers.json`` samples open-chat
answers (temperature 1 by default) with the distilled model drafter
(:func:`agentspec.drafters.model.distilled.load_default_drafter`) drafting ``k`` tokens per step,
and measures:

* **rejection vs block on the same drafts and draws.** The decode runs with block
  verification; at every step the same draft, the same target logits and a copy of the
  generator state (hence the same uniforms) are also given to standard rejection
  sampling, and both accepted lengths are recorded. Both rules are exact, so their mean
  accepted lengths are directly comparable (GBV is never worse in expectation).
* **SpecTr-GBV with K = 1, 2, 4 drafts**: the multi-draft engine, K i.i.d. drafts verified in
  one batched forward; mean accepted length per step, tokens/s and target forwards per
  1,000 tokens, next to plain sampling (no drafter) in the same run.

Timings are ratios measured in one process: run it on a quiet machine.

``--keyed`` runs the seeded-sampling comparison instead (:mod:`workflows.bench.keyed`):
position-keyed verification next to rejection sampling, speed-up over plain
sampling on the DELEGATE-52 relay and open chat, and whether the tokens reproduce.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from agentspec.chat.templates import render_prompt
from agentspec.drafters.model.causal import ModelDrafterConfig
from agentspec.drafters.model.distilled import load_default_drafter
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.multi_engine import MultiDraftDecoder
from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.tokens import eos_ids
from agentspec.types import Draft, RequestStats, SamplingParams, VerifyResult
from agentspec.verifiers import BlockVerifier, RejectionVerifier
from workflows.workloads.open_chat import PROMPTS


@dataclass
class PairedVerifier:
    """Verifies with block verification and, on a copy of the generator state, also with
    rejection sampling; records both accepted lengths (the decode follows block's result).
    """

    lossless = True
    block: BlockVerifier = field(default_factory=BlockVerifier)
    rejection: RejectionVerifier = field(default_factory=RejectionVerifier)
    pairs: list[tuple[int, int, int]] = field(default_factory=list)  # (k, block, rejection)

    def verify(
        self,
        draft: Draft,
        logits: torch.Tensor,  # [k+1, V]
        sampling: SamplingParams,
        rng: torch.Generator | None = None,
        *,
        request_id: str | None = None,
    ) -> VerifyResult:
        """Block verification's result; rejection's accepted length is recorded beside it."""
        if rng is None or not draft.tokens:
            return self.block.verify(draft, logits, sampling, rng, request_id=request_id)
        state = rng.get_state()
        other = self.rejection.verify(draft, logits, sampling, rng, request_id=request_id)
        rng.set_state(state)  # block sees exactly the uniforms rejection saw
        result = self.block.verify(draft, logits, sampling, rng, request_id=request_id)
        self.pairs.append((len(draft.tokens), result.num_accepted, other.num_accepted))
        return result


def _prompts(target: HFTarget, n: int) -> list[list[int]]:
    """The first user turn of the first ``n`` open-chat sessions, rendered."""
    tok = target.tokenizer
    return [render_prompt(tok, [{"role": "user", "content": q[0]}]) for q in PROMPTS[:n]]


def _run(
    engine: SpeculativeDecoder, prompts: Sequence[list[int]], seeds: Sequence[int],
    max_tokens: int, temperature: float, desc: str,
) -> dict[str, Any]:
    """Decode every prompt with every seed; aggregate the request statistics."""
    agg = RequestStats()
    for prompt in tqdm(prompts, desc=desc, leave=False, file=sys.stderr):
        for seed in seeds:
            g = engine.generate(prompt, max_tokens, sampling=SamplingParams(temperature, seed=seed))
            agg.merge(g.stats)
    return {
        "tokens": agg.generated_tokens,
        "seconds": round(agg.total_s, 3),
        "tokens_per_s": round(agg.tokens_per_s, 2),
        "mean_accepted_len": round(agg.mean_accepted_len, 3),
        "forwards_per_1k": round(agg.forwards_per_1k, 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure everything (see the module docstring); return the JSON-ready report."""
    torch.manual_seed(0)
    # fp32, the reference by name: what this study's tables are labelled and measured in.
    target = HFTarget.load(TargetConfig(dtype="float32"))
    tok = target.tokenizer
    eos = eos_ids(tok)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    cfg = EngineConfig(max_draft=args.draft)
    drafter_cfg = ModelDrafterConfig(max_tokens=args.draft, temperature=args.temperature)
    drafter = load_default_drafter(target, drafter_cfg)
    prompts = _prompts(target, args.prompts)
    seeds = list(range(args.seeds))
    common = (prompts, seeds, args.max_tokens, args.temperature)

    rows: dict[str, dict[str, Any]] = {}
    # No drafter: every step samples one token (the sampling rule with an empty draft).
    rows["plain"] = _run(SpeculativeDecoder(target, None, BlockVerifier(), decode, eos, cfg),
                         *common, desc="plain")
    paired = PairedVerifier()
    rows["block (GBV)"] = _run(SpeculativeDecoder(target, drafter, paired, decode, eos, cfg),
                               *common, desc="block")
    rows["rejection"] = _run(
        SpeculativeDecoder(target, drafter, RejectionVerifier(), decode, eos, cfg), *common,
        desc="rejection",
    )
    for k in (1, 2, 4):
        engine = MultiDraftDecoder(target, drafter, num_drafts=k, decode=decode,
                                   eos_token_ids=eos, config=cfg)
        rows[f"SpecTr-GBV K={k}"] = _run(engine, *common, desc=f"spectr K={k}")
    base = rows["plain"]["tokens_per_s"] or 1.0
    for row in rows.values():
        row["speedup_vs_plain"] = round(row["tokens_per_s"] / base, 3)

    pairs = paired.pairs
    n = max(len(pairs), 1)
    paired_summary = {
        "steps": len(pairs),
        "draft_len": args.draft,
        "block_mean_accepted": round(sum(p[1] for p in pairs) / n, 4),
        "rejection_mean_accepted": round(sum(p[2] for p in pairs) / n, 4),
        "steps_block_longer": sum(p[1] > p[2] for p in pairs),
        "steps_rejection_longer": sum(p[1] < p[2] for p in pairs),
    }
    return {
        "model": target.name,
        "config": {"temperature": args.temperature, "draft": args.draft,
                   "prompts": len(prompts), "seeds": len(seeds),
                   "max_tokens": args.max_tokens,
                   "date": time.strftime("%Y-%m-%d %H:%M:%S")},
        "same_draws": paired_summary,
        "methods": rows,
    }


def verifier_tables(report: dict[str, Any]) -> str:
    """The two Markdown tables of a report."""
    s = report["same_draws"]
    lines = [
        f"Same drafts and uniforms ({s['steps']} steps, k = {s['draft_len']}):",
        "",
        "| rule | mean accepted | steps where it accepted more |",
        "|---|---|---|",
        f"| rejection | {s['rejection_mean_accepted']:.3f} | {s['steps_rejection_longer']} |",
        f"| block (GBV) | {s['block_mean_accepted']:.3f} | {s['steps_block_longer']} |",
        "",
        "| method | tokens/s | vs plain | mean accepted len | forwards/1k |",
        "|---|---|---|---|---|",
    ]
    for name, r in report["methods"].items():
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f}x | "
                     f"{r['mean_accepted_len']:.2f} | {r['forwards_per_1k']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(
        prog="python -m workflows.bench.verifiers",
        description="Rejection vs block verification on the same draws, and SpecTr-GBV "
                    "with K = 1, 2, 4 drafts, on the embedded model with the distilled "
                    "drafter (open-chat prompts, sampling).",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--draft", type=int, default=4, help="draft length k (default 4)")
    p.add_argument("--prompts", type=int, default=6, help="open-chat prompts (default 6)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per prompt (default 3)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--keyed", action="store_true",
                   help="seeded sampling: keyed vs rejection on relay and open chat")
    p.add_argument("--relay-domains", type=int, default=1, help="--keyed: relays (default 1)")
    p.add_argument("--relay-turns", type=int, default=2, help="--keyed: turns per relay")
    p.add_argument("--relay-draft", type=int, default=16,
                   help="--keyed: longest session-cache draft on the relay (default 16)")
    p.add_argument("--relay-cap", type=int, default=160,
                   help="--keyed: most tokens per relay turn (default 160)")
    args = p.parse_args(argv)
    if args.keyed:
        from workflows.bench.keyed import format_keyed, run_keyed

        keyed = run_keyed(args)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(keyed, indent=1))
        print(format_keyed(keyed))
        return 0
    report = run(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(verifier_tables(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
