"""The paths a detection dataset descriptor points to, for the exposed UI's workspace check (app.security reads
them through this family's spec: `dataset_paths`).

A detection dataset is named by a file that names other files: a YOLO data.yaml (`path`, `train`, `val`, `test`,
each a folder or a .txt list of image paths) or a COCO json (`images[].file_name`, under detection.images or a
folder next to the json). Checking data.path alone would let a descriptor inside the workspace train on (and
show samples of) any folder of the machine, so every place it points to is listed here, resolved the way
trainer.families.detection.data resolves it. Torch-free, read-only; unreadable descriptors list nothing (the trainer
reports them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import yaml

from trainer.errors import UserError
from trainer.families.detection.data import resolve_layout

MAX_LIST_LINES = 100_000  # a .txt image list longer than this is not read to the end here


def descriptor_paths(config) -> Iterator[tuple[str, str]]:
    """(config key, path) for every file or folder the dataset descriptors of `config` point to."""

    try:
        kind, descriptor, val = resolve_layout(config.data.path, config.detection.val_path or None)
    except (UserError, OSError, ValueError):
        return
    if kind == "yolo":
        yield from _yolo(descriptor)
    else:
        for json_path in filter(None, (descriptor, val)):
            yield from _coco(json_path, config.detection.images or None)


def _yolo(path: Path) -> Iterator[tuple[str, str]]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return
    if not isinstance(data, dict):
        return
    root = Path(str(data.get("path") or ".")).expanduser()
    root = root if root.is_absolute() else path.parent / root
    key = f"data.path ({path.name})"
    yield f"{key} path", str(root)
    for split in ("train", "val", "test"):
        entries = data.get(split)
        for item in entries if isinstance(entries, list) else [entries]:
            if item in (None, ""):
                continue
            target = Path(str(item)).expanduser()
            target = target if target.is_absolute() else root / target
            yield f"{key} {split}", str(target)
            if target.suffix.lower() == ".txt" and target.is_file():
                yield from _listed(target, f"{key} {split}")


def _listed(listing: Path, key: str) -> Iterator[tuple[str, str]]:
    try:
        with open(listing, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f):
                if n >= MAX_LIST_LINES:
                    return
                line = line.strip()
                if line:
                    p = Path(line).expanduser()
                    yield f"{key} ({listing.name})", str(p if p.is_absolute() else listing.parent / p)
    except OSError:
        return


def _coco(json_path: Path, images_dir: str | None) -> Iterator[tuple[str, str]]:
    from trainer.families.detection.coco import coco_images_dir

    try:
        data = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    images = data.get("images") if isinstance(data, dict) else None
    if not isinstance(images, list):
        return
    names = [name for im in images if isinstance(im, dict) and isinstance(name := im.get("file_name"), str)]
    root = coco_images_dir(json_path, names[0] if names else None, images_dir)
    key = f"data.path ({json_path.name})"
    yield f"{key} images", str(root)
    for name in names:
        yield f"{key} file_name", str(root / name)
