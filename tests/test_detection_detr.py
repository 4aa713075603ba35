"""RT-DETR v2 and D-FINE through transformers: the labels they are given (hand-checked, and as their image
processor makes them), their loss against transformers' own for the same inputs, weights through
`from_pretrained` (the hub's code path) with the head replaced, a short run of each tiny demo architecture that
lowers the loss and leaves a detector that reloads with identical predictions, the checks that refuse what
they cannot do, and the demo preset on two processes (DDP on gloo) through the launcher.

Everything is built from the demo's tiny configs (detr.tiny_config) with random weights: nothing is downloaded.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.engine_helpers import launch, log_of
from tests.test_detection import make_family, train_steps
from trainer.core.config import load_config
from trainer.core.events import read_events
from trainer.errors import ConfigError, UserError
from trainer.families.detection.detr import build_detector, seeded, tiny_config, to_detr_labels
from trainer.families.detection.eval import predict

REPO = Path(__file__).resolve().parents[1]
TINY = {"rtdetr_v2_tiny": "rt_detr_v2", "dfine_tiny": "d_fine"}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from trainer.families.detection.demo import make_shapes_coco

    return make_shapes_coco(tmp_path_factory.mktemp("shapes") / "shapes-coco", train=16, val=4)


def test_labels_are_normalised_center_boxes_as_the_image_processor_makes_them():
    from transformers import RTDetrImageProcessor

    # A 128 x 100 (w x h) image, box x1 y1 x2 y2 = 10 20 40 60 px, our label 2 (the second class):
    # center (25, 40) px = (25/128, 40/100), size 30 x 40 px = (30/128, 40/100); transformers' class 1.
    target = {"boxes": torch.tensor([[10.0, 20.0, 40.0, 60.0]]), "labels": torch.tensor([2])}
    labels = to_detr_labels(target, height=100, width=128)
    assert labels["class_labels"].tolist() == [1]
    torch.testing.assert_close(labels["boxes"], torch.tensor([[25 / 128, 40 / 100, 30 / 128, 40 / 100]]))
    # The fine-tuning guide's route: a COCO annotation ([x, y, w, h], category 1 = transformers' class 1)
    # through the processor, which also stretches the image to its square.
    processor = RTDetrImageProcessor(size={"height": 64, "width": 64})
    coco = {"image_id": 0, "annotations": [{"bbox": [10, 20, 30, 40], "category_id": 1, "area": 1200, "iscrowd": 0}]}
    theirs = processor(images=[torch.rand(3, 100, 128)], annotations=[coco], do_rescale=False, return_tensors="pt")
    torch.testing.assert_close(labels["boxes"], theirs["labels"][0]["boxes"])
    assert theirs["labels"][0]["class_labels"].tolist() == [1]
    empty = to_detr_labels({"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}, 64, 64)
    assert empty["boxes"].shape == (0, 4) and empty["class_labels"].numel() == 0


@pytest.mark.parametrize("arch", sorted(TINY))
def test_loss_is_transformers_own_loss_for_the_same_images_and_boxes(arch):
    """Our route (0..1 images of any size, x1 y1 x2 y2 pixel boxes, labels 1..K) and the fine-tuning guide's
    (the image processor given COCO annotations, then model(pixel_values, labels).loss) give the same loss."""
    torch.manual_seed(0)
    model, _ = build_detector(arch, 3, weights="none", resolution=64)
    model.train()
    images = [torch.rand(3, 48, 64), torch.rand(3, 64, 40)]
    targets = [{"boxes": torch.tensor([[4.0, 6.0, 30.0, 40.0], [35.0, 10.0, 60.0, 30.0]]), "labels": torch.tensor([1, 3])},
               {"boxes": torch.tensor([[5.0, 5.0, 25.0, 50.0]]), "labels": torch.tensor([2])}]
    with seeded(model, [7]):
        ours = model(images, targets)
    coco = [{"image_id": i, "annotations": [
        {"bbox": [x1, y1, x2 - x1, y2 - y1], "category_id": int(label) - 1, "area": (x2 - x1) * (y2 - y1), "iscrowd": 0}
        for (x1, y1, x2, y2), label in zip(t["boxes"].tolist(), t["labels"])]} for i, t in enumerate(targets)]
    inputs = model.processor(images=images, annotations=coco, do_rescale=False, return_tensors="pt")
    with seeded(model, [7]):  # the same denoising noise
        theirs = model.detr(pixel_values=inputs["pixel_values"], labels=inputs["labels"])
    assert len(ours) > 10 and math.isfinite(theirs.loss.item())
    torch.testing.assert_close(sum(ours.values()), theirs.loss)


def test_weights_load_through_from_pretrained_with_a_new_head(tmp_path):
    """A save_pretrained folder goes down the path a hub id does (from_pretrained, ignore_mismatched_sizes): the
    body keeps the checkpoint's weights, the class-dependent tensors are fresh for our classes, the backbone's
    BatchNorm is frozen; a checkpoint of another model type is refused."""
    from transformers import DFineConfig, DFineForObjectDetection, RTDetrV2Config, RTDetrV2ForObjectDetection

    torch.manual_seed(0)
    coco = RTDetrV2ForObjectDetection(RTDetrV2Config(**tiny_config("rt_detr_v2"), num_labels=80))
    coco.save_pretrained(tmp_path / "rtdetr")
    DFineForObjectDetection(DFineConfig(**tiny_config("d_fine"), num_labels=80)).save_pretrained(tmp_path / "dfine")

    model, info = build_detector("rtdetr_v2_tiny", 3, weights=str(tmp_path / "rtdetr"), resolution=96,
                                 class_names=["circle", "square", "triangle"])
    assert model.detr.config.id2label == {0: "circle", 1: "square", 2: "triangle"}
    assert model.processor.size == {"height": 96, "width": 96}
    assert info["frozen_bn"] and {"model.decoder.class_embed.0.weight", "model.enc_score_head.weight",
                                  "model.denoising_class_embed.weight"} <= set(info["fresh"])
    assert model.detr.class_embed[0].out_features == 3
    ours, theirs = model.detr.state_dict(), coco.state_dict()
    kept = [k for k in ours if k not in info["fresh"] and k in theirs and not k.startswith("class_embed.")]  # tied
    assert len(kept) > 0.8 * len(ours) and all(torch.equal(ours[k], theirs[k]) for k in kept)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.detr.model.backbone.modules())
    with pytest.raises(UserError, match="holds a 'd_fine' model, not a 'rt_detr_v2' one"):
        build_detector("rtdetr_v2_tiny", 3, weights=str(tmp_path / "dfine"))


@pytest.mark.slow  # trains until it learns, in process: 4-6 s each on 2 cores
@pytest.mark.parametrize("arch", sorted(TINY))
def test_tiny_detr_learns_and_reloads_with_identical_predictions(arch, shapes, tmp_path):
    from trainer.families.detection.predict import load_detector

    torch.set_num_threads(1)
    family = make_family(shapes, arch, tmp_path, "detection.eval_images=2", "train.lr=1e-3")
    rest, backbone = family.param_groups()
    assert (rest["lr"], backbone["lr"]) == (1e-3, pytest.approx(1e-4))  # the RT-DETR recipe's backbone at 0.1
    first = [(0, 0, 0), (1, 0, 1)]
    with torch.no_grad():
        before = family.loss(first).item()
    assert family.loss(first).item() == before  # the denoising noise is the samples', not the global RNG's
    losses = train_steps(family, 12)
    assert all(math.isfinite(x) for x in losses)
    with torch.no_grad():
        after = family.loss(first).item()
    assert after < 0.8 * before, (before, after)

    metrics = family.evaluate(12)
    assert metrics["images"] == 2 and {"map", "map50", "per_class"} <= set(metrics)
    (caption, [picture]), = family.render_samples(12)
    assert "predicted" in caption and picture.width > 2 * 128
    outputs = family.save_outputs(tmp_path / "output", step=12)
    detector = load_detector(outputs[0])
    assert detector.classes == family.classes and detector.metadata["architecture"] == arch
    image, _ = family.val_set.eval_sample(0)
    ours = predict(family.model, [image], torch.device("cpu"))[0]
    reloaded = predict(detector.model, [image], torch.device("cpu"))[0]
    assert len(ours["boxes"]) == 50  # every query of the tiny config: threshold 0, under the cap of 100
    for key in ("boxes", "scores", "labels"):
        torch.testing.assert_close(reloaded[key], ours[key], rtol=0, atol=0)
    found = detector.predict(family.scan.val[0].path, score_threshold=0.0)
    assert all(set(f) == {"box", "label", "name", "score"} for f in found) and len(found) == 50
    assert all(-1 <= f["box"][0] <= f["box"][2] <= 129 and 1 <= f["label"] <= 3 for f in found)

    # the save_pretrained folder: transformers' own classes load it with the class names, and its processor and
    # post-processing give the detector's predictions on the file
    from transformers import AutoImageProcessor, AutoModelForObjectDetection

    folder = tmp_path / "output" / "transformers"
    assert str(folder) in outputs
    model, processor = AutoModelForObjectDetection.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)
    assert model.config.id2label == dict(enumerate(family.classes))
    picture = Image.open(family.scan.val[0].path).convert("RGB")
    with torch.no_grad():
        raw = model.eval()(**processor(images=picture, return_tensors="pt"))
    [theirs] = processor.post_process_object_detection(raw, threshold=0.0, target_sizes=[picture.size[::-1]])
    mine = sorted(found, key=lambda f: -f["score"])
    torch.testing.assert_close(theirs["scores"], torch.tensor([f["score"] for f in mine]), rtol=0, atol=1e-4)
    torch.testing.assert_close(theirs["boxes"], torch.tensor([f["box"] for f in mine]), rtol=0, atol=1e-2)
    assert [family.classes[label] for label in theirs["labels"].tolist()] == [f["name"] for f in mine]


def test_bf16_training_and_trainer_weights_as_a_start(shapes, tmp_path):
    """Autocast to bf16 reaches the Hungarian matcher (scipy) without breaking it, and a .safetensors written
    here starts another run (other classes: fresh head) through the same builder."""
    from trainer.engine.precision import Amp

    torch.set_num_threads(1)
    family = make_family(shapes, "rtdetr_v2_tiny", tmp_path, precision="bf16")
    assert math.isfinite(train_steps(family, 1, Amp("bf16", "cpu"))[0])
    assert {p.dtype for p in family.model.parameters()} == {torch.float32}
    saved, folder = family.save_outputs(tmp_path / "output", step=1)  # the file, its save_pretrained folder
    assert folder.endswith("transformers")
    model, info = build_detector("rtdetr_v2_tiny", 5, weights=saved, resolution=64)
    assert info["frozen_bn"] and "detr.class_embed.0.weight" in info["fresh"]
    body = "detr.model.encoder.aifi.0.layers.0.self_attn.k_proj.weight"
    torch.testing.assert_close(model.state_dict()[body], family.model.state_dict()[body])
    with pytest.raises(UserError, match="holds a rtdetr_v2_tiny detector, not dfine_tiny"):
        build_detector("dfine_tiny", 3, weights=saved)


DETR = {"model": {"family": "detection", "path": "rtdetr_v2_tiny"}, "method": "full", "devices": "cpu:1",
        "data": {"path": "demo://shapes-coco", "resolution": 128}, "detection": {"weights": "none"}}


@pytest.mark.parametrize("overrides, problem", [
    (["detection.trainable_backbone_layers=2"], "always trains its whole backbone"),
    (["data.resolution=100"], "needs a multiple of 32"),
    (["detection.weights=coco"], "has no COCO weights"),
    (["detection.backbone_lr_scale=0"], "must be greater than 0"),
    (["detection.weights=/nonexistent/rtdetr"], "neither coco, none, a hub id"),
    (["detection.weights=pyproject.toml"], "not a rt_detr_v2 checkpoint"),
    (["detection.weights=trainer"], "has no config.json"),
])
def test_checks_refuse_what_a_detr_cannot_do(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(DETR, overrides)


def test_checks_accept_hub_ids_and_the_published_sizes():
    for arch in ("rtdetr_v2_r18vd", "dfine_s"):
        for weights in ("coco", "none", "ustc-community/dfine-small-obj2coco"):
            load_config(DETR, [f"model.path={arch}", f"detection.weights={weights}", "data.resolution=640",
                               "detection.backbone_lr_scale=0.05"])


@pytest.mark.slow
def test_rtdetr_demo_preset_on_two_processes_reloads(tmp_path, monkeypatch):
    """The shipped demo preset, shortened, on 2 CPU processes (DDP on gloo, accumulation 2): it runs to `done`,
    evaluates over both ranks' images and leaves outputs that load_detector reloads and predicts with."""
    from trainer.families.detection.predict import load_detector

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = load_config(REPO / "presets" / "detection-rtdetr-demo.yaml", [
        "devices=cpu:2", "batch.per_device=1", "train.steps=4", "eval.every=4", "sample.every=4",
        "checkpoint.every=0", "detection.eval_images=4"])
    run_dir, final = launch(tmp_path / "runs", config, timeout=400)
    assert final["type"] == "done", log_of(run_dir)
    events = read_events(run_dir)
    assert (events[0]["world_size"], events[0]["accumulation"]) == (2, 2)
    [evaluation] = [e for e in events if e["type"] == "eval"]
    assert evaluation["images"] == 4 and evaluation["step"] == 4
    losses = [e["loss"] for e in events if e["type"] == "progress"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    detector = load_detector(run_dir / "output" / "model.safetensors")
    image = run_dir.parent / ".demo" / "shapes-coco" / "images" / "val_0000.png"  # built there by the launcher
    found = detector.predict(image, score_threshold=0.0)
    assert found and all(f["name"] in ("circle", "square", "triangle") for f in found)
