"""The words of the offline demos' world (coloured shapes on plain backgrounds), as data: what
`sample.concept.shows` / `sample.control.shows` may say, checked by validation, and the colours the demos draw
(trainer.families.components.shapes) and the shapes judge reads (trainer.families.components.shape_score).

Here in core so that validation names them without importing a family's drawing code."""

from __future__ import annotations

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 45, 45),
    "green": (40, 165, 65),
    "blue": (45, 85, 215),
    "purple": (140, 60, 180),
    "yellow": (240, 200, 30),
}
SHAPES = ("circle", "square", "triangle", "star")
