"""Where a decode step's time goes: device, host and drafter, plain and suffix, eager
(every forward its own shape, as before shape-stable forwards) against shape-stable (and,
on CUDA, a captured graph).

    python scripts/step_profile.py --device cuda --out results/step_profile.json
    python scripts/step_profile.py --device cpu --dtypes bfloat16 --tokens 48

For each dtype and mode it loads the embedded model once, prefills a ~600-token agent
prompt (a DELEGATE-52 document and an edit request) and decodes ``--tokens`` tokens with
plain greedy decoding and with the session suffix cache (the document's own text drafts
the copy). Per step it reports wall time, the engine's drafter time, and, on CUDA, the
device's kernel time from the profiler (host = wall - device: Python, launches, copies);
then the top operators of one profiled plain run. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentspec.drafters.suffix.drafter import SuffixDrafter
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.targets.hf import HFTarget, TargetConfig


def _prompt(target: HFTarget) -> list[int]:
    row = json.loads((Path(__file__).resolve().parents[1] / "workflows/data/"
                      "delegate52_domains.jsonl").read_text().splitlines()[0])
    text = (f"Here is a file:\n\n{row['seed_excerpt']}\n\nRewrite the file exactly, with "
            "every amount in euros instead of dollars. Answer with the whole file.")
    ids: list[int] = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = list(ids["input_ids"])
    return ids[-700:]


def _decode(target: HFTarget, prompt: list[int], tokens: int, suffix: bool,
            device_time: bool) -> dict[str, Any]:
    drafter = SuffixDrafter() if suffix else None
    engine = SpeculativeDecoder(target, drafter, config=EngineConfig(max_draft=16))
    engine.generate(prompt, max_tokens=8)  # warm: first forwards, graph capture
    sync = torch.cuda.synchronize if target.device == "cuda" else (lambda: None)
    sync()
    prof = None
    if device_time:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    t0 = time.perf_counter()
    gen = engine.generate(prompt, max_tokens=tokens)
    sync()
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {}
    if prof is not None:
        prof.__exit__(None, None, None)
        events = prof.key_averages()
        dev_us = sum(getattr(e, "self_device_time_total", 0.0) or 0.0 for e in events)
        row["device_ms_per_step"] = dev_us / 1000 / max(1, gen.stats.forwards)
        row["top_ops"] = prof.key_averages().table(
            sort_by="cpu_time_total", row_limit=12, max_name_column_width=40)
    st = gen.stats
    steps = max(1, st.forwards)
    decode_s = wall - st.prefill_s
    row.update({
        "tokens": len(gen.tokens), "forwards": st.forwards,
        "tok_s": len(gen.tokens) / max(decode_s, 1e-9),
        "wall_ms_per_step": decode_s / steps * 1000,
        "drafter_ms_per_step": st.draft_s / steps * 1000,
        "accepted_per_step": len(gen.tokens) / steps,
        "output": gen.tokens,
    })
    if "device_ms_per_step" in row:
        row["host_ms_per_step"] = row["wall_ms_per_step"] - row["device_ms_per_step"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="eager,stable", help="eager, stable (comma-separated)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="results/step_profile.json")
    args = ap.parse_args(argv)
    results: list[dict[str, Any]] = []
    for dtype in args.dtypes.split(","):
        for mode in args.modes.split(","):
            cfg = TargetConfig(model=args.model, dtype=dtype, device=args.device,
                               shape_stable=(mode == "stable"), measure_costs=False,
                               prefix_cache_bytes=0)
            try:
                target = HFTarget.load(cfg)
                prompt = _prompt(target)
                for method in ("plain", "suffix"):
                    row = _decode(target, prompt, args.tokens, method == "suffix",
                                  device_time=args.device == "cuda")
                    graph = target.kv.graph
                    row.update(dtype=dtype, mode=mode, method=method,
                               graph=None if graph is None else
                               (graph.failed or f"{graph.replays} replays"))
                    results.append(row)
                    print(f"{dtype:9} {mode:7} {method:7} {row['tok_s']:8.1f} tok/s "
                          f"{row['wall_ms_per_step']:7.2f} ms/step "
                          f"(device {row.get('device_ms_per_step', float('nan')):.2f}, "
                          f"drafter {row['drafter_ms_per_step']:.2f}) "
                          f"{row['accepted_per_step']:.2f} tok/step graph={row['graph']}",
                          flush=True)
                del target
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            except Exception as exc:  # one configuration failing must not lose the others
                results.append({"dtype": dtype, "mode": mode,
                                "error": f"{type(exc).__name__}: {exc}"})
                print(f"{dtype} {mode}: FAILED {type(exc).__name__}: {exc}", flush=True)
    for dtype in args.dtypes.split(","):  # same tokens, eager vs stable, plain vs suffix
        outs = {(r["mode"], r["method"]): r["output"] for r in results
                if r.get("dtype") == dtype and "output" in r}
        if outs:
            ref = next(iter(outs.values()))
            print(f"{dtype}: all outputs identical: {all(o == ref for o in outs.values())}; "
                  f"stable plain == stable suffix: "
                  f"{outs.get(('stable', 'plain')) == outs.get(('stable', 'suffix'))}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    for r in results:
        if r.get("top_ops") and r.get("method") == "plain":
            print(f"\n== top operators, {r['dtype']} {r['mode']} plain ==\n{r['top_ops']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
