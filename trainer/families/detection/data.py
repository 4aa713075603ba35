"""Object-detection datasets, torch-free: find the images and boxes of a COCO JSON file or a YOLO folder, check
every annotation, map category ids to contiguous labels 1..K (0 is torchvision's background), and split off
validation images. The launcher runs this before any process starts (and the UI for its dataset check).

`data.path` may be
- a COCO JSON file (`instances_train2017.json`, `train.json`...): boxes `[x, y, width, height]` in pixels,
  image files relative to `detection.images` (default: found next to the JSON file, in `images/`, or in the
  COCO-2017 sibling folder such as `../train2017`);
- a YOLO `data.yaml` (`path`, `train`, `val`, `names`), or the folder holding it: one `labels/NAME.txt` per
  `images/NAME.jpg` with lines `class x_center y_center width height` normalised to 0..1 (polygon lines of
  YOLO-seg are turned into their bounding box); an image without a label file is an empty (background) image;
- a folder with `train.json` (and optionally `val.json`), like the offline demo `demo://shapes-coco`.

The validation images are, in order: `detection.val_path` (a COCO JSON), the YOLO `val` entry, a `val.json`
next to `train.json`, else `detection.val_fraction` of the training images carved off with the run's seed.

Bad annotations never stop the scan: boxes reaching outside the image are clipped, boxes of zero area are
dropped, annotations with an unknown category, malformed lines and images whose file is missing are skipped,
each with a warning naming the file and the annotation (the first few of each kind, then a count). Problems
that leave nothing to train on are `problems`, which `require_usable` raises as one UserError.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from trainer.errors import UserError
from trainer.families.detection.coco import read_coco
from trainer.families.detection.records import DetRecord, IssueReport
from trainer.families.detection.yolo import read_yolo


@dataclass
class DetectionScan:
    layout: str  # "coco" or "yolo"
    classes: list[str]  # label i (1..K) is classes[i - 1]
    train: list[DetRecord]
    val: list[DetRecord]
    val_source: str = ""
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)

    def summary(self) -> dict:
        """A JSON-ready overview for the UI's dataset check."""
        per_class = Counter(label for r in self.train for label in r.labels)
        return {
            "layout": self.layout, "classes": list(self.classes), "train_images": len(self.train),
            "val_images": len(self.val), "val_source": self.val_source,
            "train_boxes": sum(len(r.boxes) for r in self.train), "empty_images": sum(not r.boxes for r in self.train),
            "boxes_per_class": {name: per_class.get(i + 1, 0) for i, name in enumerate(self.classes)},
            "issues": dict(self.counts), "problems": list(self.problems), "warnings": self.warnings[:50],
        }


def resolve_layout(path: str, val_path: str | None = None) -> tuple[str, Path, Path | None]:
    """("coco" | "yolo", the annotation file, a given COCO validation file or None); raises UserError."""
    p = Path(path).expanduser().resolve()
    val = Path(val_path).expanduser().resolve() if val_path else None
    if p.is_dir():
        if (p / "data.yaml").is_file():
            return "yolo", p / "data.yaml", val
        if (p / "train.json").is_file():
            return "coco", p / "train.json", val or ((p / "val.json") if (p / "val.json").is_file() else None)
        raise UserError(f"data.path: the folder {p} holds neither a YOLO data.yaml nor a COCO train.json; point "
                        "data.path at the COCO .json file or the YOLO data.yaml")
    if p.suffix.lower() == ".json":
        return "coco", p, val
    if p.suffix.lower() in (".yaml", ".yml"):
        return "yolo", p, val
    raise UserError(f"data.path: {p} is not a COCO .json file, a YOLO data.yaml or a folder holding one")


def carve_validation(records: list[DetRecord], fraction: float, seed: int):
    """(train, val): `fraction` of the records (at least one) chosen with `seed`, the same on every machine."""
    import numpy as np

    count = max(1, round(len(records) * fraction))
    chosen = set(np.random.default_rng([seed, 0x5E1EC7]).permutation(len(records))[:count].tolist())
    return ([r for i, r in enumerate(records) if i not in chosen], [r for i, r in enumerate(records) if i in chosen])


def scan_detection(path: str, *, val_path: str | None = None, images_dir: str | None = None,
                   val_fraction: float = 0.1, seed: int = 0) -> DetectionScan:
    """Read and check the whole dataset. Never raises for bad annotations: see `problems` and `warnings`."""
    report = IssueReport()
    problems: list[str] = []
    try:
        layout, source, val_file = resolve_layout(path, val_path)
    except UserError as exc:
        return DetectionScan("unknown", [], [], [], problems=[str(exc)])
    val_records, val_source = None, ""
    if layout == "coco":
        classes, train_map, train = read_coco(source, None, images_dir, report, problems)
        if val_file is not None and classes:
            _, _, val_records = read_coco(val_file, train_map, images_dir, report, problems)
            val_source = str(val_file)
    else:
        classes, train, val_records = read_yolo(source, report, problems)
        val_source = f"{source.name}: val" if val_records is not None else ""
        if val_file is not None:
            problems.append(f"detection.val_path is for COCO files; a YOLO dataset names its validation images in "
                            f"{source.name}'s `val` entry")
    if val_records is None and len(train) >= 2 and not problems:
        train, val_records = carve_validation(train, val_fraction, seed)
        val_source = f"{len(val_records)} of the training images ({val_fraction:g}), chosen with seed {seed}"
    scan = DetectionScan(layout, classes, train, val_records or [], val_source, problems, report.warnings(),
                         report.counts)
    if not problems:
        if not train:
            problems.append(f"{source}: no usable training images")
        elif not any(r.boxes for r in train):
            problems.append(f"{source}: none of the {len(train)} training images has a usable box; nothing to learn")
        elif not scan.val:
            problems.append(f"{source}: no validation images; give detection.val_path or more than one image")
    return scan


def require_usable(scan: DetectionScan, path: str) -> None:
    if scan.problems:
        lines = "\n".join(f"  - {p}" for p in scan.problems)
        raise UserError(f"data.path: the detection dataset {path} cannot be used:\n{lines}")


def scan_for_config(config) -> DetectionScan:
    d = config.detection
    return scan_detection(config.data.path, val_path=d.val_path or None, images_dir=d.images or None,
                          val_fraction=d.val_fraction, seed=config.seed)


def check_detection_data(config) -> DetectionScan:
    """The launcher's pre-check for `model.family: detection` (torch-free)."""
    scan = scan_for_config(config)
    require_usable(scan, config.data.path)
    return scan
