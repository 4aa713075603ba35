"""The dataset check page: scan a folder the way training will (trainer.core.data.scan) and show what it found.

Counts, resolution summary, kohya folders with their repeats, problems (the run would not start) and warnings
(files skipped: corrupt, uncaptioned, too small), and a grid of thumbnails with their captions. Thumbnails are
made here (PIL), so the browser never needs access to the dataset folder itself.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from app.security import Workspace
from trainer.core.config.validate import DEMO_SCHEME
from trainer.core.data.scan import DatasetScan, scan_dataset
from trainer.errors import UserError

GRID_LIMIT = 60
THUMB_PX = 192


@dataclass
class DatasetReport:
    summary_md: str
    problems_html: str
    gallery: list = field(default_factory=list)  # (PIL image, caption)
    scan: DatasetScan | None = None


def _thumb(path: str) -> Image.Image | None:
    try:
        with Image.open(path) as img:
            img.thumbnail((THUMB_PX, THUMB_PX))
            return img.convert("RGB")
    except Exception:
        return None


def _box(kind: str, title: str, items: list[str], more: int = 0) -> str:
    if not items:
        return ""
    lis = "".join(f"<li>{html.escape(i)}</li>" for i in items)
    extra = f"<li>… and {more} more</li>" if more else ""
    return f'<div class="msg-box {kind}"><b>{html.escape(title)}</b><ul>{lis}{extra}</ul></div>'


def summary_markdown(summary: dict, resolution: int | None) -> str:
    if not summary["images"]:
        return f"**No usable images** in `{summary['path']}`."
    lines = [
        f"**{summary['images']} images** in `{summary['path']}`"
        + (f" · **{summary['expanded']} per epoch** with kohya repeats" if summary["expanded"] != summary["images"] else ""),
        "",
        f"Sizes: smallest {summary['smallest']}, largest {summary['largest']} · short side "
        f"{summary['short_side_min']}–{summary['short_side_max']} px"
        + (f" (training resolution {resolution})" if resolution else ""),
    ]
    hist = {k: v for k, v in summary["short_side_histogram"].items() if v}
    if hist:
        lines += ["", "| short side (px) | images |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in hist.items()]
    folders = summary["folders"]
    if len(folders) > 1 or any(f != "." for f in folders):
        lines += ["", "| folder | repeats | images |", "| --- | --- | --- |"]
        lines += [f"| {name} | {f['repeats']} | {f['images']} |" for name, f in folders.items()]
    return "\n".join(lines)


def check_dataset(path: str, instance_prompt: str | None = None, caption_extension: str = ".txt",
                  resolution: int | None = None, workspace: Workspace | None = None,
                  demo_path: Callable[[str], Path] | None = None) -> DatasetReport:
    """Scan `path` and build the page's content; a path the UI may not read is reported, not raised."""
    path = (path or "").strip()
    if not path:
        return DatasetReport("Type the folder of your training images above, then press **Check**.", "")
    try:
        if path.startswith(DEMO_SCHEME):
            if demo_path is None:
                raise UserError(f"{path}: the demo assets are not available here")
            folder = str(demo_path(path[len(DEMO_SCHEME):]))
        else:
            folder = str((workspace or Workspace(Path.cwd())).check("data.path", path))
    except (UserError, KeyError) as exc:
        return DatasetReport("", _box("error", "Cannot check this folder", [str(exc)]))
    scan = scan_dataset(folder, instance_prompt=(instance_prompt or "").strip() or None,
                        caption_extension=caption_extension or ".txt", resolution=int(resolution) if resolution else None)
    summary = scan.summary()
    problems = _box("error", "Training would not start:", summary["problems"])
    problems += _box("warning", f"{summary['warning_count']} file(s) will be skipped or may train badly:",
                     summary["warnings"], max(0, summary["warning_count"] - len(summary["warnings"])))
    if not problems and scan.items:
        problems = _box("ok", "No problems found.", ["Every image is readable and has a caption."])
    gallery = []
    for item in scan.items[:GRID_LIMIT]:
        thumb = _thumb(item.path)
        if thumb is not None:
            repeats = f" · ×{item.repeats}" if item.repeats != 1 else ""
            gallery.append((thumb, f"{item.caption}  ·  {Path(item.path).name} {item.width}×{item.height}{repeats}"))
    md = summary_markdown(summary, resolution)
    if len(scan.items) > GRID_LIMIT:
        md += f"\n\nShowing the first {GRID_LIMIT} of {len(scan.items)} images."
    return DatasetReport(md, problems, gallery, scan)


def filled(path, prompt, extension, resolution, values: dict | None) -> tuple:
    """The tab's fields, each left empty taken from the New run tab's `values` (its preset and edits)."""
    values = values or {}
    return (path or values.get("data.path") or "", prompt or values.get("data.instance_prompt") or "",
            extension or values.get("data.caption_extension") or ".txt",
            resolution or values.get("data.resolution"))
