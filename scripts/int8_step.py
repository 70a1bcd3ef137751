"""A plain decode step of the int8 family with its products on each kernel: the native
few-rows kernel, ``torch._int_mm``, and the product's own choice (timed per forward,
``int8_mm.py``), with fp32 as the reference, interleaved in one process (the machine's load
drifts; ratios within a round are what to read).

    python scripts/int8_step.py --model qwen2.5-coder-0.5b-instruct --context 500 \
        --dtypes float32,w8a16 --rounds 5 --out results/int8_step.json

Per dtype and kernel: the median and the best of ``--rounds`` rounds of ``--tokens`` plain
greedy steps after a ``--context``-token prompt (ms per step), and whether every variant
produced the same tokens as the first of its dtype. ``import agentspec`` (first here) lets
torch's idle OpenMP workers sleep; ``OMP_WAIT_POLICY=`` (set, empty) keeps OpenMP's own
default for a comparison. Run it under
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` (and ``AGENTSPEC_NATIVE_LIBRARY`` set to
an AVX2 build of the native library) to see an AVX2-only CPU's numbers on an AVX-512 one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# isort: off
import agentspec  # noqa: F401  (before torch: it sets the OpenMP wait policy torch reads)
import torch
# isort: on

from agentspec.targets.hf import HFTarget, TargetConfig
from agentspec.targets.kernels import int8_mm
from agentspec.targets.kernels.precision import activation_dtype


def _steps(target: HFTarget, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Seconds per plain greedy step after prefilling ``prompt``, and the tokens."""
    logits = target.prefill(prompt)
    out: list[int] = []
    t0 = time.perf_counter()
    for _ in range(tokens):
        out.append(int(logits.argmax()))
        logits = target.score([out[-1]])[-1]
    return (time.perf_counter() - t0) / tokens, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtypes", default="float32,w8a16")
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    variants: list[tuple[str, HFTarget, str]] = []
    for dtype in args.dtypes.split(","):
        target = HFTarget.load(TargetConfig(model=args.model, dtype=dtype, device="cpu",
                                            measure_costs=False))
        kernels = ["measured", "native", "_int_mm"] if dtype in ("w8a8", "w8a16") else [""]
        variants += [(f"{target.dtype}" + (f"/{k}" if k else ""), target, k) for k in kernels]
    vocab = variants[0][1].vocab_size
    prompt = torch.randint(100, min(vocab, 30000), (args.context,), generator=gen).tolist()
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, target, kernel in variants:
            with (int8_mm.forced(kernel == "native") if kernel in ("native", "_int_mm")
                  else contextlib.nullcontext()):
                step, out = _steps(target, prompt, args.tokens)
            times[name].append(step)
            outputs.setdefault(name, out)
    rows: list[dict[str, Any]] = []
    for name, _, _ in variants:
        base = outputs[next(n for n, _, _ in variants if n.split("/")[0] == name.split("/")[0])]
        rows.append({"variant": name, "median_ms": 1e3 * statistics.median(times[name]),
                     "best_ms": 1e3 * min(times[name]), "same_tokens": outputs[name] == base})
    info = {"model": args.model, "context": args.context, "tokens": args.tokens,
            "rounds": args.rounds, "threads": torch.get_num_threads(),
            "native_path": int8_mm.path(), "int_mm_exact": int8_mm.int_mm_exact(),
            "activation_dtype": str(activation_dtype()), "choices": int8_mm.choices(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "") or "OpenMP's default",
            "rows": rows}
    print(f"{args.model}, {args.context}-token context, {info['threads']} threads, native "
          f"path {info['native_path']}, _int_mm exact {info['int_mm_exact']}, activations "
          f"{info['activation_dtype']}, OMP_WAIT_POLICY {info['omp_wait_policy']}")
    print(f"{'variant':<20} {'median ms':>10} {'best ms':>9} {'tok/s':>7}  same tokens")
    for r in rows:
        print(f"{r['variant']:<20} {r['median_ms']:>10.1f} {r['best_ms']:>9.1f} "
              f"{1e3 / r['median_ms']:>7.1f}  {r['same_tokens']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
