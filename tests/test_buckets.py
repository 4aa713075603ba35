"""Aspect-ratio buckets: the bucket shapes, each image's bucket, the plan's list, and the bucketed batch stream
(every optimizer step from one bucket, the same samples for every process layout and after a resume). Torch-free
and fast; the families' side (shapes, latent cache, SDXL conditioning, FLUX packing) is in test_bucketing_families."""

import math
from collections import Counter

import pytest
from PIL import Image

from trainer.core.config import load_config
from trainer.core.data.buckets import BucketSpec, assign_buckets, bucket_counts, bucket_resolutions, cover_and_crop
from trainer.core.data.stream import BatchStream, BucketedStream, make_stream


def test_bucket_shapes_keep_the_area_the_step_and_the_aspect_limit():
    buckets = bucket_resolutions(BucketSpec(1024, 64, 4.0))
    assert (1024, 1024) in buckets and (832, 1216) in buckets and (1216, 832) in buckets
    for w, h in buckets:
        assert w % 64 == 0 and h % 64 == 0
        assert 0.9 * 1024**2 <= w * h <= 1024**2
        assert max(w, h) <= 4 * min(w, h)
        assert (h, w) in buckets  # both orientations
    assert max(max(b) for b in buckets) == 2048 and min(min(b) for b in buckets) == 512
    limited = bucket_resolutions(BucketSpec(1024, 64, 4.0, min_side=768, max_side=1280))
    assert limited and all(768 <= side <= 1280 for b in limited for side in b)
    assert bucket_resolutions(BucketSpec(1024, 64, 1.0)) == [(1024, 1024)]


def test_each_image_goes_to_the_bucket_of_nearest_aspect_ratio():
    spec = BucketSpec(1024, 64)
    every = bucket_resolutions(spec)
    sizes = [(1920, 1080), (1080, 1920), (3000, 3000), (500, 500), (4000, 500), (1200, 800)]
    buckets, index = assign_buckets(sizes, spec)
    chosen = [buckets[i] for i in index]
    assert chosen[:4] == [(1344, 768), (768, 1344), (1024, 1024), (1024, 1024)]
    assert chosen[4] == (2048, 512)  # 8:1 goes to the most elongated bucket allowed (4:1)
    for (w, h), (bw, bh) in zip(sizes, chosen):  # nearest by log-ratio distance, whatever the image's size
        best = min(abs(math.log(x / y) - math.log(w / h)) for x, y in every)
        assert abs(math.log(bw / bh) - math.log(w / h)) == pytest.approx(best)
    assert sorted(set(index)) == list(range(len(buckets)))  # only used buckets are listed
    assert bucket_counts(sizes, spec)[0] == (1024, 1024, 2)


def test_cover_and_crop_matches_the_square_case_and_covers_a_bucket():
    assert cover_and_crop(96, 64, (64, 64)) == ((96, 64), (32, 0))
    assert cover_and_crop(1920, 1080, (1344, 768)) == ((1365, 768), (21, 0))
    (w, h), (dx, dy) = cover_and_crop(700, 1500, (768, 1344))
    assert w >= 768 and h >= 1344 and (dx, dy) == (w - 768, h - 1344)


def _global_batch(stream, step):
    out = []
    for micro in range(stream.accumulation):
        for rank in range(stream.world_size):
            out += [(p, stream.item(p)) for p in stream.positions(step, micro, rank)]
    return sorted(out)


# item -> bucket: bucket 0 has 5 items, 1 has 3, 2 has 1 (fewer than a batch), 3 has 8; interleaved in the list
BUCKETS = [0, 1, 3, 0, 2, 3, 0, 1, 3, 3, 0, 3, 1, 3, 0, 3, 3]


def test_bucketing_puts_every_batch_in_one_bucket():
    stream = BucketedStream(BUCKETS, total=4, per_device=1, world_size=2, seed=7)
    assert stream.steps_per_epoch == 2 + 1 + 1 + 2
    for step in range(5 * stream.steps_per_epoch):
        bucket = stream.bucket_of_step(step)
        for micro in range(stream.accumulation):
            for rank in range(stream.world_size):
                items = [stream.item(p)[1] for p in stream.positions(step, micro, rank)]
                assert {BUCKETS[i] for i in items} == {bucket}
        assert {BUCKETS[i] for _, (_, i) in _global_batch(stream, step)} == {bucket}
    # every bucket gets its steps each epoch, in an order that changes between epochs
    per_epoch = [[stream.bucket_of_step(e * 6 + s) for s in range(6)] for e in range(4)]
    assert all(Counter(order) == {0: 2, 1: 1, 2: 1, 3: 2} for order in per_epoch)
    assert len({tuple(order) for order in per_epoch}) > 1


