"""The shapes judge that scores the demo's samples (trainer/families/components/shape_score.py): its accuracy on
held-out generated images, what it refuses to read, and how sample steps turn its readings into scores."""

import random

import numpy as np
import pytest
from PIL import Image

from trainer.core.config.load import build_config
from trainer.engine.scoring import prompt_scores, side_by_side
from trainer.families.components.shape_score import fraction_showing, read_image
from trainer.families.components.shapes import BACKGROUNDS, COLOURS, SHAPES, Scene, draw_scene, random_scene


def _config(raw):
    config, problems = build_config(raw)
    assert not problems, problems
    return config


@pytest.mark.slow  # generates and judges a held-out set (~6 s)
def test_the_judge_reads_held_out_generated_images_correctly():
    # Measured: 1.000 on these 600 scenes (seed 2024, never used to tune the thresholds, which were set on seed 123).
    rng = random.Random(2024)
    scenes = [random_scene(rng, colours=tuple(COLOURS), shapes=SHAPES, min_extent=0.3, max_extent=0.75)
              for _ in range(600)]
    readings = [read_image(draw_scene(scene, 64)) for scene in scenes]
    correct = [r.shape == s.shape and r.colour == s.colour for s, r in zip(scenes, readings)]
    assert np.mean(correct) >= 0.99
    for shape in SHAPES:  # no class is carried by the others
        assert np.mean([c for s, c in zip(scenes, correct) if s.shape == shape]) >= 0.97


def test_it_reads_every_colour_on_every_background():
    for colour in COLOURS:
        for background in BACKGROUNDS:
            reading = read_image(draw_scene(Scene(colour, "star", background, 0.6, 0.2, 0.2, (0, 0, 0)), 64))
            assert (reading.colour, reading.shape) == (colour, "star"), (colour, background, reading)


def test_an_empty_or_speck_image_shows_nothing():
    assert read_image(Image.new("RGB", (64, 64), (245, 245, 245))).shape == "none"
    speck = Image.new("RGB", (64, 64), (245, 245, 245))
    speck.paste((215, 45, 45), (30, 30, 33, 33))
    assert read_image(speck).shows("red") is False


def test_scores_count_the_fraction_of_a_prompts_images_that_show_it():
    star = draw_scene(Scene("yellow", "star", "white", 0.6, 0.2, 0.2, (0, 0, 0)), 64)
    circle = draw_scene(Scene("red", "circle", "white", 0.6, 0.2, 0.2, (0, 0, 0)), 64)
    assert fraction_showing([star, circle, star, star], "yellow star") == 0.75
    cfg = _config({"sample": {
        "concept": {"prompt": "a photo of a sks star", "shows": "yellow star"},
        "control": {"prompt": "a photo of a red circle", "shows": "red circle"}}})
    samples = [("a photo of a sks star", [star, circle]), ("a photo of a red circle", [circle, circle])]
    assert prompt_scores(cfg.sample, samples) == {"concept": 0.5, "control": 1.0}
    assert prompt_scores(_config({}).sample, samples) == {}  # nothing scored unless asked


def test_a_prompts_images_are_written_side_by_side():
    images = [Image.new("RGB", (64, 48), c) for c in ("red", "green", "blue")]
    strip = side_by_side(images, gap=2)
    assert strip.size == (3 * 64 + 2 * 2, 48)
    assert strip.getpixel((64 + 2, 0)) == (0, 128, 0) and strip.getpixel((64, 0)) == (255, 255, 255)
    assert side_by_side(images[:1]) is images[0]


@pytest.mark.parametrize("sample, message", [
    ({"concept": {"prompt": "a photo of sks"}}, "sample.concept: set both"),
    ({"control": {"prompt": "a dog", "shows": "brown dog"}}, "does not read 'brown', 'dog'"),
    ({"images_per_prompt": 0}, "sample.images_per_prompt"),
])
def test_scored_prompts_are_validated(sample, message):
    from trainer.core.config.validate import validate

    problems = validate(_config({"sample": sample}), check_paths=False)
    assert any(message in p for p in problems), problems


def test_every_sample_prompt_gets_its_images_from_fixed_seeds_and_scored_prompts_are_drawn_once():
    from trainer.families.components.trained_weights import render_prompt_samples

    calls = []

    def sample(prompts, seeds, **options):
        calls.append((prompts, seeds, options["size"]))
        return [Image.new("RGB", (8, 8), (seed, 0, 0)) for seed in seeds]

    cfg = _config({"sample": {"prompts": ["a", "b"], "images_per_prompt": 3, "seed": 10,
                              "concept": {"prompt": "c", "shows": "yellow star"},
                              "control": {"prompt": "a", "shows": "red circle"}}})
    drawn = render_prompt_samples(cfg.sample, sample, (8, 8))
    assert [prompt for prompt, _ in drawn] == ["a", "b", "c"]  # the control prompt is already among the prompts
    assert calls == [(["a"] * 3 + ["b"] * 3 + ["c"] * 3, list(range(10, 19)), (8, 8))]
    assert [[im.getpixel((0, 0))[0] for im in images] for _, images in drawn] == [[10, 11, 12], [13, 14, 15],
                                                                                   [16, 17, 18]]
