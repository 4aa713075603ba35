"""Which images of a folder get a caption file, and writing one. Torch-free (the UI's caption editor uses it).

A caption is the same-name `.txt` beside the image, as training reads it (trainer.core.data.scan). Kohya repeat
sub-folders are walked too; hidden folders (`.cache`, `.ipynb_checkpoints`) are not. An existing non-empty caption
is kept unless `overwrite`: hand-written captions are worth more than a model's. Every write goes through a
temporary file renamed over the caption, so a crash or a stop never leaves half a caption that training would read.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trainer.core.data.scan import IMAGE_EXTENSIONS
from trainer.errors import UserError

CAPTION_EXTENSION = ".txt"


def caption_extension(text: str | None) -> str:
    """A caption extension as given (data.caption_extension; `.txt` when empty), checked: a caption is never
    written over an image or outside its own name (`.txt`, `.caption`)."""
    extension = (text or "").strip() or CAPTION_EXTENSION
    if not re.fullmatch(r"\.[A-Za-z0-9_-]{1,16}", extension) or extension.lower() in IMAGE_EXTENSIONS:
        raise UserError(f"Caption extension {extension!r}: use a dot and letters, such as .txt or .caption (not an "
                        "image's).")
    return extension


def caption_path(image: Path, extension: str = CAPTION_EXTENSION) -> Path:
    return image.with_suffix(extension)


def images_in(folder: Path) -> list[Path]:
    """The folder's images, sub-folders included (not hidden ones, nor links to folders: a caption is never
    written outside the folder), in a stable order."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root) / f for f in sorted(files) if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith(".")]
    return found


def read_caption(image: Path, extension: str = CAPTION_EXTENSION) -> str:
    try:
        return caption_path(image, extension).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return ""


@dataclass(frozen=True)
class CaptionWork:
    todo: list[Path]
    """Images to caption, in order."""
    kept: list[Path]
    """Images whose existing caption stays (no --overwrite)."""


def plan_work(folder: str | Path, overwrite: bool = False, extension: str = CAPTION_EXTENSION) -> CaptionWork:
    extension = caption_extension(extension)
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise UserError(f"--caption {folder}: no such folder. Give the folder of your training images (the one "
                        "data.path names).")
    images = images_in(root)
    if not images:
        raise UserError(f"--caption {folder}: no images there ({', '.join(IMAGE_EXTENSIONS)}), sub-folders included.")
    kept = [] if overwrite else [image for image in images if read_caption(image, extension)]
    return CaptionWork([image for image in images if image not in set(kept)], kept)


def with_prefix(prefix: str, caption: str) -> str:
    """`prefix` then the caption; the prefix is written as given (`"sks, "`, `"photo of sks "`)."""
    caption = " ".join(caption.split())  # models' line breaks would become separate prompt lines elsewhere
    return f"{prefix}{caption}" if prefix else caption


def write_caption(path: Path, text: str) -> None:
    """Atomically: a temporary file in the same folder, flushed, then renamed over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text.strip() + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
