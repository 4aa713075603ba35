"""How the detectors compare on the offline demo data for the same training time (not a test).

    python bench/detectors_equal_time.py                       # 90 CPU-seconds of training each, then mAP
    python bench/detectors_equal_time.py --seconds 300 --detectors rtdetr dfine

Each detector trains from random initialisation (nothing is downloaded) on demo://shapes-coco (320 training
images of 128 px, 3 classes) with its preset's settings (lr, optimizer, clipping, batch, augmentation), in this
process with one thread, for the same budget of the process's CPU time: on an idle core that is the wall time,
and on a shared machine it is the share of the wall time that this process actually ran (what a wall-clock budget
would hand out unevenly). The learning rate follows a cosine over the budget (after the preset's warm-up
steps), so every detector ends its schedule. Then the family's own evaluation (COCO mAP, all 64 validation
images) scores it. Training is the family's loss and the engine's optimizer; the engine's loop, checkpoints and
samples are left out, as they cost every detector the same.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import trainer.families  # noqa: E402,F401  (fills the family registry, trainer.core.registry)

# name -> (preset, overrides): Faster R-CNN is the demo preset with torchvision's smallest Faster R-CNN
DETECTORS = {
    "fcos_tiny": ("detection-demo.yaml", []),
    "fasterrcnn": ("detection-demo.yaml", ["model.path=fasterrcnn_mobilenet_v3_large_fpn"]),
    "rtdetr": ("detection-rtdetr-demo.yaml", []),
    "dfine": ("detection-dfine-demo.yaml", []),
}


def family_for(preset: str, overrides: list[str], data: Path, work: Path):
    import torch

    from trainer.core.config import load_config
    from trainer.core.hardware import CPU_ONLY
    from trainer.core.plan import make_plan
    from trainer.families.detection.family import DetectionFamily
    from trainer.families.protocol import WorkerContext

    config = load_config(REPO / "presets" / preset, [*overrides, f"data.path={data}", "devices=cpu:1",
                                                     "precision=fp32", "detection.sample_images=0"])
    ctx = WorkerContext(config=config, plan=make_plan(config, CPU_ONLY), run_dir=work, cache_dir=work / ".cache",
                        device=torch.device("cpu"), rank=0, world_size=1, accelerator=None, log_warning=print)
    family = DetectionFamily(ctx)
    family.load()
    items = family.prepare_data()
    family.set_prepared([family.model])
    return family, items


def train_for(family, items: int, seconds: float) -> dict:
    import torch

    from trainer.core.data.stream import BatchStream
    from trainer.engine.optim import build_optimizer

    cfg = family.cfg
    stream = BatchStream(items, total=cfg.batch.total, per_device=cfg.batch.total, world_size=1, seed=cfg.seed)
    optimizer = build_optimizer(family.param_groups(), cfg.train)
    base = [group["lr"] for group in optimizer.param_groups]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    start_cpu, start_wall, step, losses = time.process_time(), time.time(), 0, []
    while (used := time.process_time() - start_cpu) < seconds:
        warm = min(1.0, (step + 1) / max(1, cfg.train.warmup_steps))
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * used / seconds))
        samples = [(pos, *stream.item(pos)) for pos in stream.positions(step, 0, 0)]
        loss = family.loss(samples)
        loss.backward()
        if cfg.train.clip_norm():
            torch.nn.utils.clip_grad_norm_(params, cfg.train.clip_norm())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
    return {"steps": step, "cpu_s": round(time.process_time() - start_cpu, 1),
            "wall_s": round(time.time() - start_wall, 1), "first_loss": round(statistics.mean(losses[:10]), 3),
            "last_loss": round(statistics.mean(losses[-10:]), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=90, help="CPU seconds of training per detector")
    parser.add_argument("--detectors", nargs="+", default=list(DETECTORS), choices=list(DETECTORS))
    parser.add_argument("--work", default=str(REPO / ".cache" / "bench" / "detectors"))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    import torch

    from trainer.families.detection.demo import ensure_detection_demo

    torch.set_num_threads(1)
    work = Path(args.work)
    data = ensure_detection_demo(work)["shapes-coco"]
    rows = []
    for name in args.detectors:
        preset, overrides = DETECTORS[name]
        torch.manual_seed(0)
        family, items = family_for(preset, overrides, data, work / name)
        row = {"detector": name, "architecture": family.cfg.model.path,
               "parameters_m": round(sum(p.numel() for p in family.model.parameters()) / 1e6, 2),
               **train_for(family, items, args.seconds)}
        metrics = family.evaluate(row["steps"])
        row.update(map=metrics["map"], map50=metrics["map50"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| detector | parameters | steps in {args.seconds:g} CPU-s | wall s | loss first -> last 10 | mAP | mAP50 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['architecture']} | {r['parameters_m']}M | {r['steps']} | {r['wall_s']} | "
              f"{r['first_loss']} -> {r['last_loss']} | {r['map']} | {r['map50']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
