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

import json
import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from trainer.core.data.confine import OUTSIDE, confined_to, escapes
from trainer.core.data.integrity import decode_problems
from trainer.families.detection.orientation import annotated_as_displayed, headers
from trainer.errors import UserError

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


class _Report:
    """Counts issues by kind and keeps the first few messages of each."""

    def __init__(self):
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


# ----------------------------------------------------------------------------------------------------------------
# Boxes


def _clip_box(x1: float, y1: float, x2: float, y2: float, width: int, height: int, where: str, report: _Report):
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


def _image_size(path: Path, exif: bool) -> Optional[tuple[int, int]]:
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


# ----------------------------------------------------------------------------------------------------------------
# COCO


def _coco_images_dir(json_path: Path, first_file: str | None, images_dir: str | None) -> Path:
    if images_dir:
        return Path(images_dir).expanduser().resolve()
    here = json_path.parent
    candidates = [here, here / "images", here.parent, here.parent / "images"]
    stem = json_path.stem
    for prefix in ("instances_", "person_keypoints_", "captions_"):
        if stem.startswith(prefix):  # COCO 2017: annotations/instances_train2017.json -> train2017/
            candidates += [here.parent / stem[len(prefix):], here / stem[len(prefix):]]
    if first_file:
        for folder in candidates:
            if (folder / first_file).is_file():
                return folder
    return here


def _read_json(path: Path, problems: list[str]) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        problems.append(f"{path}: no such file")
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        problems.append(f"{path}: not a readable JSON file ({exc})")
        return None
    missing = [k for k in ("images", "annotations", "categories") if not isinstance(data, dict) or k not in data]
    if missing:
        problems.append(f"{path}: not a COCO detection file (it lacks {', '.join(missing)})")
        return None
    return data


def coco_classes(data: dict, name: str, problems: list[str]) -> tuple[list[str], dict[int, int]]:
    """(class names, category id -> label 1..K), categories ordered by id."""
    seen: dict[int, str] = {}
    for cat in data["categories"]:
        if not isinstance(cat, dict) or not isinstance(cat.get("id"), int):
            problems.append(f"{name}: category {cat!r} has no integer id")
            continue
        seen.setdefault(cat["id"], str(cat.get("name", cat["id"])))
    ids = sorted(seen)
    if not ids:
        problems.append(f"{name}: has no categories; a detector needs at least one class")
    return [seen[i] for i in ids], {cat_id: label for label, cat_id in enumerate(ids, start=1)}


def read_coco(json_path: Path, id_to_label: dict[int, int] | None, images_dir: str | None, report: _Report,
              problems: list[str]) -> tuple[list[str], dict[int, int], list[DetRecord]]:
    """This file's classes and category id -> label map, and its images with boxes. `id_to_label` maps the
    categories when this file is the validation file of another (the training file's classes are the run's)."""
    data = _read_json(json_path, problems)
    if data is None:
        return [], {}, []
    name = json_path.name
    classes, own_map = coco_classes(data, name, problems)
    if id_to_label is not None and set(own_map) - set(id_to_label):
        report.add("unknown_category", f"{name}: categories {sorted(set(own_map) - set(id_to_label))} are not in "
                                       "the training file; their annotations are skipped")
    id_to_label = own_map if id_to_label is None else id_to_label
    images = [im for im in data["images"] if isinstance(im, dict)]
    root = _coco_images_dir(json_path, images[0].get("file_name") if images else None, images_dir)
    records: dict[object, DetRecord] = {}
    skipped: set = set()
    for im in images:
        file_name = im.get("file_name")
        if not isinstance(file_name, str) or "id" not in im:
            report.add("malformed", f"{name}: image entry {json.dumps(im)[:80]} has no id or file_name; skipped")
            continue
        path = root / file_name
        if not path.is_file():
            report.add("missing_image", f"{name}: image {im['id']} '{file_name}': no file at {path}; skipped with "
                                        "its annotations (set detection.images to the folder of the images)")
            skipped.add(im["id"])
            continue
        width, height = im.get("width"), im.get("height")
        if not (isinstance(width, int) and isinstance(height, int) and width > 0 and height > 0):
            size = _image_size(path, exif=False)
            if size is None:
                report.add("unreadable_image", f"{name}: image {im['id']} '{file_name}' cannot be read; skipped")
                skipped.add(im["id"])
                continue
            width, height = size
        records[im["id"]] = DetRecord(str(path), width, height)
    _apply_exif_where_annotated(records, images, name, report)
    # The json's sizes mean the files were never opened: a truncated or non-image file would kill the run at
    # its first use. Every image is decoded once, here (trainer.core.data.integrity).
    for (image_id, entry), problem in zip(list(records.items()), decode_problems(r.path for r in records.values())):
        if problem:
            report.add("unreadable_image", f"{name}: image {image_id} '{Path(entry.path).name}' ({entry.path}) "
                                           f"{problem}; skipped with its annotations")
            skipped.add(image_id)
            del records[image_id]
    for ann in data["annotations"]:
        if not isinstance(ann, dict):
            report.add("malformed", f"{name}: annotation {ann!r:.60} is not an object; skipped")
            continue
        ann_id = ann.get("id", "?")
        record = records.get(ann.get("image_id"))
        if record is None:
            if ann.get("image_id") not in skipped:  # a skipped image's annotations were mentioned with it
                report.add("unknown_image", f"{name}: annotation {ann_id} refers to image {ann.get('image_id')!r}, "
                                            "which is not in its images; skipped")
            continue
        where = f"{name}: annotation {ann_id} (image '{Path(record.path).name}')"
        crowd = bool(ann.get("iscrowd", 0))
        # Any JSON value (or none): one that is not a known id finds no label.
        label = id_to_label.get(ann.get("category_id"))  # type: ignore[arg-type]
        if label is None:
            known = ", ".join(map(str, sorted(id_to_label)[:12]))
            report.add("unknown_category", f"{where}: category_id {ann.get('category_id')!r} is not one of the "
                                           f"categories ({known}); skipped")
            continue
        bbox = ann.get("bbox")
        if not (isinstance(bbox, (list, tuple)) and len(bbox) == 4 and all(isinstance(v, (int, float)) for v in bbox)):
            report.add("malformed", f"{where}: bbox {bbox!r} is not [x, y, width, height]; skipped")
            continue
        x, y, w, h = (float(v) for v in bbox)
        box = _clip_box(x, y, x + w, y + h, record.width, record.height, where, report)
        if box is not None and crowd:
            report.add("crowd", f"{where}: a crowd region (iscrowd=1): not trained on, ignored by evaluation as "
                                "COCO does")
            record.crowd_boxes.append(box)
            record.crowd_labels.append(label)
        elif box is not None:
            record.boxes.append(box)
            record.labels.append(label)
    out = sorted(records.values(), key=lambda r: r.path)
    if images and not out:
        problems.append(f"{name}: none of its {len(images)} images could be used (see the warnings; is "
                        f"detection.images right? the images were looked for in {root})")
    return classes, id_to_label, out


