"""Sample steps that measure: the concept and control scores of the scored prompts (`sample.concept`,
`sample.control`), and the strip one prompt's images are written as.

The demo is judged by what its samples show, not by its loss: a LoRA that has learnt "sks circle" draws a
yellow circle for it (the concept score rises from 0 towards 1) while the base's own prompts keep drawing what
they drew (the control score stays near 1). The judge is trainer.families.components.shape_score.
"""

from __future__ import annotations

from PIL import Image

from trainer.families.components.shape_score import fraction_showing


def prompt_scores(sample_cfg, samples: list[tuple[str, list[Image.Image]]]) -> dict[str, float]:
    """{"concept": fraction, "control": fraction} for the scored prompts that were drawn (0..1, 3 decimals)."""
    images = dict(samples)
    scores = {}
    for name in ("concept", "control"):
        scored = getattr(sample_cfg, name)
        if scored.prompt and scored.prompt in images:
            scores[name] = round(fraction_showing(images[scored.prompt], scored.shows), 3)
    return scores


def side_by_side(images: list[Image.Image], gap: int = 2) -> Image.Image:
    """One image, or several in a row on a white ground with a `gap` px gutter."""
    if len(images) == 1:
        return images[0]
    width = sum(image.width for image in images) + gap * (len(images) - 1)
    strip = Image.new("RGB", (width, max(image.height for image in images)), (255, 255, 255))
    x = 0
    for image in images:
        strip.paste(image.convert("RGB"), (x, 0))
        x += image.width + gap
    return strip
