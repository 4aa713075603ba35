"""The `detection:` config section, read by the detection family; torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trainer.core.config.fields import key


@dataclass
class DetectionConfig:
    """Object detection (`model.family: detection`, `method: full`): torchvision detectors and transformers'
    RT-DETR v2 / D-FINE, COCO/YOLO data, mAP."""

    weights: str = key(
        "coco",
        "Starting weights: `coco` (COCO-pretrained weights, downloaded once: torchvision's DEFAULT weights, or for "
        "RT-DETR v2 / D-FINE the architecture's hub checkpoint), `none` (random initialisation; RT-DETR v2 / D-FINE "
        "read their architecture from that checkpoint's config, except the demo's tiny ones), or a local file (a "
        "torchvision state dict `.pth`, or a `.safetensors` written by this trainer). RT-DETR v2 / D-FINE also take "
        "a hub id or a `save_pretrained` folder of a checkpoint of the same model type. The classification head is "
        "replaced for the dataset's classes; pretrained backbones get frozen BatchNorm.",
    )
    trainable_backbone_layers: Optional[int] = key(
        None,
        "With pretrained weights, how many backbone stages train, counted from the top (0: frozen backbone; ResNet "
        "0-5, MobileNet 0-6). Unset: torchvision's default (3; SSDlite all). Random init trains everything.",
    )
    backbone_lr_scale: Optional[float] = key(
        None,
        "The backbone's learning rate as a fraction of `train.lr` (the classification CNN, without FPN or encoder). "
        "Unset: the architecture's recipe (RT-DETR v2 / D-FINE 0.1, torchvision detectors 1).",
    )
    sync_batchnorm: bool = key(
        False, "Share trainable BatchNorm statistics across GPUs (SyncBatchNorm): CUDA only; helps small per-device "
        "batches with random-init backbones.",
    )
    images: str = key(
        "", "COCO: the folder the JSON's `file_name`s are relative to. Empty: found next to the JSON file (itself, "
        "`images/`, or `../train2017` for `instances_train2017.json`).",
    )
    val_path: str = key(
        "", "COCO validation annotations (`.json`). Empty: YOLO's `val`, a `val.json` next to `train.json`, else "
        "`detection.val_fraction` of the training images.",
    )
    val_fraction: float = key(
        0.1, "Share of the training images kept for validation when none is given (chosen with `seed`).")
    augment: list[str] = key(
        [], "Augmentations besides `data.flip` (torchvision transforms v2; boxes follow): `color` (photometric "
        "distortion), `zoom_out` (SSD zoom-out), `iou_crop` (SSD random IoU crop).",
    )
    score_threshold: float = key(0.3, "Boxes scoring at least this are drawn in samples and returned by `predict`.")
    max_detections: int = key(
        100, "Most boxes per image at evaluation and inference (COCO counts 100); also keeps the evaluation of "
        "random-init detectors (thousands of low-score boxes) fast.",
    )
    eval_images: int = key(0, "Evaluate on at most this many validation images (0: all of them).")
    sample_images: int = key(
        4, "Validation images drawn with their true (left) and predicted (right) boxes per sample step.")
    best_metric: str = key(
        "map", "Metric that keeps `checkpoints/best/`: `map` (COCO mAP@[.5:.95]) or `map50`.", choices=("map", "map50")
    )
