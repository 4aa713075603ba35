"""The offline paired (instruction-edit) demo: `demo://demo-edit` (the edits' results, captioned with the
instruction) and `demo://demo-edit-control` (their sources, same file names), and a score of whether a sample
performs the edit.

The task: a coloured shape on a light background (the control) becomes the same shape, at the same place, on a
black background (the target), captioned "make the background black". One global change that keeps the shape, so a
tiny model learns it in a CPU minute and a sample shows whether it did.

The score is measured on latents: the tiny demo models' VAEs are random (their decoded pixels are coloured noise),
but what a model learns is the map from the control's latent to the target's. `edit_score` places a sample's
latent between them: 1 where it is the target's, -1 where it is the control's, 0 as far from both (an untrained
model's draw).
"""

from __future__ import annotations

import random
from pathlib import Path

from trainer.families.components.tiny_assets import ensure_asset

TARGET_DIR, CONTROL_DIR = "demo-edit", "demo-edit-control"
MARKER = "0000.png"
INSTRUCTION = "make the background black"
_SHAPES = (((215, 45, 45), "circle"), ((45, 85, 215), "square"), ((40, 165, 65), "triangle"))
_LIGHT = ((245, 245, 245), (230, 214, 178), (200, 225, 245))  # white, beige, pale blue
_TARGET_BACKGROUND = (10, 10, 10)
_SUPERSAMPLE = 4


def make_edit_pairs(folder, *, side: str, count: int = 8, size: int = 64, seed: int = 0) -> Path:
    """Write `count` PNGs of one side of the pairs (`side`: "target" with `.txt` captions, or "control") to
    `folder`. The same seed gives the same shapes on both sides, so the two folders pair by file name."""
    from PIL import Image, ImageDraw

    if side not in ("target", "control"):
        raise ValueError(f"side must be 'target' or 'control', not {side!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    big = size * _SUPERSAMPLE
    for i in range(count):
        rgb, shape = _SHAPES[i % len(_SHAPES)]
        light = rng.choice(_LIGHT)
        extent = rng.uniform(0.35, 0.6) * big
        x0, y0 = rng.uniform(0.05 * big, 0.95 * big - extent), rng.uniform(0.05 * big, 0.95 * big - extent)
        image = Image.new("RGB", (big, big), light if side == "control" else _TARGET_BACKGROUND)
        draw = ImageDraw.Draw(image)
        box = (x0, y0, x0 + extent, y0 + extent)
        if shape == "circle":
            draw.ellipse(box, fill=rgb)
        elif shape == "square":
            draw.rectangle(box, fill=rgb)
        else:
            draw.polygon([(x0 + extent / 2, y0), (x0 + extent, y0 + extent), (x0, y0 + extent)], fill=rgb)
        image.resize((size, size), Image.Resampling.LANCZOS).save(folder / f"{i:04d}.png")
        if side == "target":  # the instruction is the target's caption, as in ai-toolkit's paired datasets
            (folder / f"{i:04d}.txt").write_text(INSTRUCTION + "\n")
    return folder


def ensure_demo_edit(root) -> dict[str, Path]:
    """`root/demo-edit` and `root/demo-edit-control`, each built once (tiny_assets.ensure_asset)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {TARGET_DIR: ensure_asset(root / TARGET_DIR, lambda f: make_edit_pairs(f, side="target"), MARKER),
            CONTROL_DIR: ensure_asset(root / CONTROL_DIR, lambda f: make_edit_pairs(f, side="control"), MARKER)}


def edit_score(sample, control, target) -> float:
    """Whether the sample latents lie nearer their targets' than their controls', averaged over the batch (tensors
    of one shape, batch first): (|sample - control|² - |sample - target|²) / |target - control|², so 1 is the
    target, -1 the control, and 0 anything as far from both (noise around zero, an untrained model's draw)."""
    s, c, t = (x.flatten(1).double() for x in (sample, control, target))
    gap = ((s - c) ** 2).sum(1) - ((s - t) ** 2).sum(1)
    return float((gap / ((t - c) ** 2).sum(1)).mean().item())
