"""A deterministic judge of what a demo sample shows: which shape, in which colour.

The demos' world is one coloured shape on a plain background (components/shapes.py), so a few lines of
geometry read a sample reliably, with no weights to ship or train:
  1. the background colour is the median of the image's border;
  2. the foreground is what differs from it by more than half the contrast of the shape's own colour
     (antialiased edges count half-way, as a person would see them), its largest connected part kept;
  3. the colour is the palette colour nearest to the foreground's median;
  4. the shape follows from two ratios: solidity (area / convex-hull area: a five-pointed star fills about
     0.56 of its hull, the convex shapes about 1.0) and fill (area / bounding-box area: a square 1.0, a circle
     pi/4, a triangle 0.5).
Its accuracy on held-out generated images is measured in tests/test_shape_score.py.

Torch-free (numpy + PIL).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from PIL import Image

from trainer.families.components.shapes import COLOURS

MIN_AREA = 0.015        # a foreground under 1.5% of the image is no shape (a speck, noise)
MAX_COLOUR_DISTANCE = 90.0  # RGB distance from the nearest palette colour beyond which the colour is unknown
STAR_SOLIDITY = 0.78    # star ~0.56, convex shapes ~0.95-1.0 (measured on generated images)
SQUARE_FILL = 0.88      # square ~0.97, circle ~0.79
CIRCLE_FILL = 0.64      # circle ~0.79, triangle ~0.52


class Reading(NamedTuple):
    """What the judge sees: `shape` and `colour` ("none" when there is no clear one) and the ratios behind."""
    shape: str
    colour: str
    area: float
    fill: float
    solidity: float

    def shows(self, what: str) -> bool:
        """`what` is "yellow star", "star" or "yellow": every word must match."""
        return all(word in (self.shape, self.colour) for word in what.split())


def read_image(image: Image.Image) -> Reading:
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    h, w, _ = pixels.shape
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    background = np.median(border, axis=0)
    distance = np.linalg.norm(pixels - background, axis=-1)
    clear = distance > 40.0
    if clear.sum() < MIN_AREA * h * w:
        return Reading("none", "none", float(clear.mean()), 0.0, 0.0)
    foreground_colour = np.median(pixels[clear], axis=0)
    contrast = float(np.linalg.norm(foreground_colour - background))
    mask = _largest_component(distance > contrast / 2)
    area = float(mask.sum())
    if area < MIN_AREA * h * w:
        return Reading("none", "none", area / (h * w), 0.0, 0.0)
    colour = _nearest_colour(np.median(pixels[mask], axis=0))
    ys, xs = np.nonzero(mask)
    fill = area / float((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    solidity = area / _hull_area(mask)
    if solidity < STAR_SOLIDITY:
        shape = "star"
    elif fill > SQUARE_FILL:
        shape = "square"
    elif fill > CIRCLE_FILL:
        shape = "circle"
    else:
        shape = "triangle"
    return Reading(shape, colour, area / (h * w), fill, solidity)


def fraction_showing(images: list[Image.Image], what: str) -> float:
    """The fraction of `images` that show `what` (0..1)."""
    return sum(read_image(image).shows(what) for image in images) / max(1, len(images))


def _nearest_colour(rgb: np.ndarray) -> str:
    name, distance = min(((n, float(np.linalg.norm(rgb - np.array(c)))) for n, c in COLOURS.items()),
                         key=lambda pair: pair[1])
    return name if distance <= MAX_COLOUR_DISTANCE else "none"


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected region of `mask` (a flood fill: demo samples are 64 px, a few thousand pixels)."""
    labels = np.zeros(mask.shape, dtype=np.int32)
    h, w = mask.shape
    best, best_size, current = 0, 0, 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if labels[y0, x0]:
            continue
        current += 1
        labels[y0, x0] = current
        stack, size = [(y0, x0)], 0
        while stack:
            y, x = stack.pop()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = current
                    stack.append((ny, nx))
        if size > best_size:
            best, best_size = current, size
    return labels == best


def _hull_area(mask: np.ndarray) -> float:
    """Area of the convex hull of the mask's pixel squares (their corners), by the monotone chain."""
    ys, xs = np.nonzero(mask)
    corners = {(int(x) + dx, int(y) + dy) for x, y in zip(xs, ys) for dx in (0, 1) for dy in (0, 1)}
    points = sorted(corners)
    if len(points) < 3:
        return 1.0

    def half(seq):
        chain: list[tuple[int, int]] = []
        for p in seq:
            while len(chain) >= 2 and _cross(chain[-2], chain[-1], p) <= 0:
                chain.pop()
            chain.append(p)
        return chain

    hull = half(points)[:-1] + half(reversed(points))[:-1]
    area = 0.0
    for (x1, y1), (x2, y2) in zip(hull, hull[1:] + hull[:1]):
        area += x1 * y2 - x2 * y1
    return max(abs(area) / 2, 1.0)


def _cross(o, a, b) -> int:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])
