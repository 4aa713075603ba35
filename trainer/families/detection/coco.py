"""COCO detection files: `images`, `annotations` ([x, y, width, height] boxes in pixels) and `categories`, mapped to
records with labels 1..K (categories ordered by id). Torch-free; the dataset scan is trainer.families.detection.data.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.core.data.integrity import decode_problems
from trainer.families.detection.orientation import annotated_as_displayed, headers
from trainer.families.detection.records import DetRecord, IssueReport, clip_box, image_size


def coco_images_dir(json_path: Path, first_file: str | None, images_dir: str | None) -> Path:
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


def read_coco(json_path: Path, id_to_label: dict[int, int] | None, images_dir: str | None, report: IssueReport,
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
    root = coco_images_dir(json_path, images[0].get("file_name") if images else None, images_dir)
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
            size = image_size(path, exif=False)
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
        box = clip_box(x, y, x + w, y + h, record.width, record.height, where, report)
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
                                report: IssueReport) -> None:
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
