"""Measure the distilled drafter on the embedded model: cost per drafted token against a
target forward, and open-chat decoding (``workflows/workloads/open_chat.py`` prompts) against plain
greedy in the same process, with the strict greedy verifier.

    python scripts/measure_drafter.py                     # the default drafter
    python scripts/measure_drafter.py --drafter /tmp/d.safetensors --sessions 10

Methods run request by request in rotating order so machine noise hits all of them alike;
report ratios (speed-up over greedy), not absolute tokens/s, on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from agentspec.chat.templates import render_prompt
from agentspec.drafters.model.causal import ModelDrafterConfig
from agentspec.drafters.model.distilled import load_default_drafter, load_distilled_drafter
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.targets.hf import HFTarget
from agentspec.types import DraftContext, RequestStats
from workflows.workloads.open_chat import ChatWorkload


def _median_ms(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def measure_costs(target: HFTarget, drafter: Any, repeats: int = 15) -> dict[str, float]:
    """Target one-token forward vs drafter cost per drafted token, 300-token context."""
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, target.vocab_size, (300,), generator=gen).tolist()
    target.prefill(ctx)

    def target_step() -> None:
        target.score([ctx[7]])
        target.rollback(1)

    dctx = DraftContext(ctx, len(ctx))
    drafter.propose(dctx, 8)  # fills the drafter's cache with the context
    out: dict[str, list[float]] = {"target_k1_ms": [], "draft_per_token_ms": []}
    for _ in range(3):  # interleave: noise hits both alike
        out["target_k1_ms"].append(_median_ms(target_step, repeats))
        out["draft_per_token_ms"].append(_median_ms(lambda: drafter.propose(dctx, 8), repeats)
                                         / 8)
    res = {k: statistics.median(v) for k, v in out.items()}
    res["ratio"] = res["draft_per_token_ms"] / res["target_k1_ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--drafter", type=Path, default=None)
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--variants", default="4:0,6:0.3",
                    help="comma-separated max_draft:stop_below pairs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    target = HFTarget.load()
    tok = target.tokenizer

    def load(k: int, stop: float) -> Any:
        cfg = ModelDrafterConfig(max_tokens=k)
        if args.drafter is None:
            return load_default_drafter(target, cfg, stop_below=stop)
        return load_distilled_drafter(target, args.drafter, cfg, stop_below=stop)

    variants = [(int(a), float(b)) for a, b in (v.split(":") for v in args.variants.split(","))]
    costs = measure_costs(target, load(8, 0.0))
    print(json.dumps(costs))
    engines: dict[str, SpeculativeDecoder] = {}
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    engines["greedy"] = SpeculativeDecoder(target, None, decode=decode,
                                           eos_token_ids=[tok.eos_token_id])
    for k, stop in variants:
        engines[f"distilled k={k} stop={stop}"] = SpeculativeDecoder(
            target, load(k, stop), decode=decode, eos_token_ids=[tok.eos_token_id],
            config=EngineConfig(max_draft=k))
    stats = {name: RequestStats() for name in engines}
    identical = {name: True for name in engines}
    names = list(engines)
    n = 0
    for session in ChatWorkload(max_tokens=args.max_tokens).sessions(args.sessions, args.turns):
        last: str | None = None
        while (req := session.next_request(last)) is not None:
            prompt = render_prompt(tok, req.messages)
            outs = {}
            order = names[n % len(names):] + names[: n % len(names)]
            for name in order:
                g = engines[name].generate(prompt, req.max_tokens)
                stats[name].merge(g.stats)
                outs[name] = g
            n += 1
            for name in names:
                identical[name] &= outs[name].tokens == outs["greedy"].tokens
            last = outs["greedy"].text
    base = stats["greedy"].tokens_per_s
    rows = []
    for name in names:
        s = stats[name]
        drafted = [st for st in s.steps if st.draft_len > 0]
        first = sum(st.accepted > 0 for st in drafted) / max(1, len(drafted))
        rows.append({
            "method": name, "requests": n, "tokens": s.generated_tokens,
            "tok_s": round(s.tokens_per_s, 2), "speedup": round(s.tokens_per_s / base, 3),
            "mean_accepted_len": round(s.mean_accepted_len, 3),
            "first_token_accept": round(first, 3),
            "mean_draft_len": round(sum(st.draft_len for st in drafted) / max(1, len(drafted)),
                                    2),
            "draft_share": round(s.draft_s / max(s.total_s, 1e-9), 3),
            "identical": identical[name],
        })
        print(json.dumps(rows[-1]))
    if args.out:
        args.out.write_text(json.dumps({"costs": costs, "chat": rows}, indent=1))


if __name__ == "__main__":
    main()
