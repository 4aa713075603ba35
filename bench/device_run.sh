#!/usr/bin/env bash
# The GPU benchmarks in one go, for a CUDA machine that has torch, transformers, peft, accelerate and safetensors
# but not diffusers, and no network: diffusers (and importlib_metadata) come as wheels in .whl/ (git-ignored; see
# bench/README.md for the pip download command). Run from the repository root; writes to $OUT (default
# /tmp/bench-out): log.txt (everything printed), gpu_sd15.json, gpu_sd15_levers.json, gpu_large.json. About 10
# minutes on an H200 at most (the scripts' --time-budget bound what they start: 120, 150 and 300 s, plus set-up).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: > "$LOG"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --root-user-action=ignore --upgrade --target /tmp/site .whl/*.whl \
  2>&1 | tee -a "$LOG" && export PYTHONPATH=/tmp/site:$PWD || { echo "error: installing .whl/*.whl failed" | tee -a "$LOG"; exit 1; }

{
  date -u
  nvidia-smi -L
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
  python3 - <<'PY'
import importlib.metadata as md, sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version(), "| cuda available", torch.cuda.is_available())
for pkg in ("diffusers", "transformers", "peft", "accelerate", "safetensors", "huggingface-hub", "numpy"):
    try:
        print(f"  {pkg} {md.version(pkg)}")
    except md.PackageNotFoundError:
        print(f"  {pkg} missing")
import diffusers
print("  diffusers imported from", diffusers.__file__)
PY
} 2>&1 | tee -a "$LOG" || exit 1

status=0
echo "== bench/gpu_sd15.py" | tee -a "$LOG"
python3 bench/gpu_sd15.py --out "$OUT/gpu_sd15.json" --steps 10 --time-budget 120 2>&1 | tee -a "$LOG" || status=$?
echo "== bench/gpu_sd15.py --levers (SD 1.5 LoRA batch 8 with each speed lever)" | tee -a "$LOG"
python3 bench/gpu_sd15.py --out "$OUT/gpu_sd15_levers.json" --methods lora --batches 8 --steps 10 --time-budget 150 \
  --levers eager,channels_last,compile,compile+channels_last 2>&1 | tee -a "$LOG" || status=$?
echo "== bench/gpu_large.py" | tee -a "$LOG"
python3 bench/gpu_large.py --out "$OUT/gpu_large.json" --time-budget 300 2>&1 | tee -a "$LOG" || status=$?
echo "== done (status $status) $(date -u)" | tee -a "$LOG"
exit $status