def _apply_exif_where_annotated(records: dict[object, DetRecord], images: list[dict], name: str,
                                report: _Report) -> None:
    """Mark the images whose boxes were drawn on the displayed (EXIF-turned) image; warn where it cannot be told
    (trainer.families.detection.orientation)."""
    sizes = {im["id"]: (im.get("width"), im.get("height")) for im in images if isinstance(im, dict) and "id" in im}
    for (image_id, record), found in zip(list(records.items()), headers(r.path for r in records.values())):
        if found is None:
            continue  # the decode check names it
        orientation, stored = found
        width, height = sizes.get(image_id, (None, None))
        given = None
        if isinstance(width, int) and isinstance(height, int) and min(width, height) > 0:
            given = (width, height)
        displayed = annotated_as_displayed(orientation, stored, given)
        if displayed:
            record.exif = True
        elif displayed is None:
            report.add("exif_unknown", f"{name}: image {image_id} '{Path(record.path).name}' has EXIF orientation "
                                       f"{orientation}, and its size in the json cannot tell whether its boxes were "
                                       "drawn on the stored or the displayed image: they are read on the stored "
                                       "pixels, as COCO's tools do. If they were drawn as displayed, save the image "
                                       "with the orientation applied (PIL's ImageOps.exif_transpose)")


# ----------------------------------------------------------------------------------------------------------------
# YOLO


def _yolo_names(data: dict, name: str, problems: list[str]) -> list[str]:
    names, nc = data.get("names"), data.get("nc")
    if isinstance(names, dict):
        try:
            ids = sorted(int(k) for k in names)
        except (TypeError, ValueError):
            problems.append(f"{name}: names must map class numbers to names, got keys {list(names)[:5]}")
            return []
        if ids != list(range(len(ids))):
            problems.append(f"{name}: names must number the classes 0..{len(ids) - 1} without gaps, got {ids[:10]}")
            return []
        names = [str(names[k] if k in names else names[str(k)]) for k in ids]
    elif isinstance(names, list):
        names = [str(n) for n in names]
    elif isinstance(nc, int) and nc > 0:
        names = [str(i) for i in range(nc)]
    else:
        problems.append(f"{name}: has no `names` (the class names, e.g. names: [cat, dog])")
        return []
    if isinstance(nc, int) and nc != len(names):
        problems.append(f"{name}: nc is {nc} but names lists {len(names)} classes")
    if not names:
        problems.append(f"{name}: names is empty; a detector needs at least one class")
    return names


