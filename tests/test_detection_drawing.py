"""Prediction sees an image as a person does (EXIF orientation applied), and drawn labels stay readable."""

import torch
from PIL import Image

from trainer.families.detection.eval import PALETTE, _luminance, color, draw_boxes, text_color
from trainer.families.detection.predict import Detector


def _contrast(a: str, b: str) -> float:
    high, low = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def test_every_class_colour_gets_label_text_of_readable_contrast():
    assert all(_contrast(c, text_color(c)) >= 4.5 for c in PALETTE)  # WCAG AA for normal text


def test_a_label_on_a_shape_of_its_own_colour_is_readable():
    blue = color(3)
    rgb = torch.tensor([int(blue[i:i + 2], 16) for i in (1, 3, 5)], dtype=torch.uint8)
    image = rgb.view(3, 1, 1).expand(3, 64, 96).contiguous()  # a blue shape filling the picture
    drawn = draw_boxes(image, torch.tensor([[10.0, 20.0, 80.0, 60.0]]), [3], ["square 0.97"])
    assert text_color(blue) == "#ffffff"
    assert (drawn.min(0).values > 200).sum() > 20  # the label's (anti-aliased) letters, near white on the blue


def test_predict_applies_the_exif_orientation(tmp_path):
    img = Image.new("RGB", (40, 20), "white")
    exif = img.getexif()
    exif[0x0112] = 6  # stored sideways: shown rotated 90 degrees clockwise, as phones write it
    path = tmp_path / "phone.jpg"
    img.save(path, exif=exif)
    assert Detector._image(path).size == (20, 40)
    with Image.open(path) as opened:
        assert Detector._image(opened).size == (20, 40)
