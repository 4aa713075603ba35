"""Find the training images and their captions in a dataset folder, without loading pixels.

Torch-free on purpose: the UI's "dataset check" runs this in the GUI process. Three layouts are understood, and
may be mixed in one folder:

- images with same-name caption files next to them (`cat.png` + `cat.txt`);
- kohya sub-folders named `N_prompt` (`10_sks dog/`): N repeats per epoch, and the prompt part is the caption of
  any image inside that has none of its own;
- a `metadata.jsonl` (Hugging Face imagefolder style) with lines `{"file_name": "a.png", "text": "..."}`.

A caption is taken from, in order: the caption file, the metadata entry, the kohya folder prompt, `instance_prompt`.
Files that cannot be used become warnings (the scan goes on); a dataset that cannot train at all is a problem,
which `require_usable` turns into a `UserError`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from PIL import Image

from trainer.core.data.confine import OUTSIDE, confined_to, escapes
from trainer.core.data.integrity import decode_problems
from trainer.errors import UserError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
METADATA_FILE = "metadata.jsonl"
KOHYA_FOLDER = re.compile(r"^(\d+)_(.*)$")
_OS_CLUTTER = {"thumbs.db", "desktop.ini"}  # dropped into folders by the OS: warning about them is noise
# EXIF orientations that rotate by 90 degrees, so the displayed width and height are swapped.
_SWAPPING_ORIENTATIONS = {5, 6, 7, 8}
_HISTOGRAM_EDGES = (256, 512, 768, 1024, 1536, 2048)
_SUMMARY_MESSAGE_LIMIT = 50


@dataclass
class ImageItem:
    """One usable training image. `width`/`height` are as displayed (EXIF rotation applied)."""

    path: str
    caption: str
    repeats: int
    width: int
    height: int
    dataset: int = 0
    """Index of its folder in the run's sources (trainer.core.data.sources): data.datasets' order; 0 for data.path."""


@dataclass
class DatasetScan:
    """What `scan_dataset` found. `problems` make the dataset unusable; `warnings` cost some images or quality."""

    items: list[ImageItem]
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    folders: dict[str, int] = field(default_factory=dict)  # kohya folder name -> repeats
    root: str = ""
    held_out: list[ImageItem] = field(default_factory=list)
    """Images kept out of `items` for the validation loss (trainer.core.data.holdout); empty without one."""
    roots: list[str] = field(default_factory=list)
    """Every training folder of the run (data.datasets), `root` first; empty for a single folder's scan."""
    regularization: list[ImageItem] = field(default_factory=list)
    """The regularization folders' images (data.datasets' is_regularization): prior preservation's."""

    @property
    def image_count(self) -> int:
        """Distinct usable images."""
        return len(self.items)

    @property
    def expanded_count(self) -> int:
        """Images per epoch, counting kohya repeats; equals `len(self.expanded())`."""
        return sum(item.repeats for item in self.items)

    def expanded(self) -> list[ImageItem]:
        """Every item `repeats` times in a row, in the scan's sorted order: the dataset one epoch walks over."""
        return [item for item in self.items for _ in range(item.repeats)]

    def summary(self) -> dict:
        """A JSON-ready overview for the UI's dataset check."""
        short_sides = [min(i.width, i.height) for i in self.items]
        by_area = sorted(self.items, key=lambda i: (i.width * i.height, i.path))
        per_folder: dict[str, dict[str, int]] = {}
        for item in self.items:
            folder = os.path.relpath(os.path.dirname(item.path), self.root) if self.root else "."
            entry = per_folder.setdefault(folder, {"repeats": item.repeats, "images": 0})
            entry["images"] += 1
        for name, repeats in self.folders.items():
            per_folder.setdefault(name, {"repeats": repeats, "images": 0})
        return {
            "path": self.root,
            "images": self.image_count,
            "expanded": self.expanded_count,
            "smallest": f"{by_area[0].width}x{by_area[0].height}" if by_area else None,
            "largest": f"{by_area[-1].width}x{by_area[-1].height}" if by_area else None,
            "short_side_min": min(short_sides, default=None),
            "short_side_max": max(short_sides, default=None),
            "short_side_histogram": _histogram(short_sides),
            "folders": dict(sorted(per_folder.items())),
            "problems": list(self.problems),
            # A screenful is enough for the UI; `warning_count` tells it how many more there are.
            "warnings": self.warnings[:_SUMMARY_MESSAGE_LIMIT],
            "warning_count": len(self.warnings),
        }


