"""The detection family: mAP against hand-computed values, a short run of every architecture (train, evaluate,
draw, save, reload, predict), fp32 evaluation under a bf16 plan, and real runs through the launcher: the demo
preset learning, and 1 process x 4 = 2 processes x 1 x accumulation 2 for Faster R-CNN.

The launcher runs set OMP_NUM_THREADS=1: on a shared 2-core machine, two threads per process under load are
several times slower than one (the product leaves it to the launcher's own default).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.engine_helpers import assert_same_weights, final_weights, launch, log_of
from trainer.core.config import load_config
from trainer.core.data.stream import BatchStream
from trainer.core.events import read_events
from trainer.families.detection.eval import compute_metrics, predict
from trainer.core.hardware import CPU_ONLY
from trainer.core.launcher import prepare_run, start_run
from trainer.core.plan import make_plan

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """A small version of the demo set: 16 training and 4 validation images of 128 px, 3 classes."""
    from trainer.families.detection.demo import make_shapes_coco

    return make_shapes_coco(tmp_path_factory.mktemp("shapes") / "shapes-coco", train=16, val=4)


@pytest.fixture(scope="module")
def demo_set(tmp_path_factory):
    from trainer.families.detection.demo import ensure_detection_demo

    return ensure_detection_demo(tmp_path_factory.mktemp("demo"))["shapes-coco"]


# ----------------------------------------------------------------------------------------------------------------
# mAP


def _t(boxes, labels):
    return {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4), "labels": torch.tensor(labels)}


def _p(boxes, scores, labels):
    return {**_t(boxes, labels), "scores": torch.tensor(scores, dtype=torch.float32)}


def test_map_matches_hand_computed_values():
    targets = [_t([[10, 10, 50, 50], [60, 60, 100, 100]], [1, 1]), _t([[20, 20, 80, 80]], [2])]
    perfect = [_p(t["boxes"].tolist(), [0.9] * len(t["labels"]), t["labels"].tolist()) for t in targets]
    metrics, curves = compute_metrics(perfect, targets, ["cat", "dog"])
    assert (metrics["map"], metrics["map50"]) == (1.0, 1.0)
    assert metrics["per_class"] == {"cat": {"map": 1.0, "map50": 1.0}, "dog": {"map": 1.0, "map50": 1.0}}

    # cat: one exact box (0.9) and one shifted by 6 px (0.8; IoU 1360/1840 = 0.739): both match at IoU 0.50-0.70,
    # only the first at 0.75-0.95, where recall stops at 0.5 with precision 1: AP = 51/101 (COCO's 101 recalls).
    # dog: a false positive scored above the true one: precision 0.5 at every recall: AP = 0.5 everywhere.
    preds = [_p([[10, 10, 50, 50], [66, 60, 106, 100]], [0.9, 0.8], [1, 1]),
             _p([[0, 100, 30, 130], [20, 20, 80, 80]], [0.95, 0.7], [2, 2])]
    metrics, curves = compute_metrics(preds, targets, ["cat", "dog"])
    cat = (5 * 1.0 + 5 * 51 / 101) / 10
    assert metrics["per_class"]["cat"] == {"map": pytest.approx(cat, abs=1e-4), "map50": 1.0}
    assert metrics["per_class"]["dog"] == {"map": pytest.approx(0.5, abs=1e-4), "map50": pytest.approx(0.5, abs=1e-4)}
    assert metrics["map"] == pytest.approx((cat + 0.5) / 2, abs=1e-4)
    assert metrics["map50"] == pytest.approx(0.75, abs=1e-4)
    assert metrics["map75"] == pytest.approx((51 / 101 + 0.5) / 2, abs=1e-4)
    assert curves["cat"] == [1.0] * 101 and curves["dog"] == pytest.approx([0.5] * 101)
    json.dumps(metrics)  # goes into an event as it is


# ----------------------------------------------------------------------------------------------------------------
# In-process family (what the worker does, without torchrun)


def make_family(data: Path, arch: str, tmp_path: Path, *overrides: str, precision: str = "fp32"):
    from trainer.families.protocol import WorkerContext
    from trainer.families.detection.family import DetectionFamily

    config = load_config({"model": {"family": "detection", "path": arch}, "method": "full", "devices": "cpu:1",
                          "precision": precision, "data": {"path": str(data), "resolution": 64, "flip": True},
                          "detection": {"weights": "none", "sample_images": 1},
                          "batch": {"total": 2, "per_device": 2}}, list(overrides))
    warnings: list[str] = []
    ctx = WorkerContext(config=config, plan=make_plan(config, CPU_ONLY), run_dir=tmp_path,
                        cache_dir=tmp_path / ".cache", device=torch.device("cpu"), rank=0, world_size=1,
                        accelerator=None, log_warning=warnings.append)
    family = DetectionFamily(ctx)
    family.load()
    family.items = family.prepare_data()
    family.set_prepared([family.model])
    family.warnings = warnings
    fewer_proposals(family.model)
    return family


def fewer_proposals(model) -> None:
    """Faster R-CNN's box head on 512 sampled / 1000 kept proposals per image dominates a CPU step: use fewer."""
    if hasattr(model, "rpn"):
        model.rpn._pre_nms_top_n = model.rpn._post_nms_top_n = {"training": 200, "testing": 50}
        model.roi_heads.fg_bg_sampler.batch_size_per_image = 64


