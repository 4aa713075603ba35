"""The offline detection demo's dataset: procedurally drawn shapes in COCO format (torch-free).

`demo://shapes-coco` resolves to a folder holding `train.json`, `val.json` and `images/`: 320 training and 64
validation images of 128x128 pixels, three classes (circle, square, triangle) in random colours on noisy
backgrounds, 0-4 objects per image (a few images are empty, as real datasets have). Everything is a pure
function of the seed, so every machine builds the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from trainer.families.components.tiny_assets import ensure_asset

ASSET = "shapes-coco"
CLASSES = ("circle", "square", "triangle")
SIZE = 128
MARKER = "val.json"


def _random_color(rng: np.random.Generator, base) -> tuple:
    """A colour far enough from the background to be seen."""
    return tuple(int(c) for c in (base + rng.choice([-1, 1], size=3) * rng.integers(70, 140, size=3)) % 256)


def _class_color(rng: np.random.Generator, cls: int, base) -> tuple:
    """Circles reddish, squares greenish, triangles bluish (each with its own jitter): colour helps, shape decides
    between close hues."""
    color = rng.integers(0, 90, size=3)
    color[cls] = rng.integers(170, 256)
    return tuple(int(c) for c in color)


def _draw_image(rng: np.random.Generator, size: int, class_colors: bool = True):
    """One image and its annotations [(class index, [x, y, w, h])]."""
    base = rng.integers(40, 216, size=3)
    noise = rng.normal(0, 12, size=(size, size, 3))
    pixels = np.clip(base[None, None, :] + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(image)
    count = int(rng.choice([0, 1, 2, 3, 4], p=[0.05, 0.3, 0.3, 0.2, 0.15]))
    placed: list[tuple[float, float, float, float]] = []
    annotations = []
    for _ in range(count):
        for _attempt in range(20):
            side = float(rng.uniform(18, 48))
            x, y = float(rng.uniform(0, size - side)), float(rng.uniform(0, size - side))
            box = (x, y, x + side, y + side)
            if all(_iou(box, other) < 0.1 for other in placed):
                break
        else:
            continue
        placed.append(box)
        cls = int(rng.integers(len(CLASSES)))
        color = _class_color(rng, cls, base) if class_colors else _random_color(rng, base)
        if cls == 0:
            draw.ellipse(box, fill=color)
        elif cls == 1:
            draw.rectangle(box, fill=color)
        else:
            draw.polygon([(x + side / 2, y), (x + side, y + side), (x, y + side)], fill=color)
        annotations.append((cls, [round(x, 2), round(y, 2), round(side, 2), round(side, 2)]))
    return image, annotations


def _iou(a, b) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def make_shapes_coco(folder, *, train: int = 320, val: int = 64, size: int = SIZE, seed: int = 0,
                     class_colors: bool = True) -> Path:
    """Write the shapes dataset into `folder` (created): images/, train.json, val.json."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    categories = [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(CLASSES)]
    rng = np.random.default_rng([seed, 0xC0C0])
    ann_id = 1
    for split, count in (("train", train), ("val", val)):
        images: list[dict] = []
        annotations: list[dict] = []
        for i in range(count):
            image, objects = _draw_image(rng, size, class_colors)
            name = f"{split}_{i:04d}.png"
            image.save(folder / "images" / name)
            image_id = len(images) + 1
            images.append({"id": image_id, "file_name": f"images/{name}", "width": size, "height": size})
            for cls, bbox in objects:
                annotations.append({"id": ann_id, "image_id": image_id, "category_id": cls + 1, "bbox": bbox,
                                    "area": round(bbox[2] * bbox[3], 2), "iscrowd": 0})
                ann_id += 1
        data = {"info": {"description": f"imagetune shapes demo ({split})"}, "images": images,
                "annotations": annotations, "categories": categories}
        (folder / f"{split}.json").write_text(json.dumps(data))
    return folder


def ensure_detection_demo(root) -> dict[str, Path]:
    """Create `root/shapes-coco` once (atomically: built in a temp folder, then renamed); return its path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = ensure_asset(root / ASSET, make_shapes_coco, MARKER)
    return {ASSET: target}


if __name__ == "__main__":  # python -m trainer.families.detection.demo OUT_DIR
    import sys

    print(ensure_detection_demo(sys.argv[1] if len(sys.argv) > 1 else "runs/.demo"))
