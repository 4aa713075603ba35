"""Evaluation and pictures for the detection family: COCO mAP with torchmetrics' MeanAveragePrecision on the
faster-coco-eval backend over the predictions of every process, the precision-recall curve as an image, and
predicted boxes drawn next to the ground truth.

Predictions are made in fp32 outside autocast: under bf16, torchvision's box decoding rounds coordinates to a
2-4 px grid, which would cost mAP at high IoU thresholds and draw boxes off by pixels.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from PIL import Image, ImageDraw

PALETTE = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#9a6324", "#469990",
           "#800000", "#808000", "#000075", "#bfef45", "#fabed4", "#dcbeff", "#aaffc3"]
RECALLS = [i / 100 for i in range(101)]  # COCO's recall thresholds


def color(label: int) -> str:
    return PALETTE[(label - 1) % len(PALETTE)]


def _luminance(hex_color: str) -> float:
    """WCAG relative luminance of "#rrggbb"."""
    channels = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def text_color(background: str) -> str:
    """Black or white, whichever reads better on `background` (the higher WCAG contrast ratio)."""
    lum = _luminance(background)
    return "#000000" if (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) else "#ffffff"


def draw_boxes(pixels: torch.Tensor, boxes: torch.Tensor, class_ids: list[int], texts: list[str]) -> torch.Tensor:
    """Boxes in their class colour; each label on a filled tag of that colour, its text black or white for
    contrast, so a label stays readable whatever the image under it (a blue label on a blue shape did not)."""
    from torchvision.utils import draw_bounding_boxes

    colors = [color(c) for c in class_ids]
    return draw_bounding_boxes(pixels, boxes, labels=texts, colors=colors, width=2, fill_labels=True,
                               label_background_colors=colors, label_colors=[text_color(c) for c in colors])


@torch.no_grad()
def predict(model: torch.nn.Module, images: list[torch.Tensor], device, batch_size: int = 8) -> list[dict]:
    """Detections (CPU tensors: boxes, scores, labels) of `images`, in fp32, in eval mode, outside autocast."""
    was_training = model.training
    model.eval()
    out: list[dict] = []
    try:
        with torch.autocast(device.type, enabled=False):
            for start in range(0, len(images), batch_size):
                batch = [im.to(device, torch.float32) for im in images[start:start + batch_size]]
                for det in model(batch):
                    out.append({"boxes": det["boxes"].float().cpu(), "scores": det["scores"].float().cpu(),
                                "labels": det["labels"].cpu()})
    finally:
        model.train(was_training)
    return out


def gather(items: list, world_size: int) -> list:
    """Every process's items, on every process (gloo or NCCL), in rank order."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return list(items)
    from trainer.families.components.collectives import all_gather_tensors

    # (index, prediction, target) items as named tensors (no pickles between ranks, see trainer.families.components.collectives)
    flat = {}
    for n, (index, pred, target) in enumerate(items):
        flat[f"{n}.index"] = torch.tensor([index])
        flat.update({f"{n}.pred.{k}": v for k, v in pred.items()})
        flat.update({f"{n}.target.{k}": v for k, v in target.items()})
    out = []
    for tensors in all_gather_tensors(flat):
        count = sum(1 for key in tensors if key.endswith(".index"))
        for n in range(count):
            parts: dict[str, dict[str, torch.Tensor]] = {"pred": {}, "target": {}}
            for key, value in tensors.items():
                head, _, rest = key.partition(".")
                if head == str(n) and "." in rest:
                    part, _, name = rest.partition(".")
                    parts[part][name] = value
            out.append((int(tensors[f"{n}.index"].item()), parts["pred"], parts["target"]))
    return out


def _value(x) -> float | None:
    x = float(x)
    return None if x < 0 or math.isnan(x) else round(x, 5)


def compute_metrics(preds: list[dict], targets: list[dict], classes: list[str]) -> tuple[dict, dict]:
    """(metrics for the `eval` event, {class name: precision at each of COCO's 101 recalls, IoU 0.5})."""
    from torchmetrics.detection import MeanAveragePrecision

    metric = MeanAveragePrecision(box_format="xyxy", iou_type="bbox", backend="faster_coco_eval", class_metrics=True,
                                  extended_summary=True, sync_on_compute=False)
    metric.update(preds, targets)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "encountered more than 100 detections": our cap decides that
        result = metric.compute()
    ids = [int(c) for c in torch.atleast_1d(result["classes"])]
    per_class_map = torch.atleast_1d(result["map_per_class"])
    precision = result.get("precision")  # (iou thresholds, recalls, classes, areas, max detections)
    per_class, curves = {}, {}
    for k, label in enumerate(ids):
        if not 1 <= label <= len(classes):
            continue
        name = classes[label - 1]
        ap50 = None
        if isinstance(precision, torch.Tensor) and precision.dim() == 5 and k < precision.shape[2]:
            curve = precision[0, :, k, 0, -1]
            if (curve > -1).any():
                ap50 = _value(curve.clamp(min=0).mean())
                curves[name] = curve.clamp(min=0).tolist()
        per_class[name] = {"map": _value(per_class_map[k]) if k < len(per_class_map) else None, "map50": ap50}
    metrics = {"map": _value(result["map"]), "map50": _value(result["map_50"]), "map75": _value(result["map_75"]),
               "mar100": _value(result["mar_100"]), "per_class": per_class, "images": len(preds)}
    return metrics, curves