def train_steps(family, steps: int, amp=None) -> list[float]:
    """The loop's maths, minus DDP: seeded micro-batches from the stream, autocast for the forward only."""
    from trainer.engine.precision import Amp

    cfg, plan = family.cfg, family.ctx.plan
    amp = amp or Amp(plan.precision, "cpu")
    stream = BatchStream(family.items, total=plan.total, per_device=plan.per_device, world_size=1, seed=cfg.seed)
    optimizer = torch.optim.AdamW(family.param_groups(), lr=1e-3)
    losses = []
    for step in range(steps):
        samples = [(pos, *stream.item(pos)) for pos in stream.positions(step, 0, 0)]
        with amp.autocast():
            loss = family.loss(samples)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


ARCHITECTURES = ["fcos_tiny", "fasterrcnn_mobilenet_v3_large_fpn", "ssdlite320_mobilenet_v3_large",
                 "retinanet_resnet50_fpn_v2", "fcos_resnet50_fpn", "fasterrcnn_resnet50_fpn_v2"]


@pytest.mark.slow  # seven detectors trained, evaluated and reloaded in process: 2-6 s each on 2 cores
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_trains_evaluates_draws_saves_and_reloads(arch, shapes, tmp_path):
    from trainer.families.detection.predict import load_detector

    torch.set_num_threads(1)
    family = make_family(shapes, arch, tmp_path, "detection.eval_images=2")
    assert family.classes == ["circle", "square", "triangle"]
    before = {k: v.clone() for k, v in family.trainable_state().items()}
    losses = train_steps(family, 2)
    assert all(math.isfinite(x) for x in losses)
    after = family.trainable_state()
    assert any(not torch.equal(before[k], after[k]) for k in before), "training changed nothing"
    assert {t.dtype for k, t in after.items() if t.is_floating_point()} == {torch.float32}

    metrics = family.evaluate(2)
    assert {"map", "map50", "map75", "per_class", "images"} <= set(metrics) and metrics["images"] == 2
    assert set(metrics["per_class"]) <= set(family.classes)
    (caption, [picture]), = family.render_samples(2)
    assert "predicted" in caption and picture.width > 2 * 128  # truth and prediction side by side, enlarged
    (index, caption, curve), = family.eval_samples(2)
    assert index == 1 and "precision-recall" in caption and curve.size == (560, 400)

    outputs = family.save_outputs(tmp_path / "output", step=2)
    assert [Path(p).name for p in outputs] == ["model.safetensors"]
    if "resnet50" in arch:
        return  # rebuilding a ResNet-50 detector costs seconds; reloading is the same code for every architecture
    detector = load_detector(outputs[0])
    assert detector.classes == family.classes and detector.metadata["architecture"] == arch
    fewer_proposals(detector.model)
    image, _ = family.val_set.eval_sample(0)
    with torch.no_grad():
        ours = predict(family.model, [image], torch.device("cpu"))[0]
    reloaded = predict(detector.model, [image], torch.device("cpu"))[0]
    torch.testing.assert_close(reloaded["boxes"], ours["boxes"])  # the same detector, bit for bit
    found = detector.predict(family.scan.val[0].path, score_threshold=0.0)
    assert all(set(f) == {"box", "label", "name", "score"} for f in found)
    assert all(0 <= f["box"][0] <= f["box"][2] <= 128 for f in found)  # in the original image's pixels (128 px)


