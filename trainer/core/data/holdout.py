"""Images held out of training for the validation loss: `data.val_split` (a part of data.path) or
`data.val_path` (a folder of its own). Torch-free: the launcher's data check and the workers split alike.

The split is by image and a function of the seed and each image's path relative to data.path only: the images
whose hash of (seed, path) is smallest are held out. So it is the same on any number of processes and after a
resume, and adding an image to the folder leaves the others where they were (bar the count growing by one).
Kohya repeats do not count: an image is held out or trained on, with all its repeats.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace

from trainer.core.data.scan import DatasetScan, ImageItem, require_usable, scan_dataset
from trainer.errors import UserError


def configured(data) -> bool:
    """Whether a run holds images out (`data` is the config's data section)."""
    return bool(data.val_split) or bool(data.val_path)


def held_out_count(images: int, fraction: float) -> int:
    """How many of `images` a split of `fraction` holds out: at least one once the fraction is above 0."""
    return max(1, round(images * fraction)) if fraction > 0 else 0


def _rank(seed: int, root: str, item: ImageItem) -> bytes:
    relative = os.path.relpath(item.path, root).replace(os.sep, "/") if root else item.path
    if item.dataset:  # data.datasets: the same relative path in two folders is two images
        relative = f"{item.dataset}:{relative}"
    return hashlib.sha256(f"{seed}\0{relative}".encode()).digest()


def split(items: list[ImageItem], fraction: float, *, seed: int,
          root: str = "", roots: dict[int, str] | None = None) -> tuple[list[ImageItem], list[ImageItem]]:
    """(training, held out), each in the scan's order. Raises UserError when either side would be empty. An
    image's place in the draw is a hash of its path relative to `root`, or to `roots[item.dataset]`."""
    count = held_out_count(len(items), fraction)
    if count == 0:
        return list(items), []
    if count >= len(items):
        raise UserError(
            f"data.val_split: {fraction:g} of the {len(items)} usable image{'s' if len(items) != 1 else ''} in "
            f"{root or 'data.path'} holds out {count}, which leaves none to train on. At least one image must "
            "stay for training: lower data.val_split, add images to data.path, or put validation images in a "
            "folder of their own and set data.val_path instead (with data.val_split=0).")
    def rank(item: ImageItem) -> bytes:
        return _rank(seed, (roots or {}).get(item.dataset, root), item)

    chosen = set(sorted(range(len(items)), key=lambda i: rank(items[i]))[:count])
    return ([item for i, item in enumerate(items) if i not in chosen],
            [item for i, item in enumerate(items) if i in chosen])


def training_scan(config, *, resolution: int | None = None) -> DatasetScan:
    """The run's training folders (data.path, or data.datasets: trainer.core.data.sources) scanned and required
    usable, less their held-out images, which `held_out` lists (from data.val_split, or the scan of
    data.val_path); warnings of the validation folder are prefixed `val: `. `resolution`: warn about images
    smaller than it (each folder's own resolution with data.datasets). Raises UserError for a folder that cannot
    be used."""
    from trainer.core.data.sources import scan_sources, sources

    data = config.data
    scan = scan_sources(data, check_resolution=resolution is not None)
    if data.val_path:
        val = scan_dataset(data.val_path, instance_prompt=data.instance_prompt,
                           caption_extension=data.caption_extension, resolution=resolution)
        require_usable(val, key="data.val_path")
        return replace(scan, held_out=val.items, warnings=scan.warnings + [f"val: {w}" for w in val.warnings])
    roots = ({i: os.path.abspath(os.path.expanduser(s.path)) for i, s in enumerate(sources(data))}
             if data.datasets else None)
    training, held = split(scan.items, data.val_split, seed=config.seed, root=scan.root, roots=roots)
    return replace(scan, items=training, held_out=held)