# ----------------------------------------------------------------------------------------------------------------
# Pictures


def pr_curve_image(curves: dict[str, list[float]], title: str, size=(560, 400)) -> Image.Image:
    """Precision over recall at IoU 0.5, one line per class (PIL only: no plotting library needed)."""
    width, height = size
    left, right, top, bottom = 48, 150, 44, 36
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    x0, y0, x1, y1 = left, top, width - right, height - bottom

    def at(r: float, p: float):
        return x0 + r * (x1 - x0), y1 - p * (y1 - y0)

    for tick in range(0, 11, 2):
        v = tick / 10
        draw.line([at(v, 0), at(v, 1)], fill="#e5e5e5")
        draw.line([at(0, v), at(1, v)], fill="#e5e5e5")
        draw.text((at(v, 0)[0] - 8, y1 + 4), f"{v:.1f}", fill="black")
        draw.text((x0 - 28, at(0, v)[1] - 6), f"{v:.1f}", fill="black")
    draw.rectangle([x0, y0, x1, y1], outline="black")
    draw.text((8, 6), title, fill="black")
    draw.text(((x0 + x1) / 2 - 16, height - 16), "recall", fill="black")
    draw.text((8, y0 - 18), "precision", fill="black")
    names = list(curves)
    for i, name in enumerate(names):
        points = [at(r, p) for r, p in zip(RECALLS, curves[name])]
        draw.line(points, fill=PALETTE[i % len(PALETTE)], width=2)
        ap = sum(curves[name]) / len(curves[name])
        ly = y0 + 6 + 16 * i
        if ly < y1 - 10:
            draw.line([(x1 + 10, ly + 6), (x1 + 26, ly + 6)], fill=PALETTE[i % len(PALETTE)], width=3)
            draw.text((x1 + 30, ly), f"{name[:12]} {ap:.2f}", fill="black")
    if not names:
        draw.text((x0 + 20, (y0 + y1) / 2), "no ground truth boxes to evaluate", fill="black")
    return img


def draw_pair(pixels: torch.Tensor, target: dict, pred: dict, classes: list[str], threshold: float,
              min_side: int = 256) -> Image.Image:
    """Ground truth (left) and predictions scoring >= threshold (right) on the same image."""
    scale = max(1, math.ceil(min_side / max(pixels.shape[-2:])))
    if scale > 1:  # small images are enlarged (nearest) so that labels stay readable
        pixels = pixels.repeat_interleave(scale, -1).repeat_interleave(scale, -2)

    def name(label: int) -> str:
        return classes[label - 1] if 1 <= label <= len(classes) else str(label)

    keep = pred["scores"] >= threshold
    if "iscrowd" in target:  # crowd regions are what COCO ignores, not objects to show as the truth
        objects = target["iscrowd"] == 0
        target = {"boxes": target["boxes"][objects], "labels": target["labels"][objects]}
    panels = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "boxes doesn't contain any box": an empty image is fine
        for boxes, labels, texts in (
            (target["boxes"], target["labels"], [name(int(c)) for c in target["labels"]]),
            (pred["boxes"][keep], pred["labels"][keep],
             [f"{name(int(c))} {float(s):.2f}" for c, s in zip(pred["labels"][keep], pred["scores"][keep])]),
        ):
            drawn = draw_boxes(pixels, boxes.reshape(-1, 4) * scale, [int(c) for c in labels], texts)
            panels.append(Image.fromarray(drawn.permute(1, 2, 0).numpy()))
    w, h = panels[0].size
    canvas = Image.new("RGB", (2 * w + 8, h + 18), "white")
    canvas.paste(panels[0], (0, 18))
    canvas.paste(panels[1], (w + 8, 18))
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 3), f"ground truth ({len(target['boxes'])})", fill="black")
    draw.text((w + 12, 3), f"predicted >= {threshold:g} ({int(keep.sum())})", fill="black")
    return canvas
