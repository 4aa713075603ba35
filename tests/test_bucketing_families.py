"""Aspect-ratio buckets in the diffusion families, in process on the tiny offline models (CPU): a dataset of mixed
aspect ratios trains batch by batch from the bucketed stream, every batch's latents share one shape, the latent
cache is built per bucket and used (the VAE is not called again), SDXL's size/crop conditioning uses each image's
real size and its bucket, FLUX packs non-square latents. The stream's own invariants are in test_buckets."""

import math

import pytest
import torch
from PIL import Image, ImageDraw

from trainer.core.config import load_config
from trainer.core.data.stream import make_stream

SIZES = [(64, 64), (64, 64), (96, 48), (96, 48), (48, 96), (48, 96)]  # -> buckets 64x64, 80x48, 48x80 at step 16


@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixed-data")
    colours = [(200, 40, 40), (40, 40, 200)]
    for n, (w, h) in enumerate(SIZES):
        img = Image.new("RGB", (w, h), (235, 235, 235))
        ImageDraw.Draw(img).ellipse((w * 0.2, h * 0.2, w * 0.8, h * 0.8), fill=colours[n % 2])
        img.save(folder / f"img{n}.png")
        (folder / f"img{n}.txt").write_text(f"a photo of a {'red' if n % 2 == 0 else 'blue'} circle")
    return folder


@pytest.fixture(scope="module")
def models(tiny_sdxl_path, tiny_flux_path):
    return {"sdxl": tiny_sdxl_path, "flux": tiny_flux_path}


class _Accelerator:  # what a family uses of accelerate's, for one process
    def wait_for_everyone(self):
        pass

    def unwrap_model(self, model):
        return model


EXTRA = {"sd": [], "sdxl": [], "flux": ["flow.max_sequence_length=16"], "sd3": ["flow.max_sequence_length=16"]}


def make_family(tmp_path, name, model, data, *overrides):
    from trainer.families import get_family
    from trainer.families.protocol import WorkerContext
    from trainer.core.hardware import CPU_ONLY
    from trainer.core.plan import make_plan

    config = load_config(None, [f"model.path={model}", f"model.family={name}", f"data.path={data}",
                                "precision=fp32", "devices=cpu:1", "batch.total=2", "batch.per_device=2",
                                "data.resolution=64", "data.bucketing=true", "data.bucket_step=16", "data.flip=false",
                                "lora.rank=4", "lora.alpha=8", *EXTRA[name], *overrides])
    warnings = []
    ctx = WorkerContext(config, make_plan(config, CPU_ONLY), tmp_path / "run", tmp_path / "cache",
                        torch.device("cpu"), 0, 1, _Accelerator(), warnings.append)
    family = get_family(name)(ctx)
    family.load()
    items = family.prepare_data()
    family.set_prepared(family.trainable_modules())
    family.warnings = warnings
    stream = make_stream(items, item_buckets=family.item_buckets, total=2, per_device=2, world_size=1,
                         seed=config.seed)
    return family, stream


def batch(stream, step):
    return [(p, *stream.item(p)) for p in stream.positions(step, 0, 0)]


def parts(family):
    """What holds the family's models and data: the family itself (SDXL) or its flow-matching trainer (FLUX)."""
    return getattr(family, "flow", family)


def spy_shapes(family) -> list:
    """Record the latent shape of every sample the family builds, batch by batch."""
    data = parts(family).data
    shapes, original = [], data.latent_dist

    def spy(*args):
        mean, std = original(*args)
        shapes.append(tuple(mean.shape))
        return mean, std

    data.latent_dist = spy
    return shapes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sdxl", "flux"])
def test_mixed_aspect_ratios_train_one_shape_per_batch_from_the_cache(tmp_path, models, mixed_data, name):
    family, stream = make_family(tmp_path, name, models[name], mixed_data)
    assert parts(family).data.buckets == [(48, 80), (64, 64), (80, 48)]
    assert stream.steps_per_epoch == 3 and family.warnings == []
    assert len(list((tmp_path / "cache" / "latents").iterdir())) == 3  # one cache per bucket (single-shape chunks)
    encodes = []
    parts(family).vae.encoder.register_forward_pre_hook(lambda *_: encodes.append(1))
    shapes = spy_shapes(family)

    def epoch_loss():
        with torch.no_grad():
            return sum(float(family.loss(batch(stream, s))) for s in range(stream.steps_per_epoch))

    before = epoch_loss()
    params = [p for g in family.param_groups() for p in g["params"]]
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0)
    seen = set()
    for step in range(3 * stream.steps_per_epoch):
        del shapes[:]
        loss = family.loss(batch(stream, step))
        assert math.isfinite(float(loss.detach()))
        assert len(set(shapes)) == 1, shapes  # one bucket per batch: the latents stack
        seen |= set(shapes)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = epoch_loss()
    channels = 4 if name == "sdxl" else 16
    assert seen == {(channels, 12, 20), (channels, 16, 16), (channels, 20, 12)}  # the tiny VAE downsamples by 4
    assert after < before, (before, after)
    assert encodes == []  # every latent came from the cache


