#!/usr/bin/env python
"""What quantized base weights (fp8, int8, nf4) do to a LoRA's training loss, against bf16, on the tiny offline
models (CPU):

    python bench/fp8_loss.py [--models sd flux sdxl] [--storages bf16 int8 nf4] [--steps 40] [--json FILE]

`sd` is the demo's pretrained tiny SD (`demo://tiny-sd`) learning the demo's concept (`demo://sks-circle`, the
yellow circles), the only one of the three whose loss means something; `flux` and `sdxl` are the tests' random
tiny models on generated circles and squares. Each model trains one LoRA per storage of its frozen network,
from the same initial adapter on the same batches with the same noise (the engine's draws are a function of the
step), under bf16 autocast as a bf16 run does: `bf16` (model.base_weights=bf16), `fp8 storage`
(base_weights=fp8, fp8_compute=off: diffusers' layerwise casting, each layer upcast to bf16), `fp8 compute`
(fp8_compute=on: e4m3 weights and activations multiplied by torch._scaled_mm,
trainer.families.components.fp8_linear), `int8` (base_weights=int8: torchao's weight-only int8, a scale per
output row) and `nf4` (base_weights=nf4: torchao's 4-bit NormalFloat, QLoRA's format). Also `fp32`
(precision=fp32), to show how far bf16 itself is from full precision. Reported per storage: the mean and largest
relative difference of the per-step loss from bf16's, and of the trained LoRA weights (relative Frobenius norm of
the difference) from bf16's. The families are built as the engine builds them (`family.load()` from a
WorkerContext, the real loss); only the loop is this file's (AdamW lr 2e-3 for sd as in the demo, 1e-3 for the
others, no clipping, batch 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import trainer.families  # noqa: E402,F401  (fills the family registry, trainer.core.registry)

STORAGES = {  # name: overrides
    "fp32": ["precision=fp32"],
    "bf16": ["precision=bf16"],
    "fp8 storage": ["precision=bf16", "model.base_weights=fp8", "model.fp8_compute=off"],
    "fp8 compute": ["precision=bf16", "model.base_weights=fp8", "model.fp8_compute=on"],
    "int8": ["precision=bf16", "model.base_weights=int8"],
    "nf4": ["precision=bf16", "model.base_weights=nf4"],
}
EXTRA = {"sd": [], "sdxl": [], "flux": ["flow.max_sequence_length=16"]}


def _data(folder: Path) -> Path:
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    colours = {"red": (200, 40, 40), "blue": (40, 40, 200), "green": (40, 170, 40)}
    for n, (name, rgb) in enumerate(colours.items()):
        for shape in ("circle", "square"):
            img = Image.new("RGB", (64, 64), (235, 235, 235))
            draw = ImageDraw.Draw(img)
            (draw.ellipse if shape == "circle" else draw.rectangle)((12, 12, 52, 52), fill=rgb)
            img.save(folder / f"{name}-{shape}.png")
            (folder / f"{name}-{shape}.txt").write_text(f"a {name} {shape}")
    return folder


def train(name: str, model: Path, data: Path, work: Path, overrides: list[str], steps: int):
    import torch

    from trainer.core.config import load_config
    from trainer.core.data.stream import make_stream
    from trainer.core.hardware import CPU_ONLY
    from trainer.core.plan import make_plan
    from trainer.engine.precision import Amp
    from trainer.families import get_family
    from trainer.families.protocol import WorkerContext

    class _Accelerator:
        def wait_for_everyone(self):
            pass

        def unwrap_model(self, module):
            return module

    config = load_config(None, [f"model.path={model}", f"model.family={name}", f"data.path={data}",
                                "devices=cpu:1", "batch.total=2", "batch.per_device=2", "data.resolution=64",
                                "data.flip=false", "lora.rank=8", "lora.alpha=8", "train.gradient_checkpointing=true",
                                *EXTRA[name], *overrides], check_paths=False)
    plan = make_plan(config, CPU_ONLY)
    ctx = WorkerContext(config, plan, work / "run", work / "cache", torch.device("cpu"), 0, 1, _Accelerator(),
                        lambda message: None)
    family = get_family(name)(ctx)
    family.load()
    items = family.prepare_data()
    family.set_prepared(family.trainable_modules())
    stream = make_stream(items, item_buckets=None, total=2, per_device=2, world_size=1, seed=config.seed)
    params = [p for g in family.param_groups() for p in g["params"]]
    optimizer = torch.optim.AdamW(params, lr=2e-3 if name == "sd" else 1e-3, weight_decay=0)
    amp = Amp(plan.precision, "cpu")
    losses, start = [], time.perf_counter()
    for step in range(steps):
        batch = [(p, *stream.item(p)) for p in stream.positions(step, 0, 0)]
        with amp.autocast():
            loss = family.loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    named = {n: p.detach().float().clone() for m in family.trainable_modules() for n, p in m.named_parameters()
             if p.requires_grad}
    return losses, named, time.perf_counter() - start


def compare(runs: dict) -> dict:
    ref_losses, ref_weights = runs["bf16"][0], runs["bf16"][1]
    out = {}
    for storage, (losses, weights, seconds) in runs.items():
        rel = [abs(a - b) / b for a, b in zip(losses, ref_losses)]
        diff = sum(float((weights[n] - ref_weights[n]).norm() ** 2) for n in ref_weights) ** 0.5
        norm = sum(float(ref_weights[n].norm() ** 2) for n in ref_weights) ** 0.5
        out[storage] = {"loss_rel_mean": sum(rel) / len(rel), "loss_rel_max": max(rel),
                        "lora_rel_diff": diff / norm, "first_loss": losses[0],
                        "last5_loss": sum(losses[-5:]) / len(losses[-5:]),
                        "seconds": round(seconds, 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["sd", "flux", "sdxl"], choices=["sd", "flux", "sdxl"])
    parser.add_argument("--storages", nargs="+", default=list(STORAGES), choices=list(STORAGES),
                        help="bf16, the reference, is always run")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    from trainer.families.flow.demo import make_tiny_flux
    from trainer.families.sdxl.demo import make_tiny_sdxl

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build: dict[str, Callable[[Path], Path]] = {"flux": make_tiny_flux, "sdxl": make_tiny_sdxl}
        for name in args.models:
            if name == "sd":
                from trainer.families.sd.demo import ensure_concept_data, shipped_tiny_sd

                model, data = shipped_tiny_sd()["tiny-sd"], ensure_concept_data(work)["sks-circle"]
            else:
                model, data = build[name](work / f"tiny-{name}"), _data(work / "data")
            runs = {s: train(name, model, data, work / f"{name}-{i}", o, args.steps)
                    for i, (s, o) in enumerate(STORAGES.items()) if s in args.storages or s == "bf16"}
            results[name] = compare(runs)
            print(f"\n== tiny {name}, {args.steps} steps: relative difference from bf16")
            print(f"{'storage':<12} {'loss mean':>10} {'loss max':>9} {'LoRA':>8} {'loss 0':>8} {'last 5':>8} {'s':>6}")
            for storage, r in results[name].items():
                print(f"{storage:<12} {r['loss_rel_mean']:>10.4f} {r['loss_rel_max']:>9.4f} {r['lora_rel_diff']:>8.4f}"
                      f" {r['first_loss']:>8.4f} {r['last5_loss']:>8.4f} {r['seconds']:>6}")
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "results": results}, indent=2))


if __name__ == "__main__":
    main()
