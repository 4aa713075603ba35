"""Detection mAP is COCO's: crowd regions (iscrowd=1) are ignore regions, not dropped ground truth, and images
without objects count. The run's evaluation path (scan -> validation targets -> compute_metrics) is compared
with faster-coco-eval's COCOeval on the same annotation file and detections."""

import json

import numpy as np
import torch
from PIL import Image

from trainer.families.detection.data import scan_detection
from trainer.families.detection.eval import compute_metrics
from trainer.families.detection.images import DetectionImages

SIZE = 96


def _fixture(root):
    rng = np.random.default_rng(7)
    images, annotations, detections, next_id = [], [], [], 1
    (root / "images").mkdir(parents=True)
    for i in range(12):
        Image.new("RGB", (SIZE, SIZE), "gray").save(root / "images" / f"{i}.png")
        images.append({"id": i, "file_name": f"{i}.png", "width": SIZE, "height": SIZE})
        for k in range(0 if i in (3, 8) else 3):  # two images without any object
            x, y = rng.uniform(0, 50, 2)
            w, h = rng.uniform(12, 40, 2)
            crowd = int(k == 0 and i % 3 == 0)
            category = int(rng.integers(1, 3)) * 5  # category ids 5 and 10
            annotations.append({"id": next_id, "image_id": i, "category_id": category, "bbox": [x, y, w, h],
                                "area": w * h, "iscrowd": crowd})
            next_id += 1
            for _ in range(1 + crowd):  # detections near the truth; inside crowd regions too
                jitter = rng.normal(0, 3, 4)
                detections.append({"image_id": i, "category_id": category, "score": float(rng.uniform(0.2, 1)),
                                   "bbox": [x + jitter[0], y + jitter[1], max(4, w + jitter[2]), max(4, h + jitter[3])]})
        for _ in range(2):  # false positives
            x, y = rng.uniform(0, 60, 2)
            detections.append({"image_id": i, "category_id": int(rng.integers(1, 3)) * 5,
                               "score": float(rng.uniform(0, 0.6)), "bbox": [x, y, 20, 20]})
    categories = [{"id": 5, "name": "circle"}, {"id": 10, "name": "square"}]
    gt = {"images": images, "annotations": annotations, "categories": categories}
    (root / "train.json").write_text(json.dumps(gt))
    (root / "val.json").write_text(json.dumps(gt))
    return gt, detections


def _cocoeval(gt: dict, detections: list[dict]) -> tuple[float, float]:
    from faster_coco_eval import COCO, COCOeval_faster

    coco = COCO()
    coco.dataset = json.loads(json.dumps(gt))
    coco.createIndex()
    evaluator = COCOeval_faster(coco, coco.loadRes(detections), "bbox", print_function=lambda *a: None)
    evaluator.evaluate(), evaluator.accumulate(), evaluator.summarize()
    return float(evaluator.stats[0]), float(evaluator.stats[1])


def test_map_with_crowds_and_empty_images_equals_cocoeval(tmp_path):
    gt, detections = _fixture(tmp_path)
    scan = scan_detection(str(tmp_path))
    crowds = sum(a["iscrowd"] for a in gt["annotations"])
    assert crowds >= 2 and sum(len(r.crowd_boxes) for r in scan.val) == crowds
    val = DetectionImages(scan.val, SIZE)  # the longest side is already SIZE: boxes stay in the file's pixels
    label_of = {5: 1, 10: 2}
    targets, preds = [], []
    for index, record in enumerate(scan.val):
        targets.append(val.eval_sample(index)[1])
        image_id = int(record.path.rsplit("/", 1)[-1].split(".")[0])
        mine = [d for d in detections if d["image_id"] == image_id]
        boxes = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (d["bbox"] for d in mine)]).reshape(-1, 4)
        preds.append({"boxes": boxes.float(), "scores": torch.tensor([d["score"] for d in mine]),
                      "labels": torch.tensor([label_of[d["category_id"]] for d in mine], dtype=torch.int64)})
    metrics, _ = compute_metrics(preds, targets, scan.classes)
    expected_map, expected_map50 = _cocoeval(gt, detections)
    assert abs(metrics["map"] - expected_map) < 1e-4 and abs(metrics["map50"] - expected_map50) < 1e-4
    # What dropping the crowds (the old behaviour) would have reported: a different, wrong number.
    no_crowds = [{k: v[t["iscrowd"] == 0] for k, v in t.items() if k != "iscrowd"} for t in targets]
    assert abs(compute_metrics(preds, no_crowds, scan.classes)[0]["map"] - expected_map) > 1e-3
    # ... and crowd regions never reach training.
    assert all(len(val.train_sample(val._load(i), seed=0)[1]["boxes"]) == len(r.boxes) for i, r in enumerate(scan.val))
