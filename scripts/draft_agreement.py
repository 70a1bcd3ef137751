"""How often a draft model's next token is the target's: the 0.5B drafting for the 1.5B.

    python scripts/draft_agreement.py --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --out results/draft_agreement.json

Both models load the way the product loads them (``HFTarget.load``, ``--dtype``, ``auto`` by
default). The text is what drafting meets: the target's own greedy answers (``--tokens``
per prompt) to agent prompts (the packaged SWE-agent trajectories' first turns, cut to
``--prompt-tokens``) and to open-chat questions (the ``chat`` workload's first turns),
each rendered with the chat template. The draft model reads each prompt and the target's
answer teacher-forced (a prefill, then one forward over the answer), and at every answer
position its argmax is compared with the target's token: the depth-1 agreement.

A greedy draft is accepted up to its first disagreement, and until then the draft model has
read exactly the target's tokens, so teacher forcing gives the accepted length of a
k-token draft started at any position exactly: the run of agreements from there, capped at
k. The table reports, per workload, the depth-1 agreement and the tokens one verify
commits (accepted + 1) for k = 1, 2, 4 and 8, drafting from every position. The live
counterpart (accepted tokens per step of ``hybrid`` and ``model`` in ``agentspec bench``)
is in the bench's JSON. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# isort: off
import agentspec  # noqa: F401  (before torch: it sets the OpenMP wait policy torch reads)
import torch
# isort: on

from agentspec.chat.templates import render_prompt
from agentspec.targets.hf import HFTarget, TargetConfig
from workflows.replay.logs import load_sessions
from workflows.workloads.open_chat import PROMPTS

TRACES = Path(__file__).resolve().parents[1] / "workflows/data/swe_agent_traces"
DEPTHS = (1, 2, 4, 8)


def _prompts(target: HFTarget, agent: int, chat: int, prompt_tokens: int
             ) -> dict[str, list[list[int]]]:
    """Token ids of the agent prompts (each cut to its last ``prompt_tokens``, the
    generation prompt kept) and of the chat prompts."""
    tok = target.tokenizer
    sessions = load_sessions([TRACES], tok)[:agent]
    agent_ids = [list(s.turns[0].prompt)[-prompt_tokens:] for s in sessions]
    chat_ids = [render_prompt(tok, [{"role": "user", "content": q[0]}]) for q in PROMPTS[:chat]]
    return {"agent": agent_ids, "chat": chat_ids}


def _greedy(target: HFTarget, prompt: list[int], tokens: int) -> list[int]:
    """The target's plain greedy answer (stopping at its end-of-turn token)."""
    eos = {int(t) for t in [target.tokenizer.eos_token_id] if t is not None}
    logits = target.prefill(prompt)
    out: list[int] = []
    while len(out) < tokens:
        out.append(int(logits.argmax()))
        if out[-1] in eos:
            break
        logits = target.score([out[-1]])[-1]
    return out


def _agreements(draft: HFTarget, prompt: list[int], answer: list[int]) -> list[bool]:
    """Per answer position, whether the draft model's argmax (teacher-forced) is it."""
    first = draft.prefill(prompt)  # [V]: predicts answer[0]
    rest = draft.score(answer[:-1]) if len(answer) > 1 else first[None][:0]  # [n-1, V]
    top = torch.cat([first.argmax()[None], rest.argmax(-1)])  # [n]
    return [bool(t) for t in (top == torch.tensor(answer))]


def _accepted(agree: list[bool], k: int) -> float:
    """Mean accepted draft tokens of a k-token greedy draft started at each position."""
    total = 0
    for i in range(len(agree)):
        run = 0
        while run < k and i + run < len(agree) and agree[i + run]:
            run += 1
        total += run
    return total / max(1, len(agree))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="auto", help="both models' precision (default auto)")
    ap.add_argument("--agent", type=int, default=4, help="agent prompts (SWE-agent logs)")
    ap.add_argument("--chat", type=int, default=8, help="open-chat prompts")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--tokens", type=int, default=96, help="target answer tokens per prompt")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    config = {"dtype": args.dtype, "device": "cpu", "measure_costs": False,
              "prefix_cache_bytes": 0}
    target = HFTarget.load(TargetConfig(model=args.target, **config))
    prompts = _prompts(target, args.agent, args.chat, args.prompt_tokens)
    answers = {w: [_greedy(target, p, args.tokens) for p in ps] for w, ps in prompts.items()}
    precision = target.dtype
    del target
    draft = HFTarget.load(TargetConfig(model=args.draft, **config))
    rows: list[dict[str, Any]] = []
    for workload, ps in prompts.items():
        agree: list[bool] = []
        for prompt, answer in zip(ps, answers[workload], strict=True):
            agree += _agreements(draft, prompt, answer)
        row: dict[str, Any] = {"workload": workload, "prompts": len(ps), "positions": len(agree),
                               "depth1_agreement": sum(agree) / max(1, len(agree))}
        row.update({f"tokens_per_verify_k{k}": 1 + _accepted(agree, k) for k in DEPTHS})
        rows.append(row)
    result = {"target": args.target, "draft": args.draft, "dtype": precision,
              "prompt_tokens": args.prompt_tokens, "answer_tokens": args.tokens, "rows": rows}
    print(f"{args.draft} drafting for {args.target} ({precision}), teacher-forced on the "
          "target's greedy answers")
    head = " | ".join(f"tokens/verify k={k}" for k in DEPTHS)
    print(f"| workload | prompts | positions | depth-1 agreement | {head} |")
    print("|---|---|---|---|" + "---|" * len(DEPTHS))
    for r in rows:
        cells = " | ".join(f"{r[f'tokens_per_verify_k{k}']:.2f}" for k in DEPTHS)
        print(f"| {r['workload']} | {r['prompts']} | {r['positions']} | "
              f"{r['depth1_agreement']:.3f} | {cells} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
