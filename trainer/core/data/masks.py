"""Loss masks (`data.masks`), torch-free: which file holds each image's mask, whether every mask is there, and
opening one as a greyscale image (white: trained on, black: contributes nothing). The torch side places it like
its image and shrinks it to latent size (trainer.families.components.mask_tensors).

`alpha`: an image's own alpha channel (a PNG or WebP with transparency); an image without one trains whole.
A folder: the mask of `data.path/sub/cat.jpg` is `<folder>/sub/cat.<ext>` or, as kohya's conditioning folders
are laid out, `<folder>/cat.<ext>` (any image extension), at the image's size; a missing one is an error.
Prior-preservation class images are never masked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from PIL import Image, ImageOps

from trainer.core.data.confine import escapes
from trainer.core.data.integrity import decode_problem
from trainer.core.data.scan import IMAGE_EXTENSIONS, DatasetScan, ImageItem
from trainer.errors import UserError

ALPHA = "alpha"
_LISTED = 3  # how many files a message names before "and N more"


def has_alpha(img: Image.Image) -> bool:
    return img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info


def mask_file(image: str, folder: str, roots: Sequence[str]) -> Optional[Path]:
    """The mask of `image` in `folder`: its path relative to whichever of `roots` holds it, else its bare name."""
    image_path, base = Path(image), Path(folder).expanduser()
    stems = []
    for root in roots:
        if root and Path(root) in image_path.parents:
            stems.append(base / image_path.relative_to(root).with_suffix(""))
    stems.append(base / image_path.stem)
    for stem in dict.fromkeys(stems):
        for ext in IMAGE_EXTENSIONS:
            for candidate in (stem.parent / (stem.name + ext), stem.parent / (stem.name + ext.upper())):
                if candidate.is_file() and not escapes(candidate):  # a linked-out mask counts as missing
                    return candidate
    return None


def open_mask(image: str, masks: str, roots: Sequence[str]) -> Optional[Image.Image]:
    """The mask of `image` as an "L" image the size of the image as displayed (EXIF rotation applied), or None
    when it trains whole (`alpha` and the image has none)."""
    source = image if masks == ALPHA else mask_file(image, masks, roots)
    if source is None:
        raise UserError(f"data.masks: the mask of {image} is missing from {masks}; run the dataset check")
    with Image.open(source) as opened:
        img = ImageOps.exif_transpose(opened)
        if masks == ALPHA:
            return img.convert("RGBA").getchannel("A") if has_alpha(img) else None
        return img.convert("L")


def check_masks(config, scan: DatasetScan) -> list[str]:
    """Raise one UserError naming every image whose mask is missing, unreadable or of another size (folder
    masks); return warnings (`alpha`: the images without an alpha channel, which train whole)."""
    masks = config.data.masks
    if not masks:
        return []
    items = scan.items + scan.held_out
    roots = [*(scan.roots or [scan.root]), config.data.val_path]
    if masks == ALPHA:
        without = [item for item in items if not _item_has_alpha(item)]
        if not without:
            return []
        return [f"data.masks: {len(without)} of {len(items)} images have no alpha channel and train whole: "
                f"{_names(without)}"]
    problems = []
    for item in items:
        problem = _folder_mask_problem(item, masks, roots)
        if problem:
            problems.append(problem)
    if problems:
        more = f" (and {len(problems) - _LISTED} more)" if len(problems) > _LISTED else ""
        raise UserError(
            f"data.masks: {len(problems)} of {len(items)} images have no usable mask in {masks}: "
            f"{'; '.join(problems[:_LISTED])}{more}. Each image needs a greyscale mask of its own size with the "
            "same name (white: trained on, black: ignored), at the same relative path or at the top of the "
            "folder; or set data.masks=alpha to use the images' transparency, or leave data.masks empty.")
    return []


def _folder_mask_problem(item: ImageItem, masks: str, roots: Sequence[str]) -> Optional[str]:
    name = os.path.basename(item.path)
    found = mask_file(item.path, masks, roots)
    if found is None:
        return f"{name} has none (expected {Path(masks) / Path(name).stem}.png)"
    problem = decode_problem(found)
    if problem:
        return f"{found.name} {problem}"
    with Image.open(found) as img:
        size = ImageOps.exif_transpose(img).size if "exif" in img.info else img.size
    if size != (item.width, item.height):
        return f"{found.name} is {size[0]}x{size[1]} but {name} is {item.width}x{item.height}"
    return None


def _item_has_alpha(item: ImageItem) -> bool:
    with Image.open(item.path) as img:
        return has_alpha(img)


def _names(items: list[ImageItem]) -> str:
    names = ", ".join(os.path.basename(i.path) for i in items[:_LISTED])
    return names + (f" and {len(items) - _LISTED} more" if len(items) > _LISTED else "")
