#!/usr/bin/env bash
# The engine end to end on one CUDA GPU (bf16 plan): the offline demo through launch.py (its input workers pin
# memory there), then with each GPU lever once (fp8 compute, train.compile, batch.per_device auto), a tiny FLUX
# full fine-tune through the launcher, and the GPU-only tests (one host sync per step). For a device machine
# without omegaconf/diffusers: wheels in .whl/.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/bench-out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
status=0
python3 launch.py --preset presets/demo.yaml --runs-dir /tmp/runs train.steps=100 sample.every=50 2>&1 | tail -25 || status=$?
for lever in "model.base_weights=fp8 model.fp8_compute=on name=demo-fp8" "train.compile=true name=demo-compile" \
             "batch.per_device=auto name=demo-auto-batch"; do
  # shellcheck disable=SC2086  # each lever is several KEY=VALUE words
  python3 launch.py --preset presets/demo.yaml --runs-dir /tmp/runs train.steps=30 sample.every=0 $lever 2>&1 | tail -4 || status=$?
done
python3 -m pytest -q -p no:cacheprovider -n0 tests/test_gpu_syncs.py 2>&1 | tail -15 || status=$?
python3 -c "from trainer.families.flow.demo import make_tiny_flux; from trainer.families.sd.demo import make_demo_dataset; make_tiny_flux('/tmp/a/flux'); make_demo_dataset('/tmp/a/data', count=8)" || status=$?
python3 launch.py --preset presets/flux-dev-lora-24gb.yaml --runs-dir /tmp/runs model.path=/tmp/a/flux data.path=/tmp/a/data \
  method=full name=flux-full data.resolution=64 sample.size=64 sample.steps=4 train.steps=30 sample.every=15 \
  flow.max_sequence_length=16 checkpoint.every=0 2>&1 | tail -6 || status=$?
# Detection on the GPU: Faster R-CNN v2 at 800 px (the fasterrcnn-coco preset, random init) on generated 800 px
# PNGs, to read how much of each step waits on data (issue 15: the GPU busy >= 90% of the step).
python3 -c "from trainer.families.detection.demo import make_shapes_coco; make_shapes_coco('/tmp/a/det800', train=256, val=16, size=800)" || status=$?
python3 launch.py --preset presets/detection-fasterrcnn-coco.yaml --runs-dir /tmp/runs data.path=/tmp/a/det800/train.json \
  detection.val_path=/tmp/a/det800/val.json detection.weights=none name=det-800 train.steps=60 train.warmup_steps=5 \
  eval.every=0 sample.every=0 checkpoint.every=0 2>&1 | tail -4 || status=$?
python3 - <<'PY' || status=$?
import json, pathlib
for run in sorted(pathlib.Path("/tmp/runs").iterdir()):
    events = [json.loads(l) for l in (run / "events.jsonl").read_text().splitlines()]
    plan = events[0]; prog = [e for e in events if e["type"] == "progress"]
    waits = [e["data_s"] / e["ranks"][0]["step_s"] for e in prog if e.get("data_s") is not None and e.get("ranks")]
    print(run.name, "|", plan["line"], "| final:", events[-1]["type"], "| loss first/last:",
          prog[0]["loss"], prog[-1]["loss"], "| samples/s last:", prog[-1].get("samples_per_s"),
          "| data wait share of the step, median:", sorted(waits)[len(waits) // 2] if waits else None)
PY
cp -r /tmp/runs/demo/samples "$OUT/demo-samples" 2>/dev/null
exit $status