def scan_dataset(
    path: str | os.PathLike,
    *,
    instance_prompt: Optional[str] = None,
    caption_extension: str = ".txt",
    resolution: Optional[int] = None,
) -> DatasetScan:
    """Scan `path` for images and captions. Never raises for bad data: see `DatasetScan.problems`/`warnings`."""
    root = Path(os.path.abspath(Path(path).expanduser()))
    scan = DatasetScan(items=[], root=str(root))
    if not root.is_dir():
        missing = f"the folder {root} does not exist"
        scan.problems.append(f"{root} is a file, not a folder of images" if root.exists() else missing)
        return scan
    if escapes(root):
        scan.problems.append(f"{root} {OUTSIDE}")
        return scan
    extension = caption_extension if caption_extension.startswith(".") else "." + caption_extension
    fallback = (instance_prompt or "").strip() or None

    folders, others = _kohya_layout(root, scan)
    metadata: dict[str, str] = {}
    for folder, _, _ in folders:
        metadata.update(_read_metadata(folder, root, scan.warnings))
    images = _image_files(root, folders, others, metadata, extension, scan.warnings)

    captions_by_folder: dict[Path, dict[str, Path]] = {}
    broken = decode_problems(file for file, _, _ in images)
    for (file, repeats, folder_prompt), problem in zip(images, broken):
        rel = file.relative_to(root).as_posix()
        if problem:
            scan.warnings.append(f"{rel}: {problem}; skipped")
            continue
        size = _read_size(file, rel, scan.warnings)
        if size is None:
            continue
        # One listing per folder, then dictionary look-ups: a per-image directory search would be quadratic.
        if file.parent not in captions_by_folder:
            captions_by_folder[file.parent] = {
                p.name.lower(): p for p in file.parent.iterdir() if p.name.lower().endswith(extension.lower())
            }
        caption_file = captions_by_folder[file.parent].get((file.stem + extension).lower())
        if caption_file is not None and escapes(caption_file):
            scan.warnings.append(f"{rel}: its caption file {caption_file.name} {OUTSIDE}; not used")
            caption_file = None
        caption = _read_caption(caption_file, rel, scan.warnings) or metadata.get(rel) or folder_prompt or fallback
        if caption is None:
            scan.warnings.append(
                f"{rel}: no caption (no {file.stem}{extension}, no {METADATA_FILE} entry, "
                f"no kohya folder prompt, no instance prompt); skipped"
            )
            continue
        if resolution and min(size) < resolution:
            scan.warnings.append(
                f"{rel}: {size[0]}x{size[1]} is smaller than the resolution {resolution} on its short side; "
                f"it will be upscaled and may look blurry"
            )
        scan.items.append(ImageItem(str(file), caption, repeats, *size))

    scan.items.sort(key=lambda i: (i.path.casefold(), i.path))
    if not images:
        scan.problems.append(f"no images (png, jpg, jpeg, webp, bmp) found in {root}")
    elif not scan.items:
        scan.problems.append(f"none of the {len(images)} images in {root} is usable")
    return scan


# (folder, repeats, folder prompt): where images are taken from, and how.
_Source = tuple[Path, int, Optional[str]]


def _kohya_layout(root: Path, scan: DatasetScan) -> tuple[list[_Source], list[Path]]:
    """The root and its kohya `N_prompt` sub-folders (recorded in `scan.folders`) as sources; other sub-folders."""
    sources: list[_Source] = [(root, 1, None)]
    others: list[Path] = []
    roots = confined_to()
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if escapes(sub, roots):
            scan.warnings.append(f"{sub.name}/: {OUTSIDE}; ignored")
            continue
        match = KOHYA_FOLDER.match(sub.name)
        if match and int(match.group(1)) >= 1:
            scan.folders[sub.name] = int(match.group(1))
            sources.append((sub, int(match.group(1)), match.group(2).strip() or None))
        else:
            others.append(sub)
    return sources, others


def _image_files(
    root: Path, sources: list[_Source], others: list[Path], metadata: dict[str, str], extension: str, warnings: list
) -> list[_Source]:
    """Every image file to consider, with its repeats and folder prompt; warns about files and folders left out."""
    images = [
        (file, repeats, prompt)
        for folder, repeats, prompt in sources
        for file in _folder_files(folder, extension.lower(), root, warnings)
    ]
    # An imagefolder metadata.jsonl may point into plain sub-folders; only the files it lists are taken from those.
    scanned = {folder for folder, _, _ in sources}
    listed_elsewhere = [root / rel for rel in sorted(metadata) if (root / rel).parent not in scanned]
    for file in listed_elsewhere:
        if escapes(file):
            warnings.append(f"{METADATA_FILE}: {file.relative_to(root).as_posix()} {OUTSIDE}; skipped")
        elif file.is_file() and file.suffix.lower() in IMAGE_EXTENSIONS:
            images.append((file, 1, None))
        elif file.is_file():
            warnings.append(f"{METADATA_FILE}: {file.relative_to(root).as_posix()} is not an image; skipped")
    for sub in others:
        if not any(sub in file.parents for file in listed_elsewhere):
            why = "0 repeats means never used" if KOHYA_FOLDER.match(sub.name) else (
                "sub-folders are used only when named like '10_sks dog' (repeats_prompt) or listed in metadata.jsonl"
            )
            warnings.append(f"{sub.name}/: {why}; ignored")
    for rel in sorted(metadata):
        if not (root / rel).is_file():
            warnings.append(f"{METADATA_FILE}: {rel} is listed but there is no such file; ignored")
    return images


