"""Paired (instruction-edit) datasets, `data.control_path`: each training image's control image is found by file
name, gets exactly its target's resize, crop and flip, is cached like it, and a missing one is named before the run
starts; families that take no control image refuse the key with the reason."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from tests.test_caption_augment import _context
from tests.test_captioned_latents import _VAE
from trainer.core.config import load_config
from trainer.errors import ConfigError, UserError
from trainer.families import spec_of


@pytest.fixture
def pairs(tmp_path):
    """Three 80x64 targets (captioned) and their controls: the same pictures with the colour channels reversed, so
    a control placed exactly as its target has the target's pixels in reverse channel order."""
    data, controls = tmp_path / "data", tmp_path / "controls"
    data.mkdir()
    controls.mkdir()
    for n in range(3):
        img = Image.new("RGB", (80, 64), (235, 200, 20 * n))
        ImageDraw.Draw(img).ellipse((8 * n, 8, 40 + 8 * n, 56), fill=(200, 40, 90))
        img.save(data / f"img{n}.png")
        (data / f"img{n}.txt").write_text("make the background blue")
        r, g, b = img.split()
        Image.merge("RGB", (b, g, r)).save(controls / f"img{n}.jpg" if n == 2 else controls / f"img{n}.png",
                                           quality=100, subsampling=0)
    return data, controls


def _config(data, controls, *overrides):
    return load_config(None, ["model.family=flux_kontext", "model.path=stand-in/model", f"data.path={data}",
                              f"data.control_path={controls}", "data.resolution=32", "precision=fp32",
                              "devices=cpu:1", "batch.total=2", *overrides], check_paths=False)


def _data(tmp_path, config):
    from trainer.families.components.captioned_latents import CaptionedLatents

    data = CaptionedLatents(_context(tmp_path, config)[0], _VAE())
    data.prepare()
    return data


def test_each_control_gets_its_targets_random_crop_and_flip(tmp_path, pairs):
    data = _data(tmp_path, _config(*pairs, "data.center_crop=false", "data.flip=true"))
    assert not data.use_cache and [p.rsplit("/", 1)[1] for p in data.control_paths["instance"]] == \
        ["img0.png", "img1.png", "img2.jpg"]
    crops = set()
    for epoch in range(3):
        for index in range(2):  # the PNG pairs: exact pixels
            target, _ = data.latent_dist(index, epoch, index, "instance")
            control = data.control_latent(index, epoch, index, "instance")
            torch.testing.assert_close(control, target.flip(0))
            crops.add(float(target.sum()))
    assert len(crops) > 2, "the crops and flips differ between epochs"
    jpeg = data.control_latent(2, 0, 2, "instance")  # a control of another format pairs by its stem
    torch.testing.assert_close(jpeg, data.latent_dist(2, 0, 2, "instance")[0].flip(0), atol=0.02, rtol=0)


def test_the_text_pairs_are_each_images_captions_with_its_own_control(tmp_path, pairs):
    """What an edit family whose text encoder reads the control (Qwen-Image-Edit) caches and asks for: every
    caption a row may draw (the dropped one included) with that row's own control image."""
    data = _data(tmp_path, _config(*pairs, "data.caption_dropout=0.5"))
    controls = data.control_paths["instance"]
    assert sorted(data.caption_controls()) == sorted((caption, control) for control in controls
                                                     for caption in ("make the background blue", ""))
    rows = [(position, 0, index, index, "instance") for position, index in enumerate((2, 0, 1))]
    assert [data.row_control(row) for row in rows] == [controls[2], controls[0], controls[1]]
    assert all((data.row_caption(row), data.row_control(row)) in data.caption_controls() for row in rows)


def test_controls_are_cached_with_their_targets_flips_and_buckets(tmp_path, pairs):
    data = _data(tmp_path, _config(*pairs, "data.flip=true", "data.bucketing=true", "data.bucket_step=16",
                                   "data.val_split=0.34"))
    assert data.use_cache and data.buckets is not None and set(data.control_latents) == {"instance", "val"}
    for epoch in range(4):  # both sides of the flip, from the cache
        for index in range(2):
            target, _ = data.latent_dist(index, epoch, index, "instance")
            torch.testing.assert_close(data.control_latent(index, epoch, index, "instance"), target.flip(0),
                                       atol=0.02, rtol=0)
    held_out, _ = data.latent_dist(0, 0, 0, "val")
    torch.testing.assert_close(data.control_latent(0, 0, 0, "val"), held_out.flip(0), atol=0.02, rtol=0)


