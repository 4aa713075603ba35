"""CaptionedLatents, the data side the diffusion families hold, on its own (no model: a stand-in VAE and a stand-in
image generator): prior-preservation class images are generated through the callback it is given, the micro-batch
rows pair each position with its instance item and a cycling class image, the prior loss is weighted, and cached
and uncached latents agree. What a family adds on top is in test_sdxl, test_bucketing_families, test_flux_sd3."""

from types import SimpleNamespace

import pytest
import torch
from PIL import Image, ImageDraw

from trainer.core.config import load_config
from trainer.core.hardware import CPU_ONLY
from trainer.core.plan import make_plan
from trainer.families.components.captioned_latents import CaptionedLatents
from trainer.families.protocol import WorkerContext


class _VAE:  # downsamples by 8 and reports a unit std: enough to tell images, flips and crops apart
    config = {"scaling_factor": 1.0}
    dtype = torch.float32

    def encode(self, pixels):
        mean = torch.nn.functional.avg_pool2d(pixels, 8)
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=mean, std=torch.ones_like(mean)))


class _Accelerator:
    def wait_for_everyone(self):
        pass


@pytest.fixture
def data(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for n in range(3):
        img = Image.new("RGB", (64, 64), (235, 235, 235))
        ImageDraw.Draw(img).ellipse((8 * n, 8, 40 + 8 * n, 56), fill=(200, 40, 40))
        img.save(folder / f"img{n}.png")
        (folder / f"img{n}.txt").write_text(f"circle {n}")
    return folder


def _latents(tmp_path, data, *overrides, draw=None):
    config = load_config(None, ["model.path=stand-in/model", f"data.path={data}", "data.resolution=32", "precision=fp32", "devices=cpu:1",
                                "batch.total=2", "batch.per_device=2", f"prior.class_path={tmp_path / 'class'}",
                                "prior.class_prompt=a circle", "prior.num_class_images=2", "prior.sample_steps=3",
                                *overrides], check_paths=False)  # no model: nothing loads one
    warnings: list[str] = []
    ctx = WorkerContext(config, make_plan(config, CPU_ONLY), tmp_path / "run", tmp_path / "cache",
                        torch.device("cpu"), 0, 1, _Accelerator(), warnings.append)
    latents = CaptionedLatents(ctx, _VAE(), draw_class_images=draw)
    return latents, latents.prepare(), warnings


def test_class_images_come_from_the_callback_and_the_prior_loss_is_weighted(tmp_path, data):
    calls = []

    def draw(prompts, seeds, *, steps, size):
        calls.append((prompts, seeds, steps, size))
        return [Image.new("RGB", (size, size), (seeds[0] * 40 % 255, 90, 90))]

    latents, count, warnings = _latents(tmp_path, data, "prior.enabled=true", "prior.loss_weight=0.5", draw=draw)
    assert count == 3 and len(latents.class_images) == 2
    assert calls == [(["a circle"], [0], 3, 32), (["a circle"], [1], 3, 32)]  # seed + i, the prior's steps
    assert any("generating 2 class images" in w for w in warnings)
    assert latents.class_latents is not None and latents.caption(1, "class") == "a circle"

    instance, prior = latents.rows([(4, 1, 2), (5, 1, 0)])
    assert instance == [(4, 1, 2, 2, "instance"), (5, 1, 0, 0, "instance")]
    assert prior == [(4, 2, 0, 0, "class"), (5, 2, 1, 1, "class")]  # one pass over the class images per "epoch"

    streams = []

    def rows_loss(rows, stream):
        streams.append(stream)
        return torch.full((len(rows),), 1.0 if stream == 0 else 4.0)

    assert float(latents.loss([(4, 1, 2), (5, 1, 0)], rows_loss)) == 1.0 + 0.5 * 4.0
    assert streams == [0, 1]

    again, _, warnings = _latents(tmp_path, data, "prior.enabled=true", draw=lambda *a, **k: pytest.fail("drew"))
    assert not any("generating" in w for w in warnings)  # the class folder is full: nothing is drawn


def test_without_a_prior_there_are_no_class_rows_and_cached_latents_match_fresh_ones(tmp_path, data):
    cached, _, _ = _latents(tmp_path, data, "data.flip=true")
    assert cached.use_cache and cached.class_images == [] and cached.rows([(0, 0, 1)])[1] == []
    fresh, _, _ = _latents(tmp_path / "fresh", data, "data.flip=true", "data.cache_latents=false")
    assert not fresh.use_cache and fresh.latents is None
    for epoch in range(3):  # the flip coin of each (epoch, index) picks the same cached row as a fresh encode
        for index in range(3):
            mean, std = cached.latent_dist(index, epoch, index, "instance")
            fresh_mean, _ = fresh.latent_dist(index, epoch, index, "instance")
            torch.testing.assert_close(mean, fresh_mean)
            assert mean.shape == (3, 4, 4) and torch.all(std == 1)


def test_caches_are_keyed_by_the_weights_not_only_by_the_config_and_path():
    # A model folder retrained or re-downloaded in place keeps its path and config: its old latents (or text
    # embeddings) must not come back.
    from trainer.families.components.latent_cache import cache_key, weights_fingerprint

    torch.manual_seed(0)
    vae = torch.nn.Conv2d(3, 4, 3)
    before = weights_fingerprint(vae)
    assert weights_fingerprint(vae) == before  # stable
    with torch.no_grad():
        vae.weight[0, 0, 0, 0] += 1e-4
    after = weights_fingerprint(vae)
    assert after != before
    assert cache_key({"weights": before}, []) != cache_key({"weights": after}, [])
