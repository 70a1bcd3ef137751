#!/usr/bin/env bash
# scripts/gpu_stage/pack.sh [MODEL] [PART_MB] — stage a checkout for a CUDA machine that already has torch and
# transformers but no package index, and that takes uploads of limited size (the checkout
# itself rides along with every upload). Run from the project root, with .venv built.
#
# Writes .gpu/p1 .. .gpu/pN (ignored through .git/info/exclude): each holds stage.sh, the
# manifest and one slice of the model's GGUF bytes; p1 also holds the wheels the machine lacks
# (pydantic, pydantic-core, llguidance, gguf and their small needs, for CPython 3.12). Upload
# the folders one after another to the same machine, running `bash .gpu/pK/stage.sh` each
# time; when the last one is in, `source /tmp/agentspec-stage/env.sh` and run agentspec
# (`python3 -m agentspec.cli ...`). docs/gpu.md says how and what was seen on an H200.
#
# MODEL: a shipped model name (default smollm2-135m-instruct). PART_MB: slice size (default:
# 64 MB minus what the checkout's own files weigh, minus room for the wheels).
set -euo pipefail
model=${1:-smollm2-135m-instruct}
root=$(git rev-parse --show-toplevel); cd "$root"
here=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
[ -x .venv/bin/python ] || { echo "pack.sh: build .venv first (make test or make demo)"; exit 2; }
mkdir -p .git/info; grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
tree_mb=$(( tree / 1000000 + 1 ))
part_mb=${2:-$(( 64 - tree_mb - 7 ))}
[ "$part_mb" -ge 8 ] || { echo "pack.sh: the checkout weighs ${tree_mb} MB: no room for model slices (move large files aside or pass PART_MB)"; exit 2; }
rm -rf .gpu && mkdir -p .gpu
.venv/bin/python - "$model" "$part_mb" <<'PY'
import hashlib, os, sys
from agentspec.models import shipped_model
m = shipped_model(sys.argv[1])
if m is None:
    sys.exit(f"pack.sh: {sys.argv[1]!r} is not a shipped model")
paths = m.part_paths()
if paths is None:
    sys.exit(f"pack.sh: {m.name} is not installed ({m.install_command})")
files = [(pkg, rel, os.path.getsize(p)) for (pkg, rel), p in zip(m.parts, paths)]
step = int(sys.argv[2]) * 1_000_000
digest, buf, k = hashlib.sha256(), b"", 0
def flush(final=False):
    global buf, k
    while len(buf) >= step or (final and buf):
        k += 1
        os.makedirs(f".gpu/p{k}", exist_ok=True)
        with open(f".gpu/p{k}/model.part", "wb") as f:
            f.write(buf[:step])
        buf = buf[step:]
for p in paths:
    with open(p, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk); buf += chunk; flush()
flush(final=True)
with open(".gpu/manifest", "w") as f:
    f.write(f"MODEL={m.name}\nN={k}\nSHA={digest.hexdigest()}\n")
    f.write("FILES='" + " ".join(f"{pkg}:{rel}:{size}" for pkg, rel, size in files) + "'\n")
print(f"{m.name}: {sum(s for *_, s in files):,} bytes in {k} slices of <= {step:,}")
PY
. .gpu/manifest
for k in $(seq 1 "$N"); do cp .gpu/manifest "$here/stage.sh" ".gpu/p$k/"; done
rm .gpu/manifest
# wheels the CUDA image lacks, at the versions this venv runs, for CPython 3.12 on x86-64 Linux
pkgs=""
for p in pydantic pydantic-core annotated-types typing-inspection typing-extensions llguidance gguf ${EXTRA_WHEELS:-}; do
  v=$(.venv/bin/python -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$v" ] && pkgs="$pkgs $p==$v"
done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/p1/whl $pkgs 2>&1 | grep -v '^WARNING' || true
echo "pack.sh: $N uploads: $(du -sh .gpu/p* | awk '{print $2" "$1}' | tr '\n' ' ')(+ the checkout, ${tree_mb} MB)"
echo "each upload: carry .gpu/pK, run: bash .gpu/pK/stage.sh   (K = 1..$N, back to back on one machine)"
echo "after the last: source /tmp/agentspec-stage/env.sh && python3 -m agentspec.cli bench --quick ..."
