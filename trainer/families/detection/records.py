"""The parts the COCO and YOLO readers share (trainer.families.detection.coco, .yolo): one image's record, the
report that counts bad annotations by kind and keeps the first few of each, and the box clipping both apply.
Torch-free."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
EXAMPLES_PER_KIND = 5
# What each kind of issue did, for the "... and N more" lines.
_KIND_TEXT = {
    "clipped": "boxes reaching outside their image were clipped",
    "zero_area": "boxes of zero area were dropped",
    "unknown_category": "annotations with an unknown category were skipped",
    "malformed": "malformed annotations were skipped",
    "missing_image": "images whose file is missing were skipped",
    "unreadable_image": "unreadable images were skipped",
    "unknown_image": "annotations of images that are not in the file were skipped",
    "crowd": "crowd regions (iscrowd=1) are not trained on and are ignore regions in evaluation",
    "no_label_file": "images without a label file train as empty (background) images",
    "orphan_label": "label files without an image were ignored",
    "exif_unknown": "images with an EXIF orientation are read on their stored pixels (COCO's convention)",
    "outside": "files linking outside the workspace were skipped (an exposed UI's runs read files under it only)",
}


@dataclass
class DetRecord:
    """One image and its boxes: `boxes` as [x1, y1, x2, y2] in pixels (clipped, positive area), `labels` 1..K."""

    path: str
    width: int
    height: int
    boxes: list[list[float]] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    # apply the EXIF orientation when loading: YOLO labels refer to the displayed image, COCO boxes when the json's
    # size is the displayed one (trainer.families.detection.orientation)
    exif: bool = False
    # COCO crowd regions (iscrowd=1): never trained on; evaluation counts them as COCO does, as regions where
    # a detection is neither a true nor a false positive.
    crowd_boxes: list[list[float]] = field(default_factory=list)
    crowd_labels: list[int] = field(default_factory=list)


class IssueReport:
    """Counts issues by kind and keeps the first few messages of each."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.examples: dict[str, list[str]] = defaultdict(list)

    def add(self, kind: str, message: str | None = None) -> None:
        self.counts[kind] += 1
        if message and len(self.examples[kind]) < EXAMPLES_PER_KIND:
            self.examples[kind].append(message)

    def warnings(self) -> list[str]:
        out = []
        for kind, count in self.counts.items():
            shown = self.examples.get(kind, [])
            out += shown
            if count > len(shown):
                # A sentence, not "26: ..." (which read like a line number): how many, and what happened.
                more = f"and {count - len(shown)} more like {'these' if len(shown) > 1 else 'this'}" if shown \
                    else f"{count} in all"
                out.append(f"{_KIND_TEXT.get(kind, kind)} ({more})")
        return out


def clip_box(x1: float, y1: float, x2: float, y2: float, width: int, height: int, where: str, report: IssueReport):
    """The box clipped to the image, or None (reported) when nothing of positive area is left."""
    values = (x1, y1, x2, y2)
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        report.add("malformed", f"{where}: box {list(values)} has a non-finite coordinate; skipped")
        return None
    clipped = [min(max(x1, 0.0), width), min(max(y1, 0.0), height), min(max(x2, 0.0), width), min(max(y2, 0.0), height)]
    if clipped[2] - clipped[0] <= 0 or clipped[3] - clipped[1] <= 0:
        report.add("zero_area", f"{where}: box [{_fmt(x1)}, {_fmt(y1)}, {_fmt(x2)}, {_fmt(y2)}] (x1 y1 x2 y2) has "
                                f"zero area inside the {width}x{height} image; dropped")
        return None
    if any(abs(a - b) > 1e-6 for a, b in zip(clipped, values)):
        report.add("clipped", f"{where}: box [{_fmt(x1)}, {_fmt(y1)}, {_fmt(x2)}, {_fmt(y2)}] (x1 y1 x2 y2) reaches "
                              f"outside the {width}x{height} image; clipped")
    return clipped


def _fmt(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def image_size(path: Path, exif: bool) -> Optional[tuple[int, int]]:
    """(width, height) from the file header, as displayed when `exif`; None if unreadable."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            width, height = img.size
            if exif and img.getexif().get(0x0112, 1) in (5, 6, 7, 8):
                width, height = height, width
            return width, height
    except Exception:
        return None