def _folder_files(folder: Path, caption_extension: str, root: Path, warnings: list[str]) -> list[Path]:
    """The files of `folder` that should be images, sorted; warns about the ones that cannot be."""
    files, roots = [], confined_to()
    for file in sorted(p for p in folder.iterdir() if p.is_file()):
        name = file.name.lower()
        if name.startswith(".") or name in _OS_CLUTTER or name == METADATA_FILE or name.endswith(caption_extension):
            continue
        if escapes(file, roots):
            warnings.append(f"{file.relative_to(root).as_posix()}: {OUTSIDE}; skipped")
            continue
        if not name.endswith(IMAGE_EXTENSIONS):
            rel = file.relative_to(root).as_posix()
            warnings.append(f"{rel}: not an image (png, jpg, jpeg, webp, bmp); skipped")
            continue
        files.append(file)
    return files


def require_usable(scan: DatasetScan, key: str = "data.path") -> None:
    """Raise a one-paragraph `UserError` when the scan found nothing to train on; return quietly otherwise."""
    if scan.items and not scan.problems:
        return
    reason = scan.problems[0] if scan.problems else f"no usable images in {scan.root}"
    more = f" (and {len(scan.warnings) - 3} more)" if len(scan.warnings) > 3 else ""
    found = f" The scan found: {'; '.join(scan.warnings[:3])}{more}." if scan.warnings else ""
    raise UserError(
        f"{key}: {reason}.{found} Put png, jpg, jpeg, webp or bmp images there, each with a caption: a same-name "
        f".txt file (cat.png + cat.txt), a kohya sub-folder name like '10_sks dog' (10 repeats, caption 'sks dog'), "
        f"a metadata.jsonl entry, or data.instance_prompt for all of them; or point {key} at another folder."
    )


def _read_size(file: Path, rel: str, warnings: list[str]) -> Optional[tuple[int, int]]:
    """Width and height from the header only (PIL opens lazily; trainer.core.data.integrity decoded it)."""
    try:
        with Image.open(file) as img:
            width, height = img.size
            # Only read EXIF when it came with the header: for PNG, getexif() would decode the whole image.
            if "exif" in img.info and img.getexif().get(0x0112) in _SWAPPING_ORIENTATIONS:
                width, height = height, width
    except Exception as exc:  # PIL raises many types (OSError, SyntaxError, DecompressionBombError, ...)
        warnings.append(f"{rel}: cannot be read as an image ({exc}); skipped")
        return None
    return width, height


def _read_caption(caption_file: Optional[Path], rel: str, warnings: list[str]) -> Optional[str]:
    """The caption file's text with whitespace collapsed; None when there is no file or it is empty."""
    if caption_file is None:
        return None
    try:
        text = caption_file.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        warnings.append(f"{rel}: caption file {caption_file.name} cannot be read as UTF-8 text ({exc}); not used")
        return None
    return " ".join(text.split()) or None


def _read_metadata(folder: Path, root: Path, warnings: list[str]) -> dict[str, str]:
    """Captions from `folder/metadata.jsonl`, keyed by image path relative to the dataset root."""
    file = folder / METADATA_FILE
    if not file.is_file():
        return {}
    label = file.relative_to(root).as_posix()
    if escapes(file):
        warnings.append(f"{label}: {OUTSIDE}; ignored")
        return {}
    captions: dict[str, str] = {}
    try:
        lines = file.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        warnings.append(f"{label}: cannot be read as UTF-8 text ({exc}); ignored")
        return {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            warnings.append(f"{label} line {number}: not valid JSON ({exc.msg}); ignored")
            continue
        name = entry.get("file_name") if isinstance(entry, dict) else None
        text = entry.get("text", entry.get("caption")) if isinstance(entry, dict) else None
        if not isinstance(name, str) or not isinstance(text, str):
            warnings.append(f'{label} line {number}: needs "file_name" and "text" (or "caption") strings; ignored')
            continue
        rel = os.path.normpath(os.path.relpath(folder / name, root)).replace(os.sep, "/")
        if rel == ".." or rel.startswith("../"):
            warnings.append(f"{label} line {number}: {name} is outside the dataset folder; ignored")
            continue
        captions[rel] = " ".join(text.split())
    return {rel: caption for rel, caption in captions.items() if caption}  # empty text: fall through


def _histogram(short_sides: list[int]) -> dict[str, int]:
    """Count images per short-side band, so the UI can show how many fall below the training resolution."""
    edges = _HISTOGRAM_EDGES
    labels = [f"<{edges[0]}"] + [f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])] + [f">={edges[-1]}"]
    counts = dict.fromkeys(labels, 0)
    for side in short_sides:
        counts[labels[sum(side >= edge for edge in edges)]] += 1
    return counts
