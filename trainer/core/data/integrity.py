"""Does an image file decode to the end? Checked once per scan, before any process trains on it.

A truncated JPEG or PNG (a partial download or copy) keeps a valid header, so a header-only scan accepts it and
the run dies at the step that first loads it, with `OSError: image file is truncated` naming no file; a file
that is not an image at all, listed by a COCO json that gives its size, was never opened by the scan. Here every
file is opened and decoded: JPEGs in PIL's draft mode (the DCT at 1/8 scale: it still reads the whole
bitstream, so a missing end fails, at about half the cost of a full decode), other formats through `verify`
(PNG and WebP check their chunks to the end). Files are checked in threads: PIL releases the GIL while it
decodes. Torch-free.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Optional, TypeVar

from PIL import Image

T = TypeVar("T")


def decode_problem(path: str | os.PathLike) -> Optional[str]:
    """Why `path` cannot train as an image (a phrase to follow its name), or None when it decodes."""
    try:
        with Image.open(path) as img:
            if img.format == "JPEG":
                img.draft("RGB", (max(1, img.width // 8), max(1, img.height // 8)))
                img.load()
            else:
                img.verify()
    except Exception as exc:  # PIL raises many types (OSError, SyntaxError, DecompressionBombError, ...)
        return f"cannot be read as an image ({exc})"
    return None


def decode_problems(paths: Iterable[str | os.PathLike], workers: int | None = None) -> list[Optional[str]]:
    """`decode_problem` of each path, in order."""
    return map_files(decode_problem, paths, workers)


def map_files(fn: Callable[[Path], T], paths: Iterable[str | os.PathLike], workers: int | None = None) -> list[T]:
    """fn(path) for each path, in order, in threads: the files' reads and PIL's decoding release the GIL."""
    files = [Path(p) for p in paths]
    workers = workers or min(8, os.cpu_count() or 1)
    if workers <= 1 or len(files) < 2:
        return [fn(f) for f in files]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, files))
