"""Where a decode step's time goes: device, host and drafter, plain and suffix, eager
(every forward its own shape, as before shape-stable forwards) against shape-stable (and,
on CUDA, a captured graph).

    python scripts/step_profile.py --device cuda --out results/step_profile.json
    python scripts/step_profile.py --device cpu --dtypes float32,bfloat16,int8 --modes stable \
        --model qwen2.5-coder-0.5b-instruct --tokens 48

For each dtype and mode it loads the embedded model once, prefills a ~600-token agent
prompt (a DELEGATE-52 document and an edit request) and decodes ``--tokens`` tokens with
plain greedy decoding and with the session suffix cache (the document's own text drafts
the copy). Per decode step (the prompt's prefill subtracted) it reports wall time, the
engine's drafter time, and the kernel time from the profiler: on CUDA the device's, on the
CPU the weight products' and attention's (host = wall - kernels: Python, small operators,
copies, and the profiler's own cost); then the top operators of one profiled plain run.
Writes JSON and prints a table.
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


#: The CPU operators that do a forward's arithmetic (weight products, attention): the CPU's
#: "device" time. The rest of a step's wall time is the host's (Python, small ops, copies).
CPU_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
               "aten::_weight_int8pack_mm", "aten::_int_mm",
               "aten::_scaled_dot_product_flash_attention_for_cpu")


def _kernel_us(prof: Any, cuda: bool) -> float:
    events = prof.key_averages()
    if cuda:
        return float(sum(getattr(e, "self_device_time_total", 0.0) or 0.0 for e in events))
    return float(sum(e.self_cpu_time_total for e in events if e.key in CPU_KERNELS))


def _timed(engine: SpeculativeDecoder, prompt: list[int], tokens: int, profile: bool,
           cuda: bool) -> tuple[Any, float, float, Any]:
    """One generation: (result, wall s, kernel µs or nan, profiler or None)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    prof = None
    if profile:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=acts)
        prof.__enter__()
    t0 = time.perf_counter()
    gen = engine.generate(prompt, max_tokens=tokens)
    sync()
    wall = time.perf_counter() - t0
    kernel = float("nan")
    if prof is not None:
        prof.__exit__(None, None, None)
        kernel = _kernel_us(prof, cuda)
    return gen, wall, kernel, prof


def _decode(target: HFTarget, prompt: list[int], tokens: int, suffix: bool,
            profile: bool) -> dict[str, Any]:
    """Decode ``tokens`` tokens; per decode step: wall, kernel ("device") and host time.

    A second generation of one token (the prefill and the first step) is subtracted from
    the first, so the prompt's prefill is not spread over the decode steps."""
    drafter = SuffixDrafter() if suffix else None
    engine = SpeculativeDecoder(target, drafter, config=EngineConfig(max_draft=16))
    cuda = target.device == "cuda"
    engine.generate(prompt, max_tokens=8)  # warm: first forwards, graph capture
    gen, wall, kernel, prof = _timed(engine, prompt, tokens, profile, cuda)
    head, head_wall, head_kernel, _ = _timed(engine, prompt, 1, profile, cuda)
    st = gen.stats
    steps = max(1, st.forwards - head.stats.forwards)
    decode_s = max(wall - head_wall, 1e-9)
    row: dict[str, Any] = {
        "tokens": len(gen.tokens), "forwards": st.forwards,
        "tok_s": (len(gen.tokens) - 1) / decode_s,
        "wall_ms_per_step": decode_s / steps * 1000,
        "drafter_ms_per_step": (st.draft_s - head.stats.draft_s) / steps * 1000,
        "accepted_per_step": (len(gen.tokens) - 1) / steps,
        "output": gen.tokens,
    }
    if prof is not None:
        # Profiled runs carry the profiler's own per-operator cost in their host time.
        row["device_ms_per_step"] = (kernel - head_kernel) / 1000 / steps
        row["host_ms_per_step"] = row["wall_ms_per_step"] - row["device_ms_per_step"]
        row["top_ops"] = prof.key_averages().table(
            sort_by="self_cpu_time_total" if not cuda else "cpu_time_total", row_limit=12,
            max_name_column_width=40)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma-separated: float32, bfloat16, int8 (CPU)")
    ap.add_argument("--modes", default="eager,stable", help="eager, stable (comma-separated)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model", default=None)
    ap.add_argument("--no-profile", action="store_true",
                    help="time steps without the profiler (no device/host split)")
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
                                  profile=not args.no_profile)
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
