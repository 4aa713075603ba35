"""Dataset scanning (captions, kohya repeats, metadata.jsonl, warnings) and deterministic image loading."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.families.components.captioned import (
    ImageCaptionDataset,
    collate,
    load_image_tensor,
    sample_rng,
    torch_generator,
)
from trainer.core.data.scan import DatasetScan, ImageItem, require_usable, scan_dataset
from trainer.errors import UserError


def make_image(path: Path, size=(40, 32), mode="RGB", color=None, pattern=True) -> Path:
    """A small image; `pattern` makes every pixel different so crops and flips change the tensor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = size
    if pattern:
        x = np.arange(width)[None, :].repeat(height, 0) * 5
        y = np.arange(height)[:, None].repeat(width, 1) * 7
        rgb = (np.stack([x, y, x // 2 + y], axis=-1) % 256).astype(np.uint8)
        img = Image.fromarray(rgb, "RGB")
        img = img.convert(mode) if mode != "RGB" else img
    else:
        img = Image.new(mode, size, color)
    img.save(path)
    return path


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def captions(scan: DatasetScan) -> dict[str, str]:
    return {Path(i.path).name: i.caption for i in scan.items}


# --- scanning -----------------------------------------------------------------------------------------------


def test_captions_from_same_name_text_files(tmp_path):
    make_image(tmp_path / "cat.png")
    write(tmp_path / "cat.txt", "  a photo of\n a cat \n")
    make_image(tmp_path / "dog.JPG")
    write(tmp_path / "dog.TXT", "a dog")
    scan = scan_dataset(tmp_path)
    assert captions(scan) == {"cat.png": "a photo of a cat", "dog.JPG": "a dog"}
    assert scan.problems == [] and scan.warnings == []
    item = scan.items[0]
    assert isinstance(item, ImageItem)
    assert (item.width, item.height, item.repeats) == (40, 32, 1)
    require_usable(scan)


def test_caption_extension_without_dot(tmp_path):
    make_image(tmp_path / "a.png")
    write(tmp_path / "a.caption", "from caption file")
    assert captions(scan_dataset(tmp_path, caption_extension="caption")) == {"a.png": "from caption file"}


def test_kohya_folders_give_repeats_and_folder_prompt(tmp_path):
    make_image(tmp_path / "10_sks dog" / "a.png")
    make_image(tmp_path / "10_sks dog" / "b.png")
    write(tmp_path / "10_sks dog" / "b.txt", "sks dog on a beach")
    make_image(tmp_path / "2_style" / "c.webp")
    scan = scan_dataset(tmp_path)
    assert scan.folders == {"10_sks dog": 10, "2_style": 2}
    assert captions(scan) == {"a.png": "sks dog", "b.png": "sks dog on a beach", "c.webp": "style"}
    assert scan.image_count == 3
    assert scan.expanded_count == 22 == len(scan.expanded())
    expanded_names = [Path(i.path).name for i in scan.expanded()]
    assert expanded_names == ["a.png"] * 10 + ["b.png"] * 10 + ["c.webp"] * 2
    summary = scan.summary()
    assert summary["folders"]["10_sks dog"] == {"repeats": 10, "images": 2}
    assert summary["images"] == 3 and summary["expanded"] == 22


def test_non_kohya_subfolder_is_warned_and_ignored(tmp_path):
    make_image(tmp_path / "a.png")
    make_image(tmp_path / "extras" / "b.png")
    scan = scan_dataset(tmp_path, instance_prompt="sks")
    assert captions(scan) == {"a.png": "sks"}
    assert any("extras/" in w and "ignored" in w for w in scan.warnings)


def test_metadata_jsonl_text_and_caption_keys(tmp_path):
    make_image(tmp_path / "a.png")
    make_image(tmp_path / "b.png")
    make_image(tmp_path / "train" / "c.png")
    lines = [
        {"file_name": "a.png", "text": "first"},
        {"file_name": "b.png", "caption": "second"},
        {"file_name": "train/c.png", "text": "third"},
        {"file_name": "gone.png", "text": "missing"},
    ]
    write(tmp_path / "metadata.jsonl", "\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    scan = scan_dataset(tmp_path)
    assert captions(scan) == {"a.png": "first", "b.png": "second", "c.png": "third"}
    assert any("gone.png" in w for w in scan.warnings)
    assert any("line 5" in w for w in scan.warnings)
    assert not any("train/" in w for w in scan.warnings)  # listed in metadata, so not an ignored folder


def test_caption_file_wins_over_metadata(tmp_path):
    make_image(tmp_path / "a.png")
    write(tmp_path / "a.txt", "from txt")
    write(tmp_path / "metadata.jsonl", json.dumps({"file_name": "a.png", "text": "from metadata"}))
    assert captions(scan_dataset(tmp_path)) == {"a.png": "from txt"}


def test_instance_prompt_is_the_fallback(tmp_path):
    make_image(tmp_path / "a.png")
    make_image(tmp_path / "b.png")
    write(tmp_path / "b.txt", "own caption")
    write(tmp_path / "c.txt", "orphan caption, no image")
    scan = scan_dataset(tmp_path, instance_prompt="a photo of sks dog")
    assert captions(scan) == {"a.png": "a photo of sks dog", "b.png": "own caption"}
    assert scan.warnings == []


def test_missing_caption_is_warned_and_skipped(tmp_path):
    make_image(tmp_path / "a.png")
    make_image(tmp_path / "b.png")
    write(tmp_path / "b.txt", "b")
    write(tmp_path / "empty.txt", "   ")
    make_image(tmp_path / "empty.png")
    scan = scan_dataset(tmp_path)
    assert captions(scan) == {"b.png": "b"}
    assert len(scan.warnings) == 2
    assert any("a.png" in w and "no caption" in w for w in scan.warnings)
    assert any("empty.png" in w and "no caption" in w for w in scan.warnings)


def test_corrupt_and_non_image_files_are_warned_and_skipped(tmp_path):
    make_image(tmp_path / "good.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    (tmp_path / "notes.pdf").write_bytes(b"%PDF-1.4")
    (tmp_path / ".hidden.png").write_bytes(b"not even looked at")
    (tmp_path / "Thumbs.db").write_bytes(b"")
    scan = scan_dataset(tmp_path, instance_prompt="x")
    assert [Path(i.path).name for i in scan.items] == ["good.png"]
    assert len(scan.warnings) == 2
    assert any("broken.png" in w and "cannot be read" in w for w in scan.warnings)
    assert any("notes.pdf" in w and "not an image" in w for w in scan.warnings)


def test_truncated_png_fails_verify(tmp_path):
    data = make_image(tmp_path / "src" / "a.png", size=(64, 64)).read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) - 30])
    scan = scan_dataset(tmp_path, instance_prompt="x")
    assert scan.items == [] and "cut.png" in scan.warnings[-1]


def test_small_image_is_warned_with_its_size_but_kept(tmp_path):
    make_image(tmp_path / "small.png", size=(40, 32))
    make_image(tmp_path / "big.png", size=(80, 72))
    scan = scan_dataset(tmp_path, instance_prompt="x", resolution=64)
    assert scan.image_count == 2
    assert len(scan.warnings) == 1
    assert "small.png" in scan.warnings[0] and "40x32" in scan.warnings[0] and "64" in scan.warnings[0]
    summary = scan.summary()
    assert summary["smallest"] == "40x32" and summary["largest"] == "80x72"
    assert (summary["short_side_min"], summary["short_side_max"]) == (32, 72)
    assert summary["short_side_histogram"]["<256"] == 2
    json.dumps(summary)  # the UI ships it as JSON


def test_exif_rotation_swaps_reported_size(tmp_path):
    img = Image.new("RGB", (40, 32), "red")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees when displayed
    img.save(tmp_path / "photo.jpg", exif=exif)
    item = scan_dataset(tmp_path, instance_prompt="x").items[0]
    assert (item.width, item.height) == (32, 40)
    assert load_image_tensor(item.path, 16).shape == (3, 16, 16)


@pytest.mark.parametrize("setup", ["missing", "empty", "only_unusable", "file"])
def test_require_usable_raises_naming_the_path(tmp_path, setup):
    target = tmp_path / "my data"
    if setup == "empty":
        target.mkdir()
    elif setup == "only_unusable":
        make_image(target / "a.png")  # no caption, no instance prompt
    elif setup == "file":
        write(target, "not a folder")
    scan = scan_dataset(target)
    assert scan.problems and scan.items == []
    with pytest.raises(UserError) as error:
        require_usable(scan, key="data.path")
    message = str(error.value)
    assert str(target) in message and "data.path" in message and "\n" not in message
    if setup == "only_unusable":
        assert "a.png" in message and "no caption" in message


def test_order_is_sorted_and_deterministic(tmp_path):
    for name in ["b.png", "A.png", "c.png", "a2.png"]:
        make_image(tmp_path / name)
    first = scan_dataset(tmp_path, instance_prompt="x")
    second = scan_dataset(tmp_path, instance_prompt="x")
    assert [Path(i.path).name for i in first.items] == ["A.png", "a2.png", "b.png", "c.png"]
    assert first.items == second.items


def test_scan_module_does_not_import_torch():
    code = "import sys, trainer.core.data.scan; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


# --- loading --------------------------------------------------------------------------------------------------


def test_tensor_shape_and_range(tmp_path):
    path = make_image(tmp_path / "a.png", size=(40, 32))
    tensor = load_image_tensor(str(path), 24)
    assert tensor.shape == (3, 24, 24) and tensor.dtype == torch.float32
    assert -1.0 <= tensor.min() and tensor.max() <= 1.0
    white = load_image_tensor(str(make_image(tmp_path / "w.png", pattern=False, color="white")), 16)
    black = load_image_tensor(str(make_image(tmp_path / "k.png", pattern=False, color="black")), 16)
    assert torch.allclose(white, torch.ones_like(white)) and torch.allclose(black, -torch.ones_like(black))


def test_small_image_is_upscaled_to_resolution(tmp_path):
    path = make_image(tmp_path / "a.png", size=(40, 32))
    assert load_image_tensor(str(path), 64, crop="random", rng=sample_rng(0)).shape == (3, 64, 64)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "I;16"])
