"""Which pixels a COCO json's boxes refer to when an image carries an EXIF orientation (torch-free).

A phone stores a portrait photo sideways with an EXIF orientation tag that viewers apply. YOLO labels refer to the
image as displayed (Ultralytics applies the tag), and so do the boxes of browser-based annotation tools (CVAT,
Label Studio, Roboflow): browsers apply the tag when they show an image. pycocotools and torchvision's references
never apply it: boxes in COCO's own files refer to the stored pixels. The json's width and height tell the two
apart when the tag turns the image by 90 degrees (the displayed size is the stored one transposed), and the
loader then applies the tag as the annotator saw it. Where they cannot tell (a flip or a half turn, or a json
without sizes), the stored pixels are used, as COCO's tools do, and a warning names the file.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

from PIL import Image

from trainer.core.data.integrity import map_files

ORIENTATION_TAG = 0x0112
TURNS_90 = (5, 6, 7, 8)  # orientations that swap the displayed width and height


def header(path: str | os.PathLike) -> tuple[int, tuple[int, int]] | None:
    """(EXIF orientation, 1 when absent; stored (width, height)) from the file's header, or None if unreadable.
    EXIF is read only when it came with the header: for a PNG, getexif() would decode the whole image."""
    try:
        with Image.open(path) as img:
            orientation = img.getexif().get(ORIENTATION_TAG, 1) if "exif" in img.info else 1
            return (orientation if isinstance(orientation, int) else 1), img.size
    except Exception:
        return None


def headers(paths: Iterable[str | os.PathLike]) -> list[tuple[int, tuple[int, int]] | None]:
    """`header` of each path, in order (in threads: the opens wait on the disk)."""
    return map_files(header, paths)


def annotated_as_displayed(orientation: int, stored: tuple[int, int],
                           annotated: Optional[tuple[int, int]]) -> Optional[bool]:
    """Whether boxes drawn on an image of size `annotated` (the json's, None when it gives none) refer to the
    displayed image (True), the stored one (False), or cannot be told (None: read on the stored pixels, with a
    warning). An image without a turning or flipping tag is its stored self (False)."""
    if orientation in (0, 1):
        return False
    if orientation in TURNS_90 and annotated is not None and stored[0] != stored[1]:
        if annotated == (stored[1], stored[0]):
            return True
        if annotated == stored:
            return False
    return None
