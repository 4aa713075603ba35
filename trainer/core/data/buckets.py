"""Aspect-ratio buckets (`data.bucketing`): training resolutions of about `data.resolution`² pixels with other
shapes, so that wide and tall images train uncropped instead of being center-cropped to a square.

Torch-free (the launcher lists the buckets in the plan). Hand-written, in the way kohya's sd-scripts
(`make_bucket_resolutions`) and NovelAI's published scheme make them, as no maintained library exposes it:
for every width w that is a multiple of `step` between the smallest and largest side, the height is the largest
multiple of `step` with w x h <= resolution² (so no bucket costs more memory than the square one); both
orientations are kept, and shapes whose long side is more than `max_aspect` times the short side are dropped.
Each image goes to the bucket whose aspect ratio is nearest to its own (distance of log ratios, so 2:1 and 1:2
are equally far from 1:1); it is resized to cover the bucket and cropped (centered, or at a seeded random place).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

Size = tuple[int, int]  # (width, height) in pixels


@dataclass(frozen=True)
class BucketSpec:
    resolution: int
    step: int = 64
    max_aspect: float = 4.0
    min_side: int | None = None
    max_side: int | None = None

    @classmethod
    def from_config(cls, data) -> BucketSpec:
        return cls(data.resolution, data.bucket_step, data.bucket_max_aspect, data.bucket_min_side,
                   data.bucket_max_side)


def bucket_resolutions(spec: BucketSpec) -> list[Size]:
    """Every bucket (width, height), sorted by aspect ratio (tallest first). Never empty: the square bucket
    (the resolution rounded down to `step`, at least `step`) is always there."""
    res, step = spec.resolution, spec.step
    area = res * res
    lo = spec.min_side or step
    hi = spec.max_side or _floor(int(res * math.sqrt(spec.max_aspect)), step)
    square = max(step, _floor(res, step))
    sizes = {(square, square)}
    width = max(step, _ceil(lo, step))
    while width <= hi:
        height = min(hi, _floor(area // width, step))
        if height >= lo and height >= step and max(width, height) <= spec.max_aspect * min(width, height) + 1e-9:
            sizes.add((width, height))
            sizes.add((height, width))
        width += step
    return sorted(sizes, key=lambda s: (s[0] / s[1], s[0]))


def nearest_bucket(width: int, height: int, buckets: list[Size]) -> int:
    """Index of the bucket whose aspect ratio is nearest to width:height (log-ratio distance; on a tie, the
    bucket with the larger area)."""
    ratio = math.log(width / height)
    return min(range(len(buckets)),
               key=lambda i: (round(abs(math.log(buckets[i][0] / buckets[i][1]) - ratio), 9),
                              -buckets[i][0] * buckets[i][1]))


def assign_buckets(sizes: list[Size], spec: BucketSpec) -> tuple[list[Size], list[int]]:
    """(the buckets that hold at least one image, each image's index into that list)."""
    every = bucket_resolutions(spec)
    chosen = [nearest_bucket(w, h, every) for w, h in sizes]
    used = sorted(set(chosen))
    where = {b: i for i, b in enumerate(used)}
    return [every[b] for b in used], [where[b] for b in chosen]


def cover_and_crop(width: int, height: int, target: Size) -> tuple[Size, Size]:
    """(resized (w, h), room (dx, dy)): the image scaled to cover `target` (aspect kept), and how far a crop
    of `target` can move in it. For a square target this is the short side resized to the target side."""
    tw, th = target
    scale = max(tw / width, th / height)
    size = (max(tw, round(width * scale)), max(th, round(height * scale)))
    return size, (size[0] - tw, size[1] - th)


def bucket_counts(sizes: list[Size], spec: BucketSpec) -> list[tuple[int, int, int]]:
    """[(width, height, images)] of the used buckets, the fullest first: what the plan lists."""
    buckets, index = assign_buckets(sizes, spec)
    counts = Counter(index)
    rows = [(w, h, counts[i]) for i, (w, h) in enumerate(buckets)]
    return sorted(rows, key=lambda r: (-r[2], r[0] / r[1]))


def describe(rows) -> str:
    """`1024x1024 (12), 832x1216 (5)`."""
    return ", ".join(f"{w}x{h} ({n})" for w, h, n in rows)


def _floor(value: int, step: int) -> int:
    return value // step * step


def _ceil(value: int, step: int) -> int:
    return -(-value // step) * step
