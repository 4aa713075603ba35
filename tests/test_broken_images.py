"""A broken image never ends a run: every image is decoded once by the scan (trainer.core.data.integrity), and a
truncated or non-image file is skipped with a warning naming it, in the detection family (COCO with sizes
given, YOLO) and in the diffusion families alike."""

import io
import json

import numpy as np
import pytest
from PIL import Image

from tests.engine_helpers import engine_config, launch, log_of
from trainer.core.config import load_config
from trainer.core.data.integrity import decode_problem
from trainer.core.data.scan import scan_dataset
from trainer.core.events import read_events
from trainer.families.detection.data import scan_detection


def _encoded(fmt: str, size=64) -> bytes:
    pixels = (np.random.default_rng(0).random((size, size, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def test_truncated_and_fake_images_are_found_and_good_ones_pass(tmp_path):
    for fmt, suffix in (("JPEG", "jpg"), ("PNG", "png"), ("WEBP", "webp")):
        good, cut = tmp_path / f"good.{suffix}", tmp_path / f"cut.{suffix}"
        good.write_bytes(_encoded(fmt))
        cut.write_bytes(_encoded(fmt)[: len(_encoded(fmt)) * 2 // 3])
        if fmt != "WEBP":  # (PIL's WebP reader parses the whole file on open)
            with Image.open(cut) as header_only:
                assert header_only.size == (64, 64)  # what a header-only scan saw: a valid image
        assert decode_problem(good) is None and "cannot be read" in decode_problem(cut), fmt
    padded = tmp_path / "padded.jpg"  # bytes after the end marker (some cameras append data): still an image
    padded.write_bytes(_encoded("JPEG") + b"\0" * 4096)
    assert decode_problem(padded) is None
    (tmp_path / "notes.jpg").write_text("not an image")
    assert "cannot be read" in decode_problem(tmp_path / "notes.jpg")


def test_the_diffusion_scan_skips_a_truncated_jpeg_and_names_it(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.jpg").write_bytes(_encoded("JPEG"))
        (tmp_path / f"{name}.txt").write_text(f"a photo of {name}")
    _truncate(tmp_path / "b.jpg")
    scan = scan_dataset(tmp_path)
    assert [p.split("/")[-1] for p in (i.path for i in scan.items)] == ["a.jpg", "c.jpg"]
    assert any(w.startswith("b.jpg: cannot be read") and w.endswith("skipped") for w in scan.warnings)


def _coco_with_broken_files(root):
    from trainer.families.detection.demo import make_shapes_coco

    folder = make_shapes_coco(root / "shapes", train=8, val=4)
    _truncate(folder / "images" / "train_0001.png")
    (folder / "images" / "train_0002.png").write_text("not an image")  # the json still gives its size
    return folder


def test_coco_images_with_sizes_are_decoded_and_broken_ones_skipped_by_name(tmp_path):
    folder = _coco_with_broken_files(tmp_path)
    sizes = {im["file_name"]: (im.get("width"), im.get("height"))
             for im in json.loads((folder / "train.json").read_text())["images"]}
    assert all(sizes.values())  # the json gives every size: the old scan never opened these files
    scan = scan_detection(str(folder))
    names = {r.path.rsplit("/", 1)[-1] for r in scan.train}
    assert "train_0001.png" not in names and "train_0002.png" not in names and len(names) == 6
    text = "\n".join(scan.warnings)
    assert "train_0001.png" in text and "train_0002.png" in text and "cannot be read" in text


def test_yolo_skips_a_truncated_image_by_name(tmp_path):
    images, labels = tmp_path / "images", tmp_path / "labels"
    images.mkdir(), labels.mkdir()
    for i in range(3):
        (images / f"{i}.jpg").write_bytes(_encoded("JPEG"))
        (labels / f"{i}.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    _truncate(images / "1.jpg")
    (tmp_path / "data.yaml").write_text(f"path: {tmp_path}\ntrain: images\nval: images\nnames: [shape]\n")
    scan = scan_detection(str(tmp_path / "data.yaml"))
    assert sorted(r.path.rsplit("/", 1)[-1] for r in scan.train) == ["0.jpg", "2.jpg"]
    assert any("1.jpg" in w and "cannot be read" in w for w in scan.warnings)


@pytest.mark.slow
def test_a_detection_run_with_broken_images_trains_to_done(tmp_path):
    folder = _coco_with_broken_files(tmp_path)
    config = load_config({"model": {"family": "detection", "path": "fcos_tiny"}, "method": "full",
                          "devices": "cpu:1", "data": {"path": str(folder), "resolution": 64},
                          "detection": {"weights": "none"}},
                         ["batch.total=4", "batch.per_device=2", "train.steps=3", "name=broken"])
    run_dir, final = launch(tmp_path / "runs", config)
    assert final["type"] == "done", log_of(run_dir)
    warnings = [e["message"] for e in read_events(run_dir) if e["type"] == "warning"]
    assert any("train_0001.png" in w for w in warnings) and any("train_0002.png" in w for w in warnings)


@pytest.mark.slow
def test_a_diffusion_run_with_a_truncated_image_trains_to_done(tmp_path, tiny_sd_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a", "b", "c", "d"):
        (data / f"{name}.jpg").write_bytes(_encoded("JPEG"))
        (data / f"{name}.txt").write_text(f"a photo of {name}")
    _truncate(data / "c.jpg")
    config = engine_config(tiny_sd_path, data, "devices=cpu:1", "train.steps=2", "data.cache_latents=false")
    run_dir, final = launch(tmp_path / "runs", config)
    assert final["type"] == "done", log_of(run_dir)
    assert any("c.jpg" in e["message"] for e in read_events(run_dir) if e["type"] == "warning")
