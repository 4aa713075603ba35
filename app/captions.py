"""Caption editing for the Dataset tab: read every caption of a folder, save one, and change many at once.

Torch-free and gradio-free. The folder is confined like every path typed into an exposed UI (app.security), and a
caption is only ever written beside an image of that folder (the image's own name, `.txt`), atomically
(trainer.captioning.files). A bulk change is computed first (`preview`: which captions change and how) and applied
as computed (`apply`), so the count the user confirmed is what gets written; a caption changed on disk since the
preview is left alone and counted as skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from app.security import Workspace
from trainer.captioning.files import CAPTION_EXTENSION, caption_extension, caption_path, images_in, read_caption, write_caption
from trainer.core.data.captions import split_tags
from trainer.errors import UserError

OPERATIONS = ("Replace text", "Add tag", "Remove tag")
EDIT_LIMIT = 60
"""Images shown for inline editing at once (the thumbnails are made in the UI process)."""


def folder_of(workspace: Workspace, text: str) -> Path:
    """The dataset folder typed into the UI, confined, that exists."""
    text = (text or "").strip()
    if not text:
        raise UserError("Type the folder of your training images first.")
    folder = workspace.check("data.path", text)
    if not folder.is_dir():
        raise UserError(f"data.path: '{text}' is not a folder. Give the folder that holds your training images.")
    return folder


def captions_of(folder: Path, extension: str = CAPTION_EXTENSION) -> list[tuple[Path, str]]:
    """(image, its caption: '' when it has none) for every image of the folder, sub-folders included."""
    return [(image, read_caption(image, extension)) for image in images_in(folder)]


def save_caption(workspace: Workspace, folder_text: str, image_rel: str, text: str,
                 extension: str = CAPTION_EXTENSION) -> Path:
    """Write one image's caption. `image_rel` (from the page) must name an image of the folder itself."""
    extension = caption_extension(extension)
    folder = folder_of(workspace, folder_text)
    # Not resolved: an image that is a link to elsewhere gets its caption here, beside the link, as training reads
    # it; images_in does not enter linked folders, so every caption it allows is written inside the folder.
    image = Path(os.path.normpath(folder / image_rel))
    if image not in set(images_in(folder)):
        raise UserError(f"'{image_rel}' is not an image of {folder}; reload the captions.")
    target = caption_path(image, extension)
    write_caption(target, text)
    return target


@dataclass(frozen=True)
class Change:
    image: Path
    before: str
    after: str
    extension: str = CAPTION_EXTENSION


def changed(caption: str, operation: str, find: str, replacement: str) -> str:
    """The caption after one bulk operation (the same caption when it does not apply)."""
    if operation == "Replace text":
        return caption.replace(find, replacement) if find else caption
    tag = find.strip()
    tags = split_tags(caption)
    if not tag:
        return caption
    if operation == "Add tag":
        return caption if tag in tags else ", ".join([*tags, tag]) if caption.strip() else tag
    if operation == "Remove tag":
        return ", ".join(t for t in tags if t != tag) if tag in tags else caption
    raise UserError(f"Unknown operation {operation!r}: one of {', '.join(OPERATIONS)}.")


def preview(folder: Path, operation: str, find: str, replacement: str = "",
            extension: str = CAPTION_EXTENSION) -> list[Change]:
    extension = caption_extension(extension)
    if not find.strip() if operation != "Replace text" else not find:
        raise UserError("Type the text to find (or the tag to add or remove) first.")
    out = []
    for image, caption in captions_of(folder, extension):
        after = changed(caption, operation, find, replacement)
        if after != caption:
            out.append(Change(image, caption, after, extension))
    return out


def apply(changes: list[Change]) -> tuple[int, int]:
    """Write the previewed captions; (written, skipped because the caption changed since the preview)."""
    written = skipped = 0
    for change in changes:
        if read_caption(change.image, change.extension) != change.before:
            skipped += 1
            continue
        write_caption(caption_path(change.image, change.extension), change.after)
        written += 1
    return written, skipped