def test_pretrained_weights_file_freezes_batchnorm_and_replaces_the_head(shapes, tmp_path):
    """A local weights file (here: a 91-class model saved by torchvision) is 'pretrained': FrozenBatchNorm in
    the backbone, early stages frozen, and the class-dependent head keeps a fresh initialisation."""
    import torchvision
    from torchvision.ops.misc import FrozenBatchNorm2d

    torch.manual_seed(1)
    coco_like = torchvision.models.get_model("fasterrcnn_mobilenet_v3_large_fpn", weights=None,
                                             weights_backbone=None, num_classes=91)
    torch.save(coco_like.state_dict(), tmp_path / "coco-like.pth")
    family = make_family(shapes, "fasterrcnn_mobilenet_v3_large_fpn", tmp_path,
                         f"detection.weights={tmp_path / 'coco-like.pth'}")
    model = family.model
    assert family.frozen_bn and not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.backbone.modules())
    assert any(isinstance(m, FrozenBatchNorm2d) for m in model.backbone.modules())
    assert not model.backbone.body["0"][0].weight.requires_grad and model.backbone.body["16"][0].weight.requires_grad
    assert model.roi_heads.box_predictor.cls_score.out_features == 4  # 3 classes + background
    loaded = coco_like.state_dict()
    fpn = "backbone.fpn.layer_blocks.0.0.weight"
    assert torch.equal(model.state_dict()[fpn], loaded[fpn])
    with pytest.raises(Exception, match="does not fit this architecture"):
        make_family(shapes, "fcos_tiny", tmp_path, f"detection.weights={tmp_path / 'coco-like.pth'}")


@pytest.mark.slow  # trains and evaluates in process (~5 s)
def test_evaluation_and_samples_are_fp32_under_a_bf16_plan(shapes, tmp_path, monkeypatch):
    """Training autocasts to bf16; predictions for mAP and samples must not: torchvision's box decoding under
    bf16 snaps coordinates to a 0.125-0.25 px grid at these sizes (and 2-4 px at 800 px)."""
    import trainer.families.detection.family as detection
    from trainer.engine.precision import Amp

    torch.set_num_threads(1)
    family = make_family(shapes, "fasterrcnn_mobilenet_v3_large_fpn", tmp_path, "detection.eval_images=2",
                         precision="bf16")
    assert family.ctx.plan.precision == "bf16"
    amp = Amp("bf16", "cpu")
    losses = train_steps(family, 1, amp)
    assert math.isfinite(losses[0])
    assert {p.dtype for p in family.model.parameters()} == {torch.float32}  # trainable weights stay fp32
    family.model.roi_heads.score_thresh = 0.0  # every box counts for the comparison

    seen = []
    real = detection.compute_metrics
    monkeypatch.setattr(detection, "compute_metrics", lambda p, t, c: (seen.extend(p), real(p, t, c))[1])
    with amp.autocast():  # even if autocast leaked around the evaluation, it runs in fp32
        family.evaluate(1)
        family.render_samples(1)
    images = [family.val_set.eval_sample(i)[0] for i in range(len(seen))]
    family.model.eval()
    with torch.no_grad():
        reference = family.model(images)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = family.model(images)
    family.model.train()

    def on_bf16_grid(boxes):
        return (boxes == boxes.bfloat16().float()).float().mean().item()

    assert low[0]["boxes"].dtype == torch.bfloat16 and on_bf16_grid(low[0]["boxes"].float()) == 1.0  # the trap
    for ours, ref in zip(seen, reference):
        assert ours["boxes"].dtype == torch.float32 and len(ours["boxes"]) > 10
        torch.testing.assert_close(ours["boxes"], ref["boxes"])
        assert on_bf16_grid(ours["boxes"]) < 0.5  # fine coordinates, not a coarse grid


# ----------------------------------------------------------------------------------------------------------------
# Real runs through the launcher


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


DEMO_STEPS, DEMO_EVAL_EVERY = 160, 40
DEMO_MAP50 = 0.8  # measured with these overrides of the demo preset: see the assertion's message


