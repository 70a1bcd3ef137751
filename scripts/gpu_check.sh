#!/usr/bin/env bash
# gpu_check.sh — agentspec on one CUDA GPU within DEADLINE_S (default 480 s): the quick bench
# in float32 and twice in bfloat16, a driven agent session, a step profile, one summary table.
#
#   scripts/gpu_check.sh                          # from anywhere; results in results/gpu_check
#   STEPS=bench-fp32 DEADLINE_S=240 scripts/gpu_check.sh
#   DEVICE=cpu PY=.venv/bin/python STEPS=bench-fp32 WORKLOADS=chat METHODS=greedy,suffix \
#     EXTRA_BENCH_ARGS="--limit 1 --turns 1" scripts/gpu_check.sh     # the flow, on a CPU
#
# The check is workflows/bench/gpu_check/ (standard library only, so the system python3 of a
# machine without a package index runs it); its docstring, `scripts/gpu_check.sh --help`,
# lists the knobs (environment variables: OUT_DIR, STEPS, DEADLINE_S, DEVICE, PY, HEAD, ...).
# Exit: 0 every step ok; 1 some step failed, ran out of time or was skipped; 2 no GPU or no
# usable Python.
cd "$(dirname "$0")/.." || exit 2
command -v python3 >/dev/null 2>&1 || { echo "gpu_check: FAIL: no python3" >&2; exit 2; }
exec python3 -m workflows.bench.gpu_check "$@"