@pytest.mark.slow
def test_sdxl_conditioning_and_uncached_crops_follow_the_bucket(tmp_path, models, mixed_data):
    from trainer.families.components.captioned import load_image_tensor, sample_rng

    family, stream = make_family(tmp_path, "sdxl", models["sdxl"], mixed_data, "data.center_crop=false")
    assert family.data.latents is None  # random crops: no latent cache
    wide = [i for i, item in enumerate(family.data.images) if (item.width, item.height) == (96, 48)][0]
    tall = [i for i, item in enumerate(family.data.images) if (item.width, item.height) == (48, 96)][0]
    family.cfg.data.center_crop, family.data.use_cache = True, True
    assert family.time_ids((0, 0, wide, 0, "instance")) == [48, 96, 0, 8, 48, 80]  # covers 80x48 at 96x48
    assert family.time_ids((0, 0, tall, 0, "instance")) == [96, 48, 8, 0, 80, 48]
    family.cfg.data.center_crop, family.data.use_cache = False, False
    lefts = set()
    for epoch in range(4):  # random crops are replayed from the sample's rng, inside its bucket
        _, _, top, left, th, tw = family.time_ids((0, epoch, wide, 3, "instance"))
        pixels = load_image_tensor(family.data.images[wide].path, (80, 48), crop="random", rng=sample_rng(0, epoch, 3))
        assert pixels.shape == (3, 48, 80) and (th, tw) == (48, 80) and top == 0
        lefts.add(left)
    assert len(lefts) > 1
    shapes = spy_shapes(family)
    for step in range(stream.steps_per_epoch):
        del shapes[:]
        assert math.isfinite(float(family.loss(batch(stream, step))))
        assert len(set(shapes)) == 1


def test_a_bucket_smaller_than_the_batch_is_named(tmp_path, models, mixed_data):
    family, stream = make_family(tmp_path, "sdxl", models["sdxl"], mixed_data, "batch.total=4",
                                 "batch.per_device=4")
    assert len(family.warnings) == 3 and all("fewer than batch.total 4" in w for w in family.warnings)
    assert "bucket 80x48 holds 2 images" in " ".join(family.warnings)


@pytest.mark.slow
def test_two_processes_match_one_process_with_buckets(tmp_path, models, mixed_data):
    """Through the real launcher (torchrun, gloo DDP): the plan lists the buckets, and 1 x 2 per device and
    2 processes x 1 per device train on the same single-bucket steps (same losses, same weights). SGD, as in
    test_sdxl's 1-vs-2 test."""
    import json

    from tests.engine_helpers import (
        assert_same_weights,
        final_weights,
        launch,
        log_of,
        progress,
    )

    base = [f"model.path={models['sdxl']}", "model.family=sdxl", f"data.path={mixed_data}", "precision=fp32",
            "batch.total=2", "train.steps=3", "train.optimizer=sgd", "train.lr=0.5", "sample.every=0",
            "checkpoint.every=0", "data.resolution=64", "data.bucketing=true", "data.bucket_step=16", "lora.rank=4",
            "lora.alpha=8"]
    one_dir, final = launch(tmp_path, load_config(None, [*base, "devices=cpu:1", "batch.per_device=2", "name=one"]))
    assert final["type"] == "done", log_of(one_dir)
    plan = json.loads((one_dir / "plan.json").read_text())
    assert [(b["width"], b["height"], b["images"]) for b in plan["buckets"]] == [(48, 80, 2), (64, 64, 2), (80, 48, 2)]
    assert "buckets 48x80 (2), 64x64 (2), 80x48 (2)" in plan["line"]
    two_dir, final = launch(tmp_path, load_config(None, [*base, "devices=cpu:2", "batch.per_device=1", "name=two"]))
    assert final["type"] == "done", log_of(two_dir)
    assert_same_weights(final_weights(one_dir), final_weights(two_dir))
    assert [e["loss"] for e in progress(one_dir)] == pytest.approx([e["loss"] for e in progress(two_dir)], rel=1e-5)
