"""YOLO datasets: a data.yaml (`path`, `train`, `val`, `names`) and one `labels/NAME.txt` per `images/NAME.jpg`, lines
`class x_center y_center width height` normalised to 0..1 (YOLO-seg polygons become their bounding box). Labels
refer to the displayed image, so the EXIF orientation applies. Torch-free; the dataset scan is
trainer.families.detection.data."""

from __future__ import annotations

import os
from pathlib import Path

from trainer.core.data.confine import OUTSIDE, confined_to, escapes
from trainer.core.data.integrity import decode_problems
from trainer.families.detection.records import (IMAGE_EXTENSIONS, DetRecord, IssueReport, clip_box,
                                               image_size)


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


def _yolo_images(entry, root: Path, key: str, name: str, problems: list[str], report: IssueReport) -> list[Path]:
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


def _report_orphan_labels(images: list[Path], report: IssueReport) -> None:
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


def _yolo_record(image: Path, num_classes: int, report: IssueReport) -> DetRecord | None:
    size = image_size(image, exif=True)
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
        box = clip_box(x1 * width, y1 * height, x2 * width, y2 * height, width, height, where, report)
        if box is not None:
            record.boxes.append(box)
            record.labels.append(int(cls) + 1)
    return record


def read_yolo(yaml_path: Path, report: IssueReport, problems: list[str]):
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
