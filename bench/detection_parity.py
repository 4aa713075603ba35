"""Accuracy parity of the detection family with torchvision's reference detection recipe (not a test).

    python bench/detection_parity.py --reference /tmp/tv_ref --seeds 0 1 2 --steps 304
    python bench/detection_parity.py --reference /tmp/tv_ref --seeds 0 --steps 8 --train-images 20  # a quick check
    python bench/detection_parity.py --reference /tmp/tv_ref --seeds 0 1 2 --steps 304 \\
        --imagetune-overrides train.max_grad_norm=1.0 train.weight_decay=0.01             # try a setting
    python bench/detection_parity.py --reference /tmp/tv_ref --seeds 0 1 2 --only imagetune --tag clip1 ...

Both tools train torchvision's `fasterrcnn_mobilenet_v3_large_fpn` from random initialisation (no weights, no
backbone weights: nothing is downloaded) on the same files: the detection demo's data (the product's generator,
`make_shapes_coco`, 320 training and 64 validation images of 128 px, 3 classes), written once into COCO-2017's
layout (`train2017/`, `val2017/`, `annotations/instances_{train,val}2017.json`), with the same batch, learning
rate, momentum, weight decay, warm-up, flip and number of optimizer steps, and report COCO mAP@[.5:.95] on the 64
validation images after every epoch of the reference and at the end. Per seed, the two runs go side by side
(one thread each by default: on a shared machine both get the same conditions); the table gives each seed's final
mAP and the mean ± sample standard deviation per tool, and the paired difference.

The reference. torchvision's `references/detection/` scripts (train.py, engine.py, presets.py, transforms.py,
coco_utils.py, coco_eval.py, group_by_aspect_ratio.py, utils.py) are not part of this repository and not
vendored: fetch them into a folder and pass it as `--reference`. The numbers in bench/README.md used pytorch/vision
commit acccf86477759b2d3500f1ae1be065f7b1e409ec (2025-11-11; those files last changed between 2023-08 and 2025-06):

    git clone https://github.com/pytorch/vision /tmp/vision
    git -C /tmp/vision checkout acccf86477759b2d3500f1ae1be065f7b1e409ec
    mkdir -p /tmp/tv_ref && cp /tmp/vision/references/detection/*.py /tmp/tv_ref/
    pip install pycocotools                   # the reference's COCO api and COCOeval

train.py runs unmodified, through a small launcher (`_REFERENCE_LAUNCHER`) that does two things only:
- seeds torch, numpy and random with the seed (train.py has no --seed; without it, "seeds" would be anonymous
  random draws);
- passes model-construction arguments through `torchvision.models.get_model`, exactly as train.py's own kwargs
  are passed: `min_size = max_size = --size` (the default 800 would upsample the 128 px images 6x and make a
  CPU run take hours; imagetune's `data.resolution` sets the same two values) and, unless
  `--reference-coco-classes`, `num_classes` = the dataset's classes + background (train.py hard-codes COCO's 91
  for `--dataset coco`; imagetune builds K + 1 = 4; see bench/README.md for what that changes).
Its flags: `--device cpu --model fasterrcnn_mobilenet_v3_large_fpn` with the default `--weights None
--weights-backbone None`, `-b BATCH --lr LR --momentum 0.9 --wd WD --epochs E -j 0 --data-augmentation hflip
--aspect-ratio-group-factor 3 --lr-steps` past the end (a constant rate after warm-up) and `--output-dir ""`
(no 150 MB checkpoint per epoch). Its warm-up is engine.py's: LinearLR from 0.001 x lr over
min(1000, iterations per epoch - 1) iterations of epoch 0. It drops training images without boxes
(coco_utils._coco_remove_images_without_annotations), so an epoch is (images with boxes) // batch iterations, and
`--steps` is rounded to whole epochs.

imagetune. `launch.py --preset detection-demo` with overrides that match the reference (printed by the script):
the same architecture, weights none, data.resolution = --size, flip, batch, SGD (momentum 0.9) at the same lr and
weight decay, warm-up = the reference's warm-up iterations, constant schedule, no gradient clipping, fp32,
devices=cpu:1, and an evaluation at every reference epoch boundary; `--imagetune-overrides` come last (to try a
setting or a fix). Its own choices that stay as they are: images without boxes train as background images, and
mAP is computed with torchmetrics' faster-coco-eval backend (the reference: pycocotools' COCOeval).

Output: per-seed rows (final mAP, mAP50, the last epoch's mean loss, wall time), mean ± std per tool, the mAP
after each epoch, imagetune's final weights scored again by the reference's own evaluation (its engine.evaluate:
batch 1, pycocotools' COCOeval; tells a training difference from a measuring one), and `--json` with all of it. Runs go under --work (default .cache/bench/parity, git-ignored);
imagetune's checkpoints and exported weights are deleted after reading unless --keep-runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = "fasterrcnn_mobilenet_v3_large_fpn"
REFERENCE_FILES = ("train.py", "engine.py", "presets.py", "transforms.py", "coco_utils.py", "coco_eval.py",
                   "group_by_aspect_ratio.py", "utils.py")

# Run as `python -c`: seed, then hand argv to the reference's train.py unchanged (see the module docstring).
_REFERENCE_LAUNCHER = r"""
import json, os, random, runpy, sys
settings = json.loads(sys.argv[1])
import numpy, torch, torchvision
torch.set_num_threads(settings["threads"])
random.seed(settings["seed"]); numpy.random.seed(settings["seed"]); torch.manual_seed(settings["seed"])
_get_model = torchvision.models.get_model
def get_model(name, **kwargs):
    kwargs.update(settings["model_kwargs"])
    print("parity launcher: get_model", name, {k: v for k, v in kwargs.items()}, flush=True)
    return _get_model(name, **kwargs)