def test_other_modes_become_rgb(tmp_path, mode):
    path = make_image(tmp_path / f"img-{mode.replace(';', '')}.png", mode=mode)
    tensor = load_image_tensor(str(path), 16)
    assert tensor.shape == (3, 16, 16) and -1.0 <= tensor.min() and tensor.max() <= 1.0


def test_transparent_pixels_become_white(tmp_path):
    path = tmp_path / "clear.png"
    Image.new("RGBA", (20, 20), (0, 0, 0, 0)).save(path)
    tensor = load_image_tensor(str(path), 8)
    assert torch.allclose(tensor, torch.ones_like(tensor))


def test_center_crop_needs_no_rng_and_random_crop_does(tmp_path):
    path = str(make_image(tmp_path / "a.png", size=(40, 32)))
    assert torch.equal(load_image_tensor(path, 16), load_image_tensor(path, 16, crop="center"))
    with pytest.raises(ValueError):
        load_image_tensor(path, 16, crop="random")
    with pytest.raises(ValueError):
        load_image_tensor(path, 16, crop="diagonal")


def test_numpy_generator_is_accepted(tmp_path):
    path = str(make_image(tmp_path / "a.png", size=(60, 32)))
    a = load_image_tensor(path, 16, crop="random", flip=True, rng=np.random.default_rng(3))
    b = load_image_tensor(path, 16, crop="random", flip=True, rng=np.random.default_rng(3))
    assert torch.equal(a, b)


