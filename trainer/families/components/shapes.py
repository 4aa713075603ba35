"""The generated world of the offline demos: coloured shapes on plain backgrounds, drawn from a seed.

One drawing function serves everything that needs these images: the tiny base model's pretraining set
(`trainer.families.sd.tiny_base`), the demo datasets, and the held-out images the shape scorer is measured on.
The pretraining set leaves out `UNSEEN_SHAPES` and `UNSEEN_COLOURS` on purpose: the demo's LoRA teaches one of
them (yellow, on a circle), so the base model must never have seen it.

Torch-free (PIL + numpy): the torch-free core and the UI may draw these too.
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple

from PIL import Image, ImageDraw

# The colour and shape words are core's data (validation checks `sample.*.shows` against them); drawn here.
from trainer.core.config.shape_words import COLOURS, SHAPES

BACKGROUNDS: dict[str, tuple[int, int, int]] = {"white": (245, 245, 245), "gray": (135, 135, 135), "black": (25, 25, 25)}

UNSEEN_SHAPES = ("star",)
UNSEEN_COLOURS = ("yellow",)
BASE_SHAPES = tuple(s for s in SHAPES if s not in UNSEEN_SHAPES)
BASE_COLOURS = tuple(c for c in COLOURS if c not in UNSEEN_COLOURS)

_SUPERSAMPLE = 4  # draw large then downscale: PIL's polygon/ellipse drawing has no antialiasing


class Scene(NamedTuple):
    """What one image shows, and where (`extent`, `x0`, `y0` as fractions of the image side)."""
    colour: str
    shape: str
    background: str
    extent: float
    x0: float
    y0: float
    jitter: tuple[int, int, int]

    def caption(self, subject: str | None = None) -> str:
        """"a photo of a red circle on a white background"; `subject` replaces "red circle" (e.g. "sks circle")."""
        return f"a photo of a {subject or f'{self.colour} {self.shape}'} on a {self.background} background"


def random_scene(rng: random.Random, *, colours=BASE_COLOURS, shapes=BASE_SHAPES, backgrounds=tuple(BACKGROUNDS),
                 min_extent: float = 0.35, max_extent: float = 0.7) -> Scene:
    """A scene drawn from `rng`: one of `colours` x `shapes` x `backgrounds`, a random size and position
    (the whole shape inside the image) and a little colour jitter."""
    colour, shape, background = rng.choice(colours), rng.choice(shapes), rng.choice(backgrounds)
    extent = rng.uniform(min_extent, max_extent)
    x0, y0 = rng.uniform(0.04, 0.96 - extent), rng.uniform(0.04, 0.96 - extent)
    jitter = (rng.randint(-15, 15), rng.randint(-15, 15), rng.randint(-15, 15))
    return Scene(colour, shape, background, extent, x0, y0, jitter)


def draw_scene(scene: Scene, size: int) -> Image.Image:
    """The scene as a `size` x `size` RGB image (antialiased by supersampling)."""
    big = size * _SUPERSAMPLE
    fill = tuple(min(255, max(0, c + j)) for c, j in zip(COLOURS[scene.colour], scene.jitter))
    image = Image.new("RGB", (big, big), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(image)
    extent, x0, y0 = scene.extent * big, scene.x0 * big, scene.y0 * big
    box = (x0, y0, x0 + extent, y0 + extent)
    if scene.shape == "circle":
        draw.ellipse(box, fill=fill)
    elif scene.shape == "square":
        draw.rectangle(box, fill=fill)
    elif scene.shape == "triangle":
        draw.polygon([(x0 + extent / 2, y0), (x0 + extent, y0 + extent), (x0, y0 + extent)], fill=fill)
    elif scene.shape == "star":
        draw.polygon(star_points(x0 + extent / 2, y0 + extent / 2, extent / 2), fill=fill)
    else:
        raise ValueError(f"unknown shape {scene.shape!r}; the shapes are {', '.join(SHAPES)}")
    return image.resize((size, size), Image.Resampling.LANCZOS)


def star_points(cx: float, cy: float, radius: float, inner: float = 0.45) -> list[tuple[float, float]]:
    """A five-pointed star, point up: ten vertices alternating between `radius` and `inner` x `radius`."""
    points = []
    for k in range(10):
        r = radius if k % 2 == 0 else radius * inner
        angle = -math.pi / 2 + k * math.pi / 5
        points.append((cx + r * math.cos(angle), cy + r * math.sin(angle)))
    return points
