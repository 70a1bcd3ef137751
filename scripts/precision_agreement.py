"""How far each precision's model is from fp32's: teacher-forced top-1 agreement and
negative log-likelihood on real agent text.

    python scripts/precision_agreement.py --model qwen2.5-coder-0.5b-instruct \
        --dtypes float32,bfloat16,int8,w8a8,w8a16 --out results/precision_agreement.json

Each precision loads the way the product loads it (``HFTarget.load``: the int8 precisions are
quantized from the fp32 weights). The text is the packaged SWE-agent trajectories, each
session's first turn rendered with the model's chat template (prompt and logged answer),
cut to ``--positions`` tokens. For every position the script compares the precision's
next-token argmax with fp32's, and averages each precision's loss on the text's own next
tokens. A whole-text forward takes the prompt path (int8 and w8a16 multiply the dequantized
weights in bf16 there); ``--decode-kernels`` runs every row through the product decode
steps use instead. Speculation in any precision is exact against plain decoding in that precision;
this measures what the precision itself changes. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.targets.kernels import int8, w8a8
from workflows.replay.logs import load_sessions

TRACES = Path(__file__).resolve().parents[1] / "workflows/data/swe_agent_traces"


def _texts(target: HFTarget, sessions: int, positions: int) -> list[torch.Tensor]:
    out = []
    for s in load_sessions([TRACES], target.tokenizer)[:sessions]:
        turn = s.turns[0]
        ids = (turn.prompt + turn.output)[:positions]
        out.append(torch.tensor([ids]))  # [1, n]
    return out


def _logits(target: HFTarget, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return target.model(ids.to(target.device)).logits[0].float().cpu()  # [n, V]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="shipped model name or HF folder")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8,w8a8,w8a16",
                    help="comma-separated; float32 (the reference) is always measured")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--decode-kernels", action="store_true",
                    help="run every row through the precision's decode product (int8: the "
                         "int8 kernel over bf16 rows; w8a16: the two-digit integer product) "
                         "instead of the prompt path a whole-text forward takes (int8 from "
                         "64 rows on, w8a16 from 256: the dequantized weights in bf16)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.decode_kernels:  # the row count from which a forward takes the prompt path
        int8.PREFILL_ROWS = w8a8.W8A16_PREFILL_ROWS = sys.maxsize
    torch.manual_seed(0)
    dtypes = ["float32"] + [d for d in args.dtypes.split(",") if d and d != "float32"]
    ref: list[torch.Tensor] = []
    rows = []
    texts: list[torch.Tensor] = []
    for dtype in dtypes:
        target = HFTarget.load(TargetConfig(model=args.model, dtype=dtype, device="cpu",
                                            measure_costs=False, prefix_cache_bytes=0))
        texts = texts or _texts(target, args.sessions, args.positions)
        agree = n = 0
        nll = 0.0
        for i, ids in enumerate(texts):
            logits = _logits(target, ids)  # [n, V]
            top = logits.argmax(-1)  # [n]
            if dtype == "float32":
                ref.append(top)
            agree += int((top == ref[i]).sum())
            n += int(top.numel())
            nll += float(torch.nn.functional.cross_entropy(
                logits[:-1], ids[0, 1:], reduction="sum"))
        rows.append({"dtype": dtype, "positions": n, "top1_agreement_with_fp32": agree / n,
                     "nll_per_token": nll / (n - len(texts))})
        print(f"{dtype:9s} agreement with fp32 {agree / n:.4f}  "
              f"nll/token {rows[-1]['nll_per_token']:.4f}", flush=True)
        del target
    result = {"model": args.model or "embedded", "sessions": len(texts),
              "positions_per_session": args.positions, "decode_kernels": args.decode_kernels,
              "rows": rows}
    print("\n| dtype | top-1 agreement with fp32 | NLL per token |\n|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['top1_agreement_with_fp32']:.3f} | "
              f"{r['nll_per_token']:.4f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