def _reseed_globals(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_randomness_comes_only_from_the_passed_rng(tmp_path):
    path = str(make_image(tmp_path / "a.png", size=(60, 32)))
    _reseed_globals(1)
    a = load_image_tensor(path, 16, crop="random", flip=True, rng=sample_rng(7, 0, 3))
    _reseed_globals(2)
    b = load_image_tensor(path, 16, crop="random", flip=True, rng=sample_rng(7, 0, 3))
    assert torch.equal(a, b)


def test_flip_mirrors_the_center_crop(tmp_path):
    path = str(make_image(tmp_path / "a.png", size=(40, 32)))
    plain = load_image_tensor(path, 16)
    seen = {torch.equal(load_image_tensor(path, 16, flip=True, rng=sample_rng(0, e)), plain) for e in range(16)}
    assert seen == {True, False}
    flips = [load_image_tensor(path, 16, flip=True, rng=sample_rng(0, e)) for e in range(16)]
    assert any(torch.equal(t, torch.flip(plain, dims=[2])) for t in flips)


def make_dataset(tmp_path, **kwargs) -> ImageCaptionDataset:
    make_image(tmp_path / "3_sks" / "a.png", size=(60, 40))
    make_image(tmp_path / "3_sks" / "b.png", size=(40, 60))
    return ImageCaptionDataset(scan_dataset(tmp_path), 24, **kwargs)


def test_dataset_same_seed_epoch_index_gives_identical_tensors(tmp_path):
    dataset = make_dataset(tmp_path, crop="random", flip=True)
    assert len(dataset) == 6
    first, again = dataset.get(4, epoch=2, seed=11), dataset.get(4, epoch=2, seed=11)
    assert torch.equal(first["pixel_values"], again["pixel_values"])
    assert first["caption"] == "sks" and first["index"] == 4 and Path(first["path"]).name == "b.png"
    assert torch.equal(dataset[(4, 2)]["pixel_values"], dataset.get(4, 2, 0)["pixel_values"])


def test_dataset_different_epoch_changes_crop_or_flip(tmp_path):
    dataset = make_dataset(tmp_path, crop="random", flip=True)
    tensors = [dataset.get(0, epoch=e, seed=5)["pixel_values"] for e in range(6)]
    assert any(not torch.equal(tensors[0], t) for t in tensors[1:])
    other_seed = dataset.get(0, epoch=0, seed=6)["pixel_values"]
    assert not torch.equal(tensors[0], other_seed)


def test_will_flip_predicts_the_flip(tmp_path):
    dataset = make_dataset(tmp_path, crop="center", flip=True)
    plain = ImageCaptionDataset(dataset.items, 24).get(0, 0, 0)["pixel_values"]
    for epoch in range(8):
        sample = dataset.get(0, epoch, 9)
        assert sample["flipped"] == dataset.will_flip(0, epoch, 9)
        expected = torch.flip(plain, dims=[2]) if sample["flipped"] else plain
        assert torch.equal(sample["pixel_values"], expected)


def test_set_epoch_drives_plain_indexing(tmp_path):
    dataset = make_dataset(tmp_path, crop="random", flip=True, seed=3)
    dataset.set_epoch(4)
    assert torch.equal(dataset[1]["pixel_values"], dataset.get(1, 4, 3)["pixel_values"])
    with pytest.raises(IndexError):
        dataset.get(6, 0, 0)


def test_collate_stacks_and_lists(tmp_path):
    dataset = make_dataset(tmp_path)
    batch = collate([dataset.get(i, 0, 0) for i in (0, 3)])
    assert batch["pixel_values"].shape == (2, 3, 24, 24)
    assert batch["captions"] == ["sks", "sks"] and batch["indices"] == [0, 3]


def test_seeded_generators_are_reproducible_and_independent():
    assert sample_rng(1, 2, 3).random() == sample_rng(1, 2, 3).random()
    assert sample_rng(1, 2, 3).random() != sample_rng(1, 3, 2).random()
    assert sample_rng(-1, 0).random() == sample_rng(-1, 0).random()
    a = torch.randn(4, generator=torch_generator(1, 2, 3))
    assert torch.equal(a, torch.randn(4, generator=torch_generator(1, 2, 3)))
    assert not torch.equal(a, torch.randn(4, generator=torch_generator(1, 2, 4)))
    assert torch_generator(0).device.type == "cpu"


def test_unreadable_image_at_load_time_is_a_user_error(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"nope")
    with pytest.raises(UserError, match="bad.png"):
        load_image_tensor(str(bad), 16)
