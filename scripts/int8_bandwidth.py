"""How close the native int8 product comes to the memory's read bandwidth.

    python scripts/int8_bandwidth.py --rows 1,2,4,8 --threads 1,2

A decode step's products are bound by reading the weights, so the number that matters is
bytes of weight per second. Two int8 matrices of Qwen2.5-0.5B's output layer's shape
(151,936 x 896, 136 MB each: far larger than any cache) are multiplied alternately (each
call reads its weights from memory), by ``--rows`` activation rows on the native kernel
and on ``torch._int_mm``; the reference is a plain read of the same bytes (an int64 sum).
Medians of ``--calls`` calls, GB/s of weights read. ``AGENTSPEC_NATIVE_LIBRARY`` loads
another build of the native library (an AVX2 one, say).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# isort: off
import agentspec  # noqa: F401  (before torch: it sets the OpenMP wait policy torch reads)
import torch
# isort: on

from agentspec.targets.kernels import int8_mm


def _gbps(weights: list[torch.Tensor], call: Callable[[torch.Tensor], object],
          calls: int) -> float:
    times = []
    for i in range(calls):
        w = weights[i % len(weights)]
        t0 = time.perf_counter()
        call(w)
        times.append(time.perf_counter() - t0)
    return weights[0].numel() / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shape", default="151936x896", help="OUTxIN of the weight matrices")
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args(argv)
    n, k = (int(x) for x in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
               for _ in range(2)]
    print(f"native path {int8_mm.path()}, weights {n}x{k} int8 ({n * k / 1e6:.0f} MB each)")
    print("| threads | read (int64 sum) | rows | native GB/s | _int_mm GB/s |")
    print("|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        read = _gbps(weights, lambda w: w.view(torch.int64).sum(), args.calls)
        for m in (int(r) for r in args.rows.split(",")):
            a = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
            ours = _gbps(weights, lambda w, a=a: int8_mm.native_mm(a, w), args.calls)
            theirs = _gbps(weights, lambda w, a=a: torch._int_mm(a, w.t()), args.calls)
            print(f"| {threads} | {read:.1f} | {m} | {ours:.1f} | {theirs:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
