"""sample.width / sample.height: samples need not be square, and a bucketed run samples at the shape it trains
most (it drew only squares before)."""

from types import SimpleNamespace

import pytest
from PIL import Image

from tests.engine_helpers import engine_config, launch, log_of
from trainer.core.config import load_config
from trainer.core.events import read_events
from trainer.errors import ConfigError
from trainer.families.components.trained_weights import pixel_size, sample_shape


def _sample(size=None, width=None, height=None):
    return SimpleNamespace(size=size, width=width, height=height)


def test_the_sample_shape_rule():
    assert sample_shape(_sample(), 512) == (512, 512)
    assert sample_shape(_sample(size=768), 512) == (768, 768)
    assert sample_shape(_sample(size=768, width=1024), 512) == (1024, 768)
    buckets, items = [(512, 512), (640, 384), (384, 640)], [0, 1, 1, 2, 1, 0]
    assert sample_shape(_sample(), 512, buckets, items) == (640, 384)  # the bucket most items train at
    assert sample_shape(_sample(height=448), 512, buckets, items) == (640, 448)
    assert sample_shape(_sample(size=256), 512, buckets, items) == (256, 256)  # an explicit size wins
    assert pixel_size((640, 384), 512) == (640, 384) and pixel_size(None, 512) == (512, 512)


def test_sample_sides_must_suit_the_family():
    with pytest.raises(ConfigError, match="sample.width: must be a multiple of 16 for flux, got 72"):
        load_config(None, ["model.family=flux", "sample.width=72"], check_paths=False)
    assert load_config(None, ["sample.width=72", "sample.height=40"], check_paths=False).sample.width == 72


@pytest.mark.slow
def test_samples_are_drawn_at_sample_width_and_height(tmp_path, tiny_sd_path, demo_data_path):
    config = engine_config(tiny_sd_path, demo_data_path, "devices=cpu:1", "train.steps=1", "sample.steps=2",
                           "sample.prompts=[a red circle]", "sample.width=64", "sample.height=32")
    run_dir, final = launch(tmp_path, config)
    assert final["type"] == "done", log_of(run_dir)
    paths = [run_dir / e["path"] for e in read_events(run_dir) if e["type"] == "sample"]
    assert paths and all(Image.open(p).size == (64, 32) for p in paths)