def test_missing_controls_are_named_before_the_run_starts(tmp_path, pairs):
    data, controls = pairs
    (controls / "img1.png").unlink()
    config = _config(data, controls)
    with pytest.raises(UserError, match=r"data.control_path: 1 of 3 images have no usable control image in .*"
                                        r"img1.png has none .*same file name"):
        spec_of("flux_kontext").run_data_check(config)  # the launcher's data check


def test_families_without_a_control_image_refuse_it_and_edit_families_require_it(tmp_path, pairs):
    with pytest.raises(ConfigError, match=r"data.control_path: flux takes no control image.*\(flux_kontext, "
                                          r"qwenimage_edit\): set model.family"):
        load_config(None, ["model.family=flux", "data.control_path=controls"], check_paths=False)
    with pytest.raises(ConfigError, match="data.control_path: flux_kontext trains instruction edits"):
        load_config(None, ["model.family=flux_kontext"], check_paths=False)


def test_the_loss_conditions_each_row_on_its_own_images_control(tmp_path, pairs):
    """FlowTransformerTrainer hands the family's forward, with each row, the control of that row's image, placed
    as that row's target (here: the target's latent in reverse channel order), normalized as the targets."""
    from trainer.families.flow.trainer import FlowTransformerTrainer

    config = _config(*pairs, "data.flip=true", "data.cache_latents=false")
    seen = {}

    class Model:  # the FlowModel hooks _rows_loss calls, recording what forward is given
        name = "stand-in"
        pipeline_class = None

        def normalize_latents(self, latents):
            return 2 * latents

        def shift(self, shape):
            return 1.0

        def text_key(self, caption, control):
            return caption

        def forward(self, model, noisy, sigmas, text):
            seen["control"] = text["control"]
            return noisy

    trainer = FlowTransformerTrainer(_context(tmp_path, config)[0], Model())
    trainer.data = _data(tmp_path, config)
    trainer._text = lambda captions: {}
    trainer.transformer = SimpleNamespace(dtype=torch.float32)
    rows = [(5, 3, 0, 0, "instance"), (6, 1, 2, 2, "instance")]  # (position, epoch, image, expanded, kind)
    trainer._rows_loss(rows, 0, trainer.transformer)
    for control, (_, epoch, image, expanded, _) in zip(seen["control"], rows):
        target, _ = trainer.data.latent_dist(image, epoch, expanded, "instance")
        torch.testing.assert_close(control, 2 * target.flip(0), atol=0.04, rtol=0)


def test_the_edit_demo_pairs_by_name_and_its_score_places_a_sample_between_control_and_target(tmp_path):
    from trainer.families.components.edit_pairs import INSTRUCTION, edit_score, make_edit_pairs

    targets = make_edit_pairs(tmp_path / "t", side="target", count=3, size=32)
    controls = make_edit_pairs(tmp_path / "c", side="control", count=3, size=32)
    assert sorted(p.name for p in controls.glob("*.png")) == sorted(p.name for p in targets.glob("*.png"))
    assert (targets / "0001.txt").read_text().strip() == INSTRUCTION
    for name in ("0000.png", "0001.png", "0002.png"):
        target, control = (torch.from_numpy(np.asarray(Image.open(f / name).convert("L"), dtype=np.float32))
                           for f in (targets, controls))
        shape = (target - control).abs() < 8  # where they agree: the shape, the same on both sides
        assert 0.05 < shape.float().mean() < 0.6
        assert target[~shape].mean() < 40 and control[~shape].mean() > 150  # black behind it, light before
    c, t = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    assert edit_score(t, c, t) == pytest.approx(1) and edit_score(c, c, t) == pytest.approx(-1)
    assert edit_score((c + t) / 2, c, t) == pytest.approx(0, abs=1e-6)