def _yolo_images(entry, root: Path, key: str, name: str, problems: list[str], report: _Report) -> list[Path]:
    entries = entry if isinstance(entry, list) else [entry]
    found: list[Path] = []
    for item in entries:
        target = Path(str(item)).expanduser()
        target = target if target.is_absolute() else root / target
        if target.is_dir():
            images = sorted(p for p in target.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
            roots = confined_to()  # an exposed UI's runs: files linking out of the workspace are not read
            for image in (p for p in images if escapes(p, roots)):
                report.add("outside", f"{image}: {OUTSIDE}; skipped")
            found += [p for p in images if not escapes(p, roots)]
        elif target.is_file() and target.suffix.lower() == ".txt":
            for line in target.read_text(encoding="utf-8", errors="replace").splitlines():
                line = line.strip()
                if not line:
                    continue
                path = Path(line).expanduser()
                path = path if path.is_absolute() else (target.parent / path)
                if path.is_file():
                    found.append(path.resolve())
                else:
                    report.add("missing_image", f"{target.name}: lists {line}, which does not exist; skipped")
        else:
            problems.append(f"{name}: {key}: {item!r} is neither a folder of images nor a .txt list ({target} "
                            "does not exist)")
    return found


def _report_orphan_labels(images: list[Path], report: _Report) -> None:
    """Label files in the label folders of `images` that belong to no image (a renamed or deleted photo): their
    boxes never train, which a user would want to know."""
    expected = {_label_file(image) for image in images}
    for folder in sorted({label.parent for label in expected}):
        if folder.is_dir():
            for label in sorted(folder.glob("*.txt")):
                if label not in expected and label.name != "classes.txt":
                    report.add("orphan_label", f"{label}: a label file with no image of the same name; ignored")


def _label_file(image: Path) -> Path:
    """Ultralytics' rule: the last /images/ of the path becomes /labels/, the extension .txt."""
    text = str(image)
    sep_images, sep_labels = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    if sep_images in text:
        head, tail = text.rsplit(sep_images, 1)
        text = head + sep_labels + tail
    return Path(text).with_suffix(".txt")


def _yolo_record(image: Path, num_classes: int, report: _Report) -> DetRecord | None:
    size = _image_size(image, exif=True)
    if size is None:
        report.add("unreadable_image", f"{image}: cannot be read as an image; skipped")
        return None
    width, height = size
    record = DetRecord(str(image), width, height, exif=True)
    label_file = _label_file(image)
    if label_file.is_file() and escapes(label_file):
        report.add("outside", f"{label_file}: {OUTSIDE}; its image is skipped")
        return None
    if not label_file.is_file():
        report.add("no_label_file", f"{image}: no label file ({label_file}); trains as an empty (background) "
                                    "image")
        return record
    for number, line in enumerate(label_file.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        where = f"{label_file.parent.name}/{label_file.name} line {number}"
        try:
            values = [float(v) for v in fields]
        except ValueError:
            report.add("malformed", f"{where}: {line.strip()[:60]!r} is not numbers (expected 'class x_center "
                                    "y_center width height'); skipped")
            continue
        if len(values) == 5:
            cx, cy, w, h = values[1:]
            x1, y1, x2, y2 = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2
        elif len(values) >= 7 and len(values) % 2 == 1:  # YOLO-seg polygon: class x1 y1 x2 y2 ...
            xs, ys = values[1::2], values[2::2]
            x1, y1, x2, y2 = min(xs), min(ys), max(xs), max(ys)
        else:
            report.add("malformed", f"{where}: has {len(values)} values (expected 'class x_center y_center width "
                                    "height'); skipped")
            continue
        cls = values[0]
        if cls != int(cls) or not 0 <= cls < num_classes:
            report.add("unknown_category", f"{where}: class {fields[0]} is not one of data.yaml's classes "
                                           f"0..{num_classes - 1}; skipped")
            continue
        box = _clip_box(x1 * width, y1 * height, x2 * width, y2 * height, width, height, where, report)
        if box is not None:
            record.boxes.append(box)
            record.labels.append(int(cls) + 1)
    return record


def read_yolo(yaml_path: Path, report: _Report, problems: list[str]):
    """(classes, train records, val records or None)."""
    import yaml

    try:
        data = yaml.safe_load(yaml_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        problems.append(f"{yaml_path}: no such file")
        return [], [], None
    except (OSError, yaml.YAMLError) as exc:
        problems.append(f"{yaml_path}: not readable YAML ({exc})")
        return [], [], None
    name = yaml_path.name
    if not isinstance(data, dict) or "train" not in data:
        problems.append(f"{yaml_path}: a YOLO data.yaml needs at least `train` (images) and `names` (classes)")
        return [], [], None
    classes = _yolo_names(data, name, problems)
    root = Path(str(data.get("path") or ".")).expanduser()
    root = root if root.is_absolute() else (yaml_path.parent / root).resolve()
    splits: list[list[DetRecord] | None] = []
    for key in ("train", "val"):
        if data.get(key) in (None, ""):
            splits.append(None)
            continue
        files = _yolo_images(data[key], root, key, name, problems, report)
        if not files and not any(p.startswith(f"{name}: {key}:") for p in problems):
            problems.append(f"{name}: {key}: no images found under {data[key]!r} (root {root})")
        decodable = []
        for file, problem in zip(files, decode_problems(files)):
            if problem:
                report.add("unreadable_image", f"{file}: {problem}; skipped")
            else:
                decodable.append(file)
        records = [r for r in (_yolo_record(f, len(classes), report) for f in decodable) if r is not None]
        _report_orphan_labels(files, report)
        splits.append(records)
    return classes, splits[0] or [], splits[1]


# ----------------------------------------------------------------------------------------------------------------
# The whole dataset


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
    report = _Report()
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
