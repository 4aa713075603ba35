"""Control images of paired (instruction-edit) training (`data.control_path`), torch-free: which file is each
training image's control, and one error naming every image without one. The torch side caches their latents and
gives them their target's bucket, crop and flip (trainer.families.components.control_latents).

The folder is laid out as ai-toolkit's `control_path` and musubi-tuner's `control_directory`: the control of
`data.path/sub/cat.jpg` is `<folder>/sub/cat.<ext>` or `<folder>/cat.<ext>` (any image extension), the lookup
data.masks uses (trainer.core.data.masks.mask_file), so a linked-out file counts as missing there too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from trainer.core.data.integrity import decode_problem
from trainer.core.data.masks import mask_file
from trainer.core.data.scan import DatasetScan, ImageItem
from trainer.errors import UserError

_LISTED = 3  # how many files a message names before "and N more"


def scan_roots(config, scan: DatasetScan) -> list[str]:
    """The folders an image's relative path is taken from (data.path or data.datasets' folders, data.val_path)."""
    return [*(scan.roots or [scan.root]), config.data.val_path]


def control_file(image: str, folder: str, roots: Sequence[str]) -> Path:
    """The control image of `image` (a training image's path); UserError when it has none (the launcher's check
    has named every missing one before the run starts, so this is a file removed since)."""
    found = mask_file(image, folder, roots)
    if found is None:
        raise UserError(f"data.control_path: the control image of {image} is missing from {folder}; put a file of "
                        "the same name there, or run the dataset check")
    return found


def paired_items(scan: DatasetScan) -> list[ImageItem]:
    """The images that need a control: training, held-out and regularization images."""
    return scan.items + scan.held_out + scan.regularization


def check_controls(config, scan: DatasetScan) -> None:
    """Raise one UserError naming every image whose control image is missing or unreadable."""
    folder = config.data.control_path
    if not folder:
        return
    items, roots = paired_items(scan), scan_roots(config, scan)
    problems = []
    for item in items:
        name = os.path.basename(item.path)
        found = mask_file(item.path, folder, roots)
        if found is None:
            problems.append(f"{name} has none (expected {Path(folder) / Path(name).stem}.png or .jpg)")
        elif problem := decode_problem(found):
            problems.append(f"{found.name} {problem}")
    if problems:
        more = f" (and {len(problems) - _LISTED} more)" if len(problems) > _LISTED else ""
        raise UserError(
            f"data.control_path: {len(problems)} of {len(items)} images have no usable control image in {folder}: "
            f"{'; '.join(problems[:_LISTED])}{more}. Each training image needs its control (source) image with the "
            "same file name (any image extension), at the same relative path or at the top of the folder; add the "
            "missing files, remove those images from the dataset, or leave data.control_path empty.")