@pytest.mark.slow
def test_demo_preset_learns_and_leaves_a_detector_that_reloads(demo_set, tmp_path, one_thread):
    from trainer.families.detection.predict import load_detector

    config = load_config(REPO / "presets" / "detection-demo.yaml", [
        f"data.path={demo_set}", "devices=cpu:1", f"train.steps={DEMO_STEPS}", f"eval.every={DEMO_EVAL_EVERY}",
        f"sample.every={DEMO_STEPS // 2}", "checkpoint.every=0"])
    run_dir, final = launch(tmp_path / "runs", config, timeout=400)
    assert final["type"] == "done", log_of(run_dir)
    events = read_events(run_dir)
    evals = [e for e in events if e["type"] == "eval"]
    curve = {e["step"]: e["map50"] for e in evals}
    print("demo mAP50 by step:", curve, "mAP:", {e["step"]: e["map"] for e in evals})
    assert list(curve) == [40, 80, 120, 160]
    assert curve[160] >= DEMO_MAP50 and curve[160] > curve[40] + 0.2, curve
    assert set(evals[-1]["per_class"]) == {"circle", "square", "triangle"}
    samples = [e for e in events if e["type"] == "sample"]
    assert {e["step"] for e in samples} == {0, 40, 80, 120, 160}
    assert [e["step"] for e in samples if "precision-recall" in e["prompt"]] == [40, 80, 120, 160]
    assert all((run_dir / e["path"]).stat().st_size > 0 for e in samples)
    best = [e for e in events if e["type"] == "best"]
    assert best and best[-1]["metric"] == "map" and best[-1]["value"] == max(e["map"] for e in evals)
    assert json.loads((run_dir / "checkpoints/best/COMPLETE").read_text())["step"] == best[-1]["step"]
    assert sorted(final["outputs"]) == ["output/best.safetensors", "output/model.safetensors"]

    detector = load_detector(run_dir / "output" / "best.safetensors")
    val = json.loads((Path(demo_set) / "val.json").read_text())
    hits = total = 0
    for image in val["images"][:8]:
        truth = [a for a in val["annotations"] if a["image_id"] == image["id"]]
        found = detector.predict(Path(demo_set) / image["file_name"], score_threshold=0.3)
        for a in truth:
            x, y, w, h = a["bbox"]
            total += 1
            hits += any(f["label"] == a["category_id"] and _iou(f["box"], [x, y, x + w, y + h]) > 0.5 for f in found)
    assert hits >= 0.6 * total, (hits, total)


def _iou(a, b) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return w * h / union


@pytest.mark.slow
def test_faster_rcnn_on_two_processes_with_accumulation_matches_one_process(shapes, tmp_path, one_thread):
    """Faster R-CNN's losses accumulate exactly (fixed anchor/proposal samples per image, drawn from generators
    seeded by each sample's position; frozen BatchNorm from a 'pretrained' weights file): 1 process x 4 and
    2 processes x 1 x accumulation 2 train the same weights. Also the two-process run through the launcher."""
    from trainer.families.detection.models import build_detector

    torch.manual_seed(0)
    model, _ = build_detector("fasterrcnn_mobilenet_v3_large_fpn", 3, weights="none", resolution=192)
    torch.save(model.state_dict(), tmp_path / "start.pth")
    base = {"model": {"family": "detection", "path": "fasterrcnn_mobilenet_v3_large_fpn"}, "method": "full",
            "precision": "fp32", "data": {"path": str(shapes), "resolution": 192, "flip": True},
            "detection": {"weights": str(tmp_path / "start.pth"), "sample_images": 0, "eval_images": 2},
            # SGD, not Adam: Adam turns the float noise of near-zero gradients into full-size steps
            "batch": {"total": 4}, "train": {"steps": 2, "lr": 0.02, "optimizer": "sgd", "scheduler": "constant"},
            "checkpoint": {"every": 0}, "sample": {"every": 0}}
    runs = []
    for overrides in (["name=one", "devices=cpu:1", "batch.per_device=4"],
                      ["name=two", "devices=cpu:2", "batch.per_device=1"]):
        config = load_config(base, overrides)
        run_dir, plan = prepare_run(config, tmp_path / "runs", hw=CPU_ONLY)
        runs.append((run_dir, start_run(run_dir, plan, config)))  # both at once: the test's time is mostly start-up
    for run_dir, proc in runs:
        assert proc.wait(timeout=400)["type"] == "done", log_of(run_dir)
    (one_dir, _), (two_dir, _) = runs
    plan = read_events(two_dir)[0]
    assert (plan["world_size"], plan["per_device"], plan["accumulation"]) == (2, 1, 2)
    start = model.state_dict()
    one_w, two_w = final_weights(one_dir), final_weights(two_dir)
    moved = max((one_w[k] - start[k]).abs().max().item() for k in one_w if one_w[k].is_floating_point())
    assert moved > 1e-3  # the weights did train
    assert_same_weights(one_w, two_w, rtol=1e-5, atol=1e-6)
    losses = [[e["loss"] for e in read_events(d) if e["type"] == "progress"] for d in (one_dir, two_dir)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    evals = [[e for e in read_events(d) if e["type"] == "eval"][-1] for d in (one_dir, two_dir)]
    assert evals[0]["images"] == evals[1]["images"] == 2  # the two ranks' predictions were gathered
    assert evals[0]["map"] == pytest.approx(evals[1]["map"], abs=1e-3)
