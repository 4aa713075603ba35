"""Detection datasets: COCO and YOLO reading, every kind of bad annotation, label mapping, the validation split,
the launcher's pre-check, config checks, the demo set, and augmentations that keep boxes on their objects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from trainer.core.config import load_config
from trainer.families.detection.data import carve_validation, require_usable, scan_detection
from trainer.errors import ConfigError, UserError


def _image(path: Path, size=(100, 80), color="gray"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


@pytest.fixture
def coco(tmp_path):
    """A COCO file with one of every problem; category ids 3, 7, 12 (not contiguous)."""
    for name in ("a.png", "b.png", "empty.png", "crowded.png"):
        _image(tmp_path / "images" / name)
    data = {
        "images": [
            {"id": 1, "file_name": "a.png", "width": 100, "height": 80},
            {"id": 2, "file_name": "b.png", "width": 100, "height": 80},
            {"id": 3, "file_name": "empty.png", "width": 100, "height": 80},
            {"id": 4, "file_name": "gone.png", "width": 100, "height": 80},
            {"id": 5, "file_name": "crowded.png"},  # no size: read from the file
        ],
        "categories": [{"id": 12, "name": "zebra"}, {"id": 3, "name": "cat"}, {"id": 7, "name": "dog"}],
        "annotations": [
            {"id": 10, "image_id": 1, "category_id": 3, "bbox": [10, 10, 20, 30]},  # fine -> label 1 (cat)
            {"id": 11, "image_id": 1, "category_id": 12, "bbox": [90, 70, 30, 30]},  # outside -> clipped
            {"id": 12, "image_id": 2, "category_id": 7, "bbox": [20, 20, 0, 10]},  # zero width -> dropped
            {"id": 13, "image_id": 2, "category_id": 99, "bbox": [1, 1, 5, 5]},  # unknown category
            {"id": 14, "image_id": 2, "category_id": 7, "bbox": [1, 1, 5]},  # malformed bbox
            {"id": 15, "image_id": 4, "category_id": 7, "bbox": [1, 1, 5, 5]},  # its image file is missing
            {"id": 16, "image_id": 42, "category_id": 7, "bbox": [1, 1, 5, 5]},  # image not in the file
            {"id": 17, "image_id": 5, "category_id": 7, "bbox": [1, 1, 5, 5], "iscrowd": 1},  # crowd: skipped
            {"id": 18, "image_id": 5, "category_id": 7, "bbox": [200, 200, 5, 5]},  # entirely outside: zero area
            {"id": 19, "image_id": 2, "category_id": 7, "bbox": [50, 40, 10, 10]},  # fine -> label 2 (dog)
        ],
    }
    (tmp_path / "train.json").write_text(json.dumps(data))
    return tmp_path / "train.json"


def test_coco_maps_categories_and_reports_every_bad_annotation(coco):
    scan = scan_detection(str(coco), val_fraction=0.25, seed=0)
    assert scan.problems == []
    assert scan.layout == "coco" and scan.classes == ["cat", "dog", "zebra"]  # ordered by id: 3, 7, 12 -> 1, 2, 3
    records = {Path(r.path).name: r for r in scan.train + scan.val}
    assert sorted(records) == ["a.png", "b.png", "crowded.png", "empty.png"]  # gone.png skipped
    assert records["a.png"].labels == [1, 3]
    assert records["a.png"].boxes == [[10.0, 10.0, 30.0, 40.0], [90.0, 70.0, 100.0, 80.0]]  # second one clipped
    assert records["b.png"].labels == [2] and records["b.png"].boxes == [[50.0, 40.0, 60.0, 50.0]]
    assert records["empty.png"].boxes == [] and records["crowded.png"].boxes == []
    assert (records["crowded.png"].width, records["crowded.png"].height) == (100, 80)
    assert dict(scan.counts) == {"clipped": 1, "zero_area": 2, "unknown_category": 1, "malformed": 1,
                                 "missing_image": 1, "unknown_image": 1, "crowd": 1}
    text = "\n".join(scan.warnings)
    for expected in ("train.json: annotation 11 (image 'a.png')", "clipped",
                     "annotation 12 (image 'b.png')", "zero area",
                     "annotation 13 (image 'b.png'): category_id 99 is not one of the categories (3, 7, 12)",
                     "annotation 14 (image 'b.png'): bbox [1, 1, 5] is not [x, y, width, height]",
                     "image 4 'gone.png': no file at", "annotation 16 refers to image 42",
                     "annotation 17 (image 'crowded.png'): a crowd region (iscrowd=1)"):
        assert expected in text, expected
    assert not any(w.split(":")[0].strip().isdigit() for w in scan.warnings)  # no "26: ..." that reads like a line


def test_coco_validation_file_and_images_folder(tmp_path, coco):
    val = {"images": [{"id": 1, "file_name": "b.png", "width": 100, "height": 80}],
           "categories": [{"id": 7, "name": "dog"}, {"id": 8, "name": "new"}],
           "annotations": [{"id": 1, "image_id": 1, "category_id": 7, "bbox": [5, 5, 10, 10]},
                           {"id": 2, "image_id": 1, "category_id": 8, "bbox": [5, 5, 10, 10]}]}
    (tmp_path / "val.json").write_text(json.dumps(val))
    scan = scan_detection(str(tmp_path), seed=0)  # a folder with train.json + val.json
    assert len(scan.train) == 4 and len(scan.val) == 1 and scan.val_source.endswith("val.json")
    assert scan.val[0].labels == [2]  # val's category 7 is the training file's label 2; 8 is unknown there
    assert any("val.json: categories [8] are not in the training file" in w for w in scan.warnings)
    # an explicit images folder that is wrong: every image is missing, which is a problem, not a crash
    scan = scan_detection(str(coco), images_dir=str(tmp_path / "nowhere"))
    assert scan.problems and "none of its 5 images could be used" in scan.problems[0]


def _yolo(root: Path) -> Path:
    for split, names in (("train", ["t1", "t2", "t3", "nolabel"]), ("val", ["v1"])):
        for name in names:
            _image(root / "images" / split / f"{name}.jpg", size=(200, 100))
    labels = root / "labels" / "train"
    labels.mkdir(parents=True)
    (labels / "t1.txt").write_text(
        "0 0.5 0.5 0.2 0.4\n"         # fine: box 80,30,120,70
        "1 0.95 0.5 0.2 0.2\n"        # reaches outside -> clipped at x=200
        "2 0.5 0.5 0.1 0.1\n"         # class 2 of 2 classes -> unknown
        "\n"
        "cat 0.5 0.5 0.1 0.1\n"       # malformed: not numbers
        "0 0.5 0.5 0.1\n")            # malformed: 4 values
    (labels / "t2.txt").write_text("1 0.5 0.5 0 0.2\n"                     # zero width -> dropped
                                   "0 0.1 0.1 0.3 0.1 0.3 0.3 0.1 0.3\n")  # YOLO-seg polygon -> its bbox
    (labels / "t3.txt").write_text("")  # an empty label file: a background image
    (root / "labels" / "val").mkdir(parents=True)
    (root / "labels" / "val" / "v1.txt").write_text("1 0.5 0.5 0.5 0.5\n")
    (root / "data.yaml").write_text("path: .\ntrain: images/train\nval: images/val\nnames: {0: person, 1: car}\n")
    return root / "data.yaml"


def test_yolo_layout_with_every_bad_line(tmp_path):
    data_yaml = _yolo(tmp_path / "set")
    scan = scan_detection(str(data_yaml))
    assert scan.problems == [] and scan.layout == "yolo" and scan.classes == ["person", "car"]
    records = {Path(r.path).stem: r for r in scan.train}
    assert sorted(records) == ["nolabel", "t1", "t2", "t3"]
    assert records["t1"].labels == [1, 2]
    assert records["t1"].boxes[0] == pytest.approx([80, 30, 120, 70])
    assert records["t1"].boxes[1] == pytest.approx([170, 40, 200, 60])
    assert records["t2"].labels == [1] and records["t2"].boxes[0] == pytest.approx([20, 10, 60, 30])
    assert records["t3"].boxes == [] and records["nolabel"].boxes == []
    assert len(scan.val) == 1 and scan.val[0].labels == [2] and scan.val_source == "data.yaml: val"
    assert dict(scan.counts) == {"clipped": 1, "unknown_category": 1, "malformed": 2, "zero_area": 1,
                                 "no_label_file": 1}
    text = "\n".join(scan.warnings)
    assert "train/t1.txt line 3: class 2 is not one of data.yaml's classes 0..1" in text
    assert "train/t1.txt line 5: 'cat 0.5 0.5 0.1 0.1' is not numbers" in text
    assert "train/t1.txt line 6: has 4 values" in text
    assert "train/t1.txt line 2: box" in text and "clipped" in text
    assert "train/t2.txt line 1: box" in text and "zero area" in text
    assert "images/train/nolabel.jpg: no label file" in text and "trains as an empty (background) image" in text
    # the folder works as well as the yaml; a .txt list with a missing image names it
    (tmp_path / "set" / "train.txt").write_text("images/train/t1.jpg\nimages/train/missing.jpg\n")
    text = data_yaml.read_text().replace("train: images/train", "train: train.txt")
    data_yaml.write_text(text)
    scan = scan_detection(str(tmp_path / "set"))
    assert [Path(r.path).stem for r in scan.train] == ["t1"]
    assert any("train.txt: lists images/train/missing.jpg, which does not exist" in w for w in scan.warnings)


@pytest.mark.parametrize("yaml_text, problem", [
    ("train: images/train\n", "has no `names`"),
    ("train: images/nowhere\nnames: [a]\n", "is neither a folder of images nor a .txt list"),
    ("train: images/train\nnames: [a, b]\nnc: 3\n", "nc is 3 but names lists 2 classes"),
    ("names: [a]\n", "needs at least `train`"),
])
def test_bad_yolo_yaml_is_a_problem(tmp_path, yaml_text, problem):
    _image(tmp_path / "images" / "train" / "x.jpg")
    (tmp_path / "data.yaml").write_text(yaml_text)
    scan = scan_detection(str(tmp_path / "data.yaml"))
    assert any(problem in p for p in scan.problems), scan.problems
    with pytest.raises(UserError, match="cannot be used"):
        require_usable(scan, str(tmp_path))


def test_unusable_datasets_are_problems(tmp_path, coco):
    data = json.loads(coco.read_text())
    for ann in data["annotations"]:
        ann["category_id"] = 99
    (tmp_path / "nobox.json").write_text(json.dumps(data))
    assert "has a usable box" in scan_detection(str(tmp_path / "nobox.json")).problems[0]
    (tmp_path / "broken.json").write_text("{not json")
    assert "not a readable JSON file" in scan_detection(str(tmp_path / "broken.json")).problems[0]
    (tmp_path / "other.json").write_text(json.dumps({"images": []}))
    assert "lacks annotations, categories" in scan_detection(str(tmp_path / "other.json")).problems[0]
    (tmp_path / "folder").mkdir()
    assert "neither a YOLO data.yaml nor a COCO train.json" in scan_detection(str(tmp_path / "folder")).problems[0]


def test_validation_split_is_seeded_and_disjoint(coco):
    records = scan_detection(str(coco), val_fraction=0.5, seed=0)
    all_paths = sorted(r.path for r in records.train + records.val)
    train, val = carve_validation(sorted(records.train + records.val, key=lambda r: r.path), 0.5, seed=3)
    again = carve_validation(sorted(records.train + records.val, key=lambda r: r.path), 0.5, seed=3)
    assert [r.path for r in val] == [r.path for r in again[1]] and len(val) == 2
    assert sorted(r.path for r in train + val) == all_paths and not {r.path for r in train} & {r.path for r in val}
    others = {tuple(r.path for r in carve_validation(train + val, 0.5, seed=s)[1]) for s in range(8)}
    assert len(others) > 1  # the seed decides


# ----------------------------------------------------------------------------------------------------------------
# Config checks and the launcher's pre-check


def _detection_config(data: str, *overrides: str):
    return load_config({"model": {"family": "detection", "path": "fcos_tiny"}, "method": "full", "devices": "cpu:1",
                        "data": {"path": data, "resolution": 64}, "detection": {"weights": "none"}}, list(overrides))


def test_detection_config_checks(coco):
    config = _detection_config(str(coco))
    assert config.detection.weights == "none" and config.data.resolution == 64
    with pytest.raises(ConfigError) as err:
        _detection_config(str(coco), "model.path=fasterrcnn_resnet50_fpn", "method=lora", "data.resolution=16",
                          "detection.sync_batchnorm=true", "detection.augment=[flip]", "detection.weights=/no/such.pth",
                          "detection.val_fraction=1.5", "detection.trainable_backbone_layers=7")
    text = str(err.value)
    for expected in ("model.path: 'fasterrcnn_resnet50_fpn' is not a detection architecture (did you mean "
                     "'fasterrcnn_resnet50_fpn_v2'?)", "method: a detector is trained whole; set method=full",
                     "data.resolution: must be at least 32", "detection.sync_batchnorm: SyncBatchNorm needs CUDA",
                     "detection.augment: ['flip'] are not augmentations", "detection.weights: '/no/such.pth'",
                     "detection.val_fraction: must be between 0 and 1"):
        assert expected in text, expected
    with pytest.raises(ConfigError, match="fcos_tiny has no COCO weights"):
        _detection_config(str(coco), "detection.weights=coco")
    with pytest.raises(ConfigError, match="data.path: '/nowhere/x.json' does not exist"):
        _detection_config("/nowhere/x.json")


def test_a_bad_detection_dataset_is_refused_before_anything_is_created(tmp_path, coco):
    from trainer.core.hardware import CPU_ONLY
    from trainer.core.launcher import prepare_run

    (tmp_path / "nobox.json").write_text(json.dumps({"images": [], "annotations": [], "categories": []}))
    runs = tmp_path / "runs"
    with pytest.raises(UserError, match="cannot be used") as err:
        prepare_run(_detection_config(str(tmp_path / "nobox.json")), runs, hw=CPU_ONLY)
    assert "has no categories" in str(err.value)
    assert not runs.exists() or not any(runs.iterdir())
    run_dir, plan = prepare_run(_detection_config(str(coco), "name=ok"), runs, hw=CPU_ONLY)  # a usable one passes
    saved = load_config(run_dir / "config.yaml")
    assert saved.model.path == "fcos_tiny" and saved.data.path == str(coco)  # an architecture is not a path


def test_demo_dataset_is_deterministic_and_resolved_through_demo_scheme(tmp_path):
    from trainer.families.detection.demo import make_shapes_coco
    from trainer.core.assets import resolve_paths

    one, two = make_shapes_coco(tmp_path / "one", train=12, val=4), make_shapes_coco(tmp_path / "two", train=12, val=4)
    assert (one / "train.json").read_bytes() == (two / "train.json").read_bytes()
    assert (one / "images" / "train_0003.png").read_bytes() == (two / "images" / "train_0003.png").read_bytes()
    scan = scan_detection(str(one))
    assert scan.classes == ["circle", "square", "triangle"] and len(scan.train) == 12 and len(scan.val) == 4
    assert scan.problems == [] and not scan.warnings
    config = _detection_config("demo://shapes-coco")
    resolved = resolve_paths(config, tmp_path / "runs")
    demo = tmp_path / "runs" / ".demo"
    assert resolved.data.path == str(demo / "shapes-coco") and (demo / "shapes-coco" / "val.json").is_file()
    assert not (demo / "tiny-sd").exists()  # only the asset asked for is built
    scan = scan_detection(resolved.data.path)
    assert (len(scan.train), len(scan.val), scan.problems) == (320, 64, [])


# ----------------------------------------------------------------------------------------------------------------
# Tensors and augmentations


def _red_boxes(tmp_path: Path):
    """An image with two red rectangles exactly where its boxes are."""
    from trainer.families.detection.records import DetRecord

    img = Image.new("RGB", (160, 120), (128, 128, 128))
    draw = ImageDraw.Draw(img)
    boxes = [[20, 30, 60, 90], [100, 10, 150, 40]]
    for x1, y1, x2, y2 in boxes:
        draw.rectangle([x1, y1, x2 - 1, y2 - 1], fill=(255, 0, 0))
    img.save(tmp_path / "red.png")
    empty = DetRecord(str(tmp_path / "red.png"), 160, 120)
    return DetRecord(str(tmp_path / "red.png"), 160, 120, [list(map(float, b)) for b in boxes], [1, 2]), empty


@pytest.mark.parametrize("augment", [[], ["zoom_out"], ["iou_crop"], ["zoom_out", "iou_crop", "color"]])
def test_augmentations_keep_boxes_on_their_objects(tmp_path, augment):
    import torch

    from trainer.families.detection.images import DetectionImages

    record, empty = _red_boxes(tmp_path)
    images = DetectionImages([record, empty], 80, flip=True, augment=augment)
    flipped = 0
    for seed in range(12):
        image, target = images.train_sample(images.load_many([0])[0], seed)
        assert image.dtype == torch.float32 and max(image.shape[-2:]) == 80  # longest side = resolution
        again, target2 = images.train_sample(images._load(0), seed)
        assert torch.equal(image, again) and torch.equal(target["boxes"], target2["boxes"])  # a function of the seed
        for (x1, y1, x2, y2), label in zip(target["boxes"].tolist(), target["labels"].tolist()):
            inside = image[:, round(y1) + 1:round(y2) - 1, round(x1) + 1:round(x2) - 1]
            # the red object stays a saturated colour (the colour jitter may permute channels), unlike the
            # gray background and the zoom-out fill
            colourful = inside.max(0).values - inside.min(0).values > 0.25
            assert colourful.float().mean() > 0.9, (seed, augment, label)
            ring = image[:, max(0, round(y1) - 3):round(y2) + 3, max(0, round(x1) - 3):round(x2) + 3]
            assert (ring.max(0).values - ring.min(0).values > 0.25).float().mean() < 0.97  # not all object
        if "iou_crop" not in augment:  # (a crop may cut one box out; otherwise both stay)
            assert target["labels"].tolist() in ([1, 2],)
            left = target["boxes"][0, 0].item()
            flipped += left > image.shape[-1] / 2
    if "iou_crop" not in augment:
        assert 0 < flipped < 12  # some samples flipped, some not
    image, target = images.train_sample(images._load(1), 0)
    assert target["boxes"].shape == (0, 4) and target["labels"].shape == (0,)  # empty images are fine
    image, target = images.eval_sample(0)
    assert target["boxes"].tolist() == [[10.0, 15.0, 30.0, 45.0], [50.0, 5.0, 75.0, 20.0]]  # scaled by 80/160


def test_a_yolo_label_file_without_an_image_is_named(tmp_path):
    (tmp_path / "images").mkdir(), (tmp_path / "labels").mkdir()
    _image(tmp_path / "images" / "a.png")
    (tmp_path / "labels" / "a.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    (tmp_path / "labels" / "renamed.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    (tmp_path / "data.yaml").write_text(f"path: {tmp_path}\ntrain: images\nnames: [shape]\n")
    scan = scan_detection(str(tmp_path / "data.yaml"))
    assert scan.counts["orphan_label"] == 1
    assert any("labels/renamed.txt: a label file with no image" in w for w in scan.warnings)


def test_many_issues_of_a_kind_end_in_a_sentence_with_the_count(tmp_path):
    from trainer.families.detection.records import EXAMPLES_PER_KIND, IssueReport

    report = IssueReport()
    for i in range(EXAMPLES_PER_KIND + 21):
        report.add("crowd", f"annotation {i}: a crowd region")
    report.add("clipped")
    lines = report.warnings()
    assert lines[:EXAMPLES_PER_KIND] == [f"annotation {i}: a crowd region" for i in range(EXAMPLES_PER_KIND)]
    assert ("crowd regions (iscrowd=1) are not trained on and are ignore regions in evaluation"
            " (and 21 more like these)") in lines
    assert "boxes reaching outside their image were clipped (1 in all)" in lines


def _phone_photo(path: Path, orientation: int, stored=(60, 40)):
    """A JPEG stored `stored` (width, height) with an EXIF orientation; a red square in its stored top-left."""
    img = Image.new("RGB", stored, "white")
    ImageDraw.Draw(img).rectangle((0, 0, 9, 9), fill="red")
    exif = img.getexif()
    exif[0x0112] = orientation
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, exif=exif, quality=95)


def test_coco_boxes_drawn_on_the_displayed_photo_train_on_the_displayed_pixels(tmp_path):
    """A phone photo stored 60x40 with orientation 6 shows as 40x60. A json giving 40x60 was annotated as displayed
    (browser-based tools): the loader turns the image, so the box lands on the red square; a json giving the stored
    60x40 keeps the stored pixels (COCO's own convention); where the size cannot tell (a half turn), the stored
    pixels are used and a warning names the file."""
    from trainer.families.detection.images import DetectionImages

    for name, orientation in (("displayed.jpg", 6), ("stored.jpg", 6), ("halfturn.jpg", 3)):
        _phone_photo(tmp_path / "images" / name, orientation)
    # orientation 6 turns the stored top-left corner to the displayed top-right: x 30..40, y 0..10 of 40x60
    data = {"images": [{"id": 1, "file_name": "displayed.jpg", "width": 40, "height": 60},
                       {"id": 2, "file_name": "stored.jpg", "width": 60, "height": 40},
                       {"id": 3, "file_name": "halfturn.jpg", "width": 60, "height": 40}],
            "categories": [{"id": 1, "name": "square"}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [30, 0, 10, 10]},
                            {"id": 2, "image_id": 2, "category_id": 1, "bbox": [0, 0, 10, 10]},
                            {"id": 3, "image_id": 3, "category_id": 1, "bbox": [0, 0, 10, 10]}]}
    (tmp_path / "train.json").write_text(json.dumps(data))
    scan = scan_detection(str(tmp_path / "train.json"), seed=0)
    records = {Path(r.path).name: r for r in scan.train + scan.val}
    assert [records[n].exif for n in ("displayed.jpg", "stored.jpg", "halfturn.jpg")] == [True, False, False]
    unknown = [w for w in scan.warnings if "EXIF orientation" in w]
    assert len(unknown) == 1 and "halfturn.jpg" in unknown[0]

    images = DetectionImages([records["displayed.jpg"], records["stored.jpg"]], resolution=60)
    for index in range(2):
        pixels, boxes, *_ = images._load(index)
        x1, y1, x2, y2 = (int(v) for v in boxes[0])
        inside = pixels[:, y1 + 2:y2 - 2, x1 + 2:x2 - 2].float().mean(dim=(1, 2))
        assert inside[0] > 200 and inside[1] < 60, (index, inside)  # red under the box, in both conventions