def test_short_buckets_are_filled_by_wrapping_around_so_every_image_trains_each_epoch():
    stream = BucketedStream(BUCKETS, total=4, per_device=4, world_size=1, seed=1)
    assert stream.small_buckets() == {1: 3, 2: 1}
    for epoch in range(3):
        seen = [stream.item(p) for p in range(epoch * 24, (epoch + 1) * 24)]
        assert {e for e, _ in seen} == {epoch}
        counts = Counter(i for _, i in seen)
        assert set(counts) == set(range(len(BUCKETS)))  # no image left out
        by_bucket = Counter(BUCKETS[i] for _, i in seen)
        assert by_bucket == {0: 8, 1: 4, 2: 4, 3: 8}  # each bucket padded to whole steps, from its own images
        assert all(counts[i] == 1 for i, b in enumerate(BUCKETS) if b == 3)  # a full bucket: each image once
        assert max(counts[i] for i, b in enumerate(BUCKETS) if b == 0) == 2  # 5 images fill 8 slots: 3 twice
    assert stream.epoch_at(6) == 1.0 and stream.epoch_at(3) == 0.5


@pytest.mark.parametrize("per_device, world", [(2, 1), (1, 2), (2, 2), (1, 4), (4, 1)])
def test_every_layout_trains_on_the_same_samples_per_step(per_device, world):
    reference = BucketedStream(BUCKETS, total=4, per_device=4, world_size=1, seed=3)
    stream = BucketedStream(BUCKETS, total=4, per_device=per_device, world_size=world, seed=3)
    for step in range(20):
        mine = _global_batch(stream, step)
        assert mine == _global_batch(reference, step)
        assert [p for p, _ in mine] == list(range(step * 4, step * 4 + 4))  # positions: per-sample seeds as before


def test_a_resumed_stream_continues_with_the_same_samples():
    uninterrupted = BucketedStream(BUCKETS, total=4, per_device=2, world_size=2, seed=5)
    expected = [_global_batch(uninterrupted, s) for s in range(30)]
    for resume_at in (0, 4, 13):  # a new process (fresh caches), another layout
        resumed = make_stream(len(BUCKETS), item_buckets=list(BUCKETS), total=4, per_device=1, world_size=1, seed=5)
        assert [_global_batch(resumed, s) for s in range(resume_at, 30)] == expected[resume_at:]
    other_seed = BucketedStream(BUCKETS, total=4, per_device=4, world_size=1, seed=6)
    assert [_global_batch(other_seed, s) for s in range(30)] != expected


def test_make_stream_is_plain_without_buckets():
    assert type(make_stream(10, total=4, per_device=2, world_size=2, seed=0)) is BatchStream
    with pytest.raises(ValueError):
        make_stream(10, item_buckets=[0] * 9, total=4, per_device=2, world_size=2, seed=0)
    with pytest.raises(ValueError):
        BucketedStream([0, 1], total=6, per_device=4, world_size=1, seed=0)


def _images(folder, sizes):
    folder.mkdir(parents=True, exist_ok=True)
    for n, (w, h) in enumerate(sizes):
        Image.new("RGB", (w, h), (40 * n % 255, 80, 120)).save(folder / f"{n:02d}.png")
        (folder / f"{n:02d}.txt").write_text(f"picture {n}")
    return folder


def test_the_plan_lists_the_buckets(tmp_path):
    from trainer.core.family_spec import check_captioned_images
    from trainer.core.hardware import CPU_ONLY
    from trainer.core.plan import Plan, make_plan

    data = _images(tmp_path / "data", [(64, 64), (64, 64), (96, 48), (48, 96), (100, 50), (64, 60)])
    config = load_config(None, ["model.path=x", f"data.path={data}", "data.resolution=64", "data.bucketing=true",
                                "data.bucket_step=16", "devices=cpu:1", "batch.total=2", "batch.per_device=2"],
                         check_paths=False)
    plan = make_plan(config, CPU_ONLY).with_buckets(config, check_captioned_images(config))
    assert plan.buckets == ((64, 64, 3), (80, 48, 2), (48, 80, 1))
    assert plan.line().endswith(" · buckets 64x64 (3), 80x48 (2), 48x80 (1)")
    assert any("48x80 (1)" in note for note in plan.notes)  # fewer images than the batch: said before the run
    event = plan.event()
    assert event["buckets"][0] == {"width": 64, "height": 64, "images": 3}
    assert Plan.from_event(event) == plan
    off = load_config(None, ["model.path=x", f"data.path={data}", "devices=cpu:1"], check_paths=False)
    plain = make_plan(off, CPU_ONLY)
    assert plain.with_buckets(off, check_captioned_images(off)) == plain and "buckets" not in plain.line()


def test_bucket_keys_are_validated():
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=x", "data.bucketing=true", "data.bucket_step=20", "data.bucket_max_aspect=0.5",
                           "data.bucket_min_side=900", "data.bucket_max_side=800"], check_paths=False)
    text = str(err.value)
    for key in ("data.bucket_step", "data.bucket_max_aspect", "data.bucket_min_side (900) is larger"):
        assert key in text, text
    with pytest.raises(ConfigError, match="multiples of 16"):
        load_config(None, ["model.path=x", "model.family=flux", "data.bucketing=true", "data.bucket_step=24"],
                    check_paths=False)
    load_config(None, ["model.path=x", "model.family=flux", "data.bucketing=true", "data.bucket_step=16"],
                check_paths=False)