torchvision.models.get_model = get_model
sys.path.insert(0, settings["reference"])
os.chdir(settings["reference"])
sys.argv = [os.path.join(settings["reference"], "train.py")] + settings["argv"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# imagetune's final weights scored by the reference's own evaluation (engine.evaluate: its val dataset, batch 1,
# pycocotools' COCOeval), so that a difference in mAP can be told apart from a difference in how it is measured.
_CROSS_EVAL = r"""
import json, sys
settings = json.loads(sys.argv[1])
import torch
torch.set_num_threads(settings["threads"])
sys.path.insert(0, settings["repo"]); sys.path.insert(0, settings["reference"])
import presets, utils
from coco_utils import get_coco
from engine import evaluate
from trainer.detect import load_detector
model = load_detector(settings["weights"]).model
dataset = get_coco(settings["data"], "val", presets.DetectionPresetEval(backend="pil", use_v2=False))
loader = torch.utils.data.DataLoader(dataset, batch_size=1, sampler=torch.utils.data.SequentialSampler(dataset),
                                     num_workers=0, collate_fn=utils.collate_fn)
stats = evaluate(model, loader, device=torch.device("cpu")).coco_eval["bbox"].stats
print("parity cross-eval:", json.dumps({"map": float(stats[0]), "map50": float(stats[1])}))
"""

_AP_LINE = re.compile(r"Average Precision\s+\(AP\) @\[ IoU=(0\.50:0\.95|0\.50)\s*\| area=\s*all \| maxDets=100 \] = "
                      r"(-?[0-9.]+)")
_EPOCH_LOSS = re.compile(r"Epoch: \[(\d+)\]\s+\[\s*(\d+)/(\d+)\].*?\bloss: ([0-9.]+) \(([0-9.]+)\)")


# ----------------------------------------------------------------------------------------------------------------
# Data


def prepare_data(work: Path, train_images: int | None = None) -> dict:
    """The demo dataset (the product's generator, seed 0) in COCO-2017's layout, optionally only its first
    `train_images` training images (a quick check); returns paths and counts."""
    from trainer.families.detection.demo import make_shapes_coco

    demo = work / "shapes-coco"
    if not (demo / "val.json").is_file():
        make_shapes_coco(demo)
    coco = work / ("coco" if train_images is None else f"coco-{train_images}")
    (coco / "annotations").mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in ("train", "val"):
        folder = coco / f"{split}2017"
        folder.mkdir(exist_ok=True)
        link = folder / "images"  # the JSON's file_names are images/NAME.png
        if not link.exists():
            link.symlink_to(demo / "images", target_is_directory=True)
        data = json.loads((demo / f"{split}.json").read_text())
        if split == "train" and train_images is not None:
            data["images"] = data["images"][:train_images]
            kept = {im["id"] for im in data["images"]}
            data["annotations"] = [ann for ann in data["annotations"] if ann["image_id"] in kept]
        for ann in data["annotations"]:
            # The reference's V1 pipeline (coco_utils.ConvertCocoPolysToMask) reads every annotation's polygon
            # even for Faster R-CNN, which ignores masks: give each box as its rectangle. imagetune ignores it.
            x, y, w, h = ann["bbox"]
            ann["segmentation"] = [[x, y, x + w, y, x + w, y + h, x, y + h]]
        (coco / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(data))
        with_boxes = {ann["image_id"] for ann in data["annotations"]}
        counts[split] = {"images": len(data["images"]), "with_boxes": len(with_boxes),
                         "boxes": len(data["annotations"])}
    return {"root": coco, "counts": counts, "classes": len(data["categories"])}


# ----------------------------------------------------------------------------------------------------------------
# The two runs


def reference_command(args, data: dict, seed: int, epochs: int) -> list[str]:
    model_kwargs: dict = {"min_size": args.size, "max_size": args.size}
    if not args.reference_coco_classes:
        model_kwargs["num_classes"] = data["classes"] + 1
    argv = ["--data-path", str(data["root"]), "--dataset", "coco", "--model", MODEL, "--device", "cpu",
            "-b", str(args.batch), "--epochs", str(epochs), "-j", "0", "--lr", str(args.lr), "--momentum", "0.9",
            "--wd", str(args.weight_decay), "--lr-steps", str(epochs + 100), "--aspect-ratio-group-factor", "3",
            "--data-augmentation", "hflip", "--output-dir", "", "--print-freq", "10"]
    settings = {"seed": seed, "threads": args.threads, "reference": str(Path(args.reference).resolve()),
                "model_kwargs": model_kwargs, "argv": argv}
    return [sys.executable, "-c", _REFERENCE_LAUNCHER, json.dumps(settings)]


def imagetune_overrides(args, data: dict, seed: int, steps: int, per_epoch: int, tag: str) -> list[str]:
    root = data["root"]
    return [
        f"name=parity-{tag}-s{seed}", f"seed={seed}", "devices=cpu:1", "precision=fp32",
        f"model.path={MODEL}", "detection.weights=none",
        f"data.path={root / 'annotations' / 'instances_train2017.json'}",
        f"detection.val_path={root / 'annotations' / 'instances_val2017.json'}",
        f"data.resolution={args.size}", "data.flip=true", "data.workers=0",
        f"batch.total={args.batch}", f"batch.per_device={args.batch}",
        f"train.steps={steps}", f"train.lr={args.lr}", "train.optimizer=sgd", f"train.weight_decay={args.weight_decay}",
        "train.scheduler=constant", f"train.warmup_steps={per_epoch - 1}", "train.max_grad_norm=0",
        f"eval.every={per_epoch}", "sample.every=0", "detection.sample_images=0", "checkpoint.every=0",
        *args.imagetune_overrides,
    ]


def run_reference(args, data: dict, seed: int, epochs: int, logs: Path) -> dict:
    log = logs / f"reference-s{seed}.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "CUDA_VISIBLE_DEVICES": ""}
    began = time.time()
    with open(log, "w") as out:
        rc = subprocess.call(reference_command(args, data, seed, epochs), stdout=out, stderr=subprocess.STDOUT,
                             env=env, cwd=str(REPO))
    text = log.read_text(errors="replace")
    maps = [float(v) for k, v in _AP_LINE.findall(text) if k == "0.50:0.95"]
    map50s = [float(v) for k, v in _AP_LINE.findall(text) if k == "0.50"]
    epoch_loss: dict[int, float] = {}
    for epoch, _i, _n, _median, avg in _EPOCH_LOSS.findall(text):
        epoch_loss[int(epoch)] = float(avg)  # the last line of an epoch holds its mean
    return {"rc": rc, "log": str(log), "wall_s": round(time.time() - began, 1), "map_per_epoch": maps,
            "map": maps[-1] if maps else None, "map50": map50s[-1] if map50s else None,
            "last_epoch_loss": epoch_loss.get(max(epoch_loss)) if epoch_loss else None}


def run_imagetune(args, data: dict, seed: int, steps: int, per_epoch: int, logs: Path) -> dict:
    log = logs / f"imagetune-{args.tag}-s{seed}.log"
    overrides = imagetune_overrides(args, data, seed, steps, per_epoch, args.tag)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    began = time.time()
    with open(log, "w") as out:
        rc = subprocess.call([sys.executable, "launch.py", "--preset", "detection-demo", "--runs-dir",
                              str(Path(args.work) / "runs"), *overrides], stdout=out, stderr=subprocess.STDOUT,
                             env=env, cwd=str(REPO))
    text = log.read_text(errors="replace")
    found = re.search(r"run folder: (\S+)", text)
    row = {"rc": rc, "log": str(log), "wall_s": round(time.time() - began, 1), "overrides": overrides,
           "map_per_epoch": [], "map": None, "map50": None, "last_epoch_loss": None}
    if not found:
        return row
    run_dir = Path(found.group(1))
    row["run_dir"] = str(run_dir)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    evals = [e for e in events if e.get("event", e.get("type")) == "eval" and e.get("map") is not None]
    losses = [e["loss"] for e in events if e.get("event", e.get("type")) == "progress" and e.get("loss") is not None]
    row["map_per_epoch"] = [e["map"] for e in evals]
    if evals:
        row["map"], row["map50"] = evals[-1]["map"], evals[-1].get("map50")
    if losses:
        row["last_epoch_loss"] = round(statistics.mean(losses[-per_epoch:]), 4)
    weights = run_dir / "output" / "model.safetensors"
    if (Path(args.reference) / "engine.py").is_file() and weights.is_file():
        settings = {"threads": args.threads, "repo": str(REPO), "reference": str(Path(args.reference).resolve()),
                    "weights": str(weights), "data": str(data["root"])}
        cross = subprocess.run([sys.executable, "-c", _CROSS_EVAL, json.dumps(settings)], check=False,
                               capture_output=True, text=True, env=env, cwd=str(REPO))
        (logs / f"imagetune-{args.tag}-s{seed}-cross-eval.log").write_text(cross.stdout + cross.stderr)
        scored = re.search(r"parity cross-eval: (.*)", cross.stdout)
        if scored:
            scores = json.loads(scored.group(1))
            row["map_by_reference_eval"], row["map50_by_reference_eval"] = scores["map"], scores["map50"]
    if not args.keep_runs:
        for heavy in ("checkpoints", "output"):
            shutil.rmtree(run_dir / heavy, ignore_errors=True)
    return row


# ----------------------------------------------------------------------------------------------------------------
# Report


def _mean_std(values: list) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _fmt(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def report(rows: list[dict], tools: list[str]) -> dict:
    print("\n| seed | " + " | ".join(f"{t} mAP | {t} mAP50 | {t} loss (last epoch) | {t} wall s" for t in tools)
          + (" | mAP difference (imagetune - reference) |" if len(tools) == 2 else " |"))
    print("| --- " * (1 + 4 * len(tools) + (len(tools) == 2)) + "|")
    for row in rows:
        cells = []
        for t in tools:
            r = row[t]
            cells += [_fmt(r["map"]), _fmt(r["map50"]), _fmt(r["last_epoch_loss"]), f"{r['wall_s']:.0f}"]
        diff = ""
        if len(tools) == 2 and row["reference"]["map"] is not None and row["imagetune"]["map"] is not None:
            diff = f" | {row['imagetune']['map'] - row['reference']['map']:+.3f}"
        print(f"| {row['seed']} | " + " | ".join(cells) + diff + " |")
    summary = {}
    for t in tools:
        m, s = _mean_std([row[t]["map"] for row in rows])
        m50, s50 = _mean_std([row[t]["map50"] for row in rows])
        summary[t] = {"map_mean": m, "map_std": s, "map50_mean": m50, "map50_std": s50}
        print(f"{t}: mAP {_fmt(m)} ± {_fmt(s)}, mAP50 {_fmt(m50)} ± {_fmt(s50)} over {len(rows)} seeds")
    if len(tools) == 2:
        diffs = [row["imagetune"]["map"] - row["reference"]["map"] for row in rows
                 if row["imagetune"]["map"] is not None and row["reference"]["map"] is not None]
        m, s = _mean_std(diffs)
        summary["difference"] = {"map_mean": m, "map_std": s, "pairs": len(diffs)}
        if m is not None:
            se = (s / len(diffs) ** 0.5) if len(diffs) > 1 else None
            print(f"paired difference imagetune - reference: {m:+.4f} ± {_fmt(s, 4)} (sd), standard error "
                  f"{_fmt(se, 4)}, {len(diffs)} pairs")
    if "imagetune" in tools:
        print("\nimagetune's final weights scored by the reference's evaluation (pycocotools) / by imagetune's:")
        for row in rows:
            r = row["imagetune"]
            print(f"  seed {row['seed']}: mAP {_fmt(r.get('map_by_reference_eval'))} / {_fmt(r['map'])}, "
                  f"mAP50 {_fmt(r.get('map50_by_reference_eval'))} / {_fmt(r['map50'])}")
    print("\nmAP after each reference epoch:")
    for row in rows:
        for t in tools:
            print(f"  seed {row['seed']} {t}: {', '.join(_fmt(v) for v in row[t]['map_per_epoch'])}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="folder with torchvision's references/detection/*.py")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=304, help="optimizer steps (rounded to whole reference epochs)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--weight-decay", type=float, default=1e-4, help="torchvision's default")
    parser.add_argument("--size", type=int, default=128, help="the model's min_size = max_size (both tools)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (a seed's two runs go together)")
    parser.add_argument("--only", choices=("reference", "imagetune"), help="run one tool only")
    parser.add_argument("--tag", default="matched", help="names imagetune's runs (and logs) of this invocation")
    parser.add_argument("--reference-coco-classes", action="store_true",
                        help="leave train.py's 91 COCO classes (default: the dataset's 3 + background, as imagetune)")
    parser.add_argument("--imagetune-overrides", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--train-images", type=int, help="only the first N training images (a quick check)")
    parser.add_argument("--work", default=str(REPO / ".cache" / "bench" / "parity"))
    parser.add_argument("--keep-runs", action="store_true", help="keep imagetune's checkpoints and weights")
    parser.add_argument("--json", help="write settings, every run and the summary here")
    args = parser.parse_args()

    reference = Path(args.reference)
    missing = [f for f in REFERENCE_FILES if not (reference / f).is_file()]
    if args.only != "imagetune" and missing:
        sys.exit(f"--reference {reference}: missing {', '.join(missing)} (see this script's docstring)")
    work = Path(args.work)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    data = prepare_data(work, args.train_images)
    per_epoch = data["counts"]["train"]["with_boxes"] // args.batch  # GroupedBatchSampler's length
    epochs = max(1, round(args.steps / per_epoch))
    steps = epochs * per_epoch
    tools = [args.only] if args.only else ["reference", "imagetune"]
    print(f"data: {data['counts']}; reference epoch = {per_epoch} iterations (images with boxes // batch); "
          f"{epochs} epochs = {steps} steps; warm-up {per_epoch - 1} steps", flush=True)
    print("imagetune overrides:", " ".join(imagetune_overrides(args, data, args.seeds[0], steps, per_epoch,
                                                                args.tag)), flush=True)

    jobs = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for seed in args.seeds:
            for tool in tools:
                if tool == "reference":
                    jobs.append((seed, tool, pool.submit(run_reference, args, data, seed, epochs, logs)))
                else:
                    jobs.append((seed, tool, pool.submit(run_imagetune, args, data, seed, steps, per_epoch, logs)))
        rows: dict[int, dict] = {}
        for seed, tool, future in jobs:
            result = future.result()
            print(f"seed {seed} {tool}: mAP {result['map']} mAP50 {result['map50']} (rc {result['rc']}, "
                  f"{result['wall_s']:.0f} s, {result['log']})", flush=True)
            rows.setdefault(seed, {"seed": seed})[tool] = result
    ordered = [rows[s] for s in args.seeds]
    summary = report(ordered, tools)
    if args.json:
        out = {"settings": {**vars(args), "steps": steps, "epochs": epochs, "iterations_per_epoch": per_epoch,
                            "data": {"counts": data["counts"], "classes": data["classes"]}},
               "runs": ordered, "summary": summary}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
