"""Caption a folder: plan the work (torch-free, so a wrong folder fails before a model loads), load the captioner,
write each caption as it comes with a progress line and an ETA, and release the model however it ends.

Progress lines have a fixed form the UI's Caption panel parses from the process's output:
`caption 3/10 cat.png · 0:42 left`. An image that cannot be opened is skipped with a warning (the rest go on).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from trainer.captioning.files import CAPTION_EXTENSION, caption_path, plan_work, with_prefix, write_caption
from trainer.captioning.registry import CaptionerSpec
from trainer.core.runlog import duration

PROGRESS_PREFIX = "caption "


@dataclass
class CaptionResult:
    written: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def progress_line(done: int, total: int, name: str, elapsed: float) -> str:
    left = elapsed / done * (total - done) if done else None
    return f"{PROGRESS_PREFIX}{done}/{total} {name} · {duration(left)} left"


def caption_folder(folder: str | Path, spec: CaptionerSpec, load: Callable, prefix: str = "", overwrite: bool = False,
                   say: Callable[[str], None] = print, extension: str = CAPTION_EXTENSION) -> CaptionResult:
    """Write `prefix + caption` beside every image of `folder` that has no caption yet (all with `overwrite`).
    `load(spec)` gives the captioner (trainer.captioning.models.load; a stand-in in tests), called only when
    there is an image to caption."""
    work = plan_work(folder, overwrite, extension)
    result = CaptionResult(kept=work.kept)
    if work.kept:
        say(f"keeping {len(work.kept)} existing caption(s) (--overwrite replaces them)")
    if not work.todo:
        return result
    say(f"loading {spec.name} ({spec.model})")
    captioner = load(spec)
    say(f"captioning {len(work.todo)} image(s) with {spec.name} on {getattr(captioner, 'device', 'cpu')}")
    start = time.monotonic()
    try:
        for i, image_path in enumerate(work.todo, 1):
            try:
                with Image.open(image_path) as image:
                    text = captioner.caption(image.convert("RGB"))
            except OSError as exc:  # an unreadable image; training's scan skips it too
                result.failed.append(f"{image_path.name}: {exc}")
                say(f"warning: {image_path.name} skipped ({exc})")
            else:
                target = caption_path(image_path, extension)
                write_caption(target, with_prefix(prefix, text))
                result.written.append(target)
            say(progress_line(i, len(work.todo), image_path.name, time.monotonic() - start))
    finally:
        captioner.close()
    return result
