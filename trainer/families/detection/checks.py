"""Semantic checks of a `model.family: detection` config (torch-free); `validate` adds them to its list.

The dataset's contents (annotations, image files) are checked later, by the launcher's data check
(`trainer.families.detection.data.check_detection_data`), before any process starts.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from trainer.core.config.schema import Config
from trainer.core.config.validate import DEMO_SCHEME, is_hub_id, parse_devices
from trainer.families.detection.architectures import ARCHITECTURES, NAMES, TRANSFORMERS, Architecture

AUGMENTATIONS = ("color", "zoom_out", "iou_crop")
_CAPTIONS = "a detector reads no captions"
_DENOISING = "it shapes the diffusion families' denoising loss; a detector trains on its own box and class losses"
# Keys of the diffusion families that mean nothing to a detector, refused when set, with why.
DIFFUSION_ONLY = {
    "data.caption_prefix": _CAPTIONS, "data.caption_dropout": _CAPTIONS, "data.shuffle_tags": _CAPTIONS,
    "data.keep_tokens": _CAPTIONS,
    "data.masks": "a detector's loss follows its boxes (crowd regions are already ignore regions)",
    "train.loss": _DENOISING, "train.huber_delta": _DENOISING, "train.input_perturbation": _DENOISING,
    "train.noise_offset": _DENOISING, "train.min_snr_gamma": _DENOISING,
    "model.zero_terminal_snr": "it rescales the diffusion families' noise schedule",
    "data.datasets": "a detection dataset is one COCO or YOLO description in data.path (its splits included)",
    "train.text_encoder_lr": "a detector has no text encoder (detection.backbone_lr_scale sets its backbone's rate)",
}
WEIGHT_CHOICES = ("coco", "none")


def detection_problems(config: Config, *, check_paths: bool = True) -> list[str]:
    p: list[str] = []
    d, arch = config.detection, config.model.path
    if config.full.ema:
        p.append("full.ema: not supported for detection (the best checkpoint by mAP is kept instead); set it to false")
    if arch not in ARCHITECTURES:
        close = difflib.get_close_matches(arch, NAMES, n=1, cutoff=0.5)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        what = "is empty" if not arch else f"'{arch}' is not a detection architecture{hint}"
        p.append(f"model.path: {what}; use one of {', '.join(NAMES)}")
    if config.data.resolution < 32:
        p.append(f"data.resolution: must be at least 32 for a detector (backbones downsample by 32), got "
                 f"{config.data.resolution}")
    row = ARCHITECTURES.get(arch)
    if row is not None and config.data.resolution % row.resolution_multiple:
        p.append(f"data.resolution: {arch} needs a multiple of {row.resolution_multiple} (its image processor "
                 f"resizes to a square the encoder divides by {row.resolution_multiple}), got "
                 f"{config.data.resolution}")
    p += _weights_problems(d.weights, row, check_paths)
    if d.backbone_lr_scale is not None and not d.backbone_lr_scale > 0:
        p.append(f"detection.backbone_lr_scale: must be greater than 0 (a fraction of train.lr), got "
                 f"{d.backbone_lr_scale}; to freeze a torchvision backbone use detection.trainable_backbone_layers=0")
    layers = d.trainable_backbone_layers
    if layers is not None:
        top = ARCHITECTURES[arch].max_trainable_layers if arch in ARCHITECTURES else None
        if top is None:
            p.append(f"detection.trainable_backbone_layers: {arch} always trains its whole backbone; leave it unset")
        elif not 0 <= layers <= top:
            p.append(f"detection.trainable_backbone_layers: must be 0..{top} for {arch}, got {layers}")
    if d.sync_batchnorm:
        try:
            on_cpu = parse_devices(config.devices)[0] == "cpu"
        except ValueError:
            on_cpu = False  # validate reports the devices problem
        if on_cpu:
            p.append("detection.sync_batchnorm: SyncBatchNorm needs CUDA GPUs (it refuses CPU modules); turn it off "
                     "for devices=cpu:N")
    for name, value in (("val_split", config.data.val_split), ("val_path", config.data.val_path)):
        if value:
            p.append(f"data.{name}: detection evaluates on its own validation set (detection.val_path, YOLO's val, "
                     "a val.json next to train.json, else detection.val_fraction of the training images), not on "
                     f"held-out images; leave data.{name} unset")
    p += _diffusion_only_problems(config)
    if config.train.compile:
        p.append("train.compile: not for detection: a detector's tensors change shape from batch to batch "
                 "(torchvision's detectors resize each image within data.resolution keeping its aspect ratio and pad "
                 "each batch to its largest image; every detector's loss matches a different number of boxes per "
                 "image, with data-dependent code such as NMS and Hungarian matching), so compiling with static "
                 "shapes would compile again at almost every step. Set train.compile=false.")
    if config.eval.best == "val_loss":
        p.append("eval.best: val_loss is the diffusion families' validation loss; detection keeps checkpoints/best/ by "
                 "detection.best_metric (map or map50): set eval.best=auto, or none for no best checkpoint")
    if not 0 < d.val_fraction < 1:
        p.append(f"detection.val_fraction: must be between 0 and 1, got {d.val_fraction}")
    unknown = [a for a in d.augment if a not in AUGMENTATIONS]
    if unknown:
        p.append(f"detection.augment: {unknown} are not augmentations; choose from {', '.join(AUGMENTATIONS)} "
                 "(flipping is data.flip)")
    if not 0 <= d.score_threshold <= 1:
        p.append(f"detection.score_threshold: must be between 0 and 1, got {d.score_threshold}")
    if d.max_detections < 1:
        p.append(f"detection.max_detections: must be 1 or more, got {d.max_detections}")
    for name in ("eval_images", "sample_images"):
        if getattr(d, name) < 0:
            p.append(f"detection.{name}: must be zero or more, got {getattr(d, name)}")
    if check_paths:
        data = config.data.path
        if not data:
            p.append("data.path: is empty; set it to a COCO .json file, a YOLO data.yaml or a folder holding one")
        elif not data.startswith(DEMO_SCHEME):
            path = Path(data).expanduser()
            if not path.exists():
                p.append(f"data.path: '{data}' does not exist; point it at a COCO .json file or a YOLO data.yaml")
            elif path.is_file() and path.suffix.lower() not in (".json", ".yaml", ".yml"):
                p.append(f"data.path: '{data}' is neither a COCO .json file nor a YOLO data.yaml")
        if d.val_path and not Path(d.val_path).expanduser().is_file():
            p.append(f"detection.val_path: '{d.val_path}' does not exist; give a COCO .json file or leave it empty")
        if d.images and not Path(d.images).expanduser().is_dir():
            p.append(f"detection.images: folder '{d.images}' does not exist")
    return p


def _diffusion_only_problems(config: Config) -> list[str]:
    defaults, p = Config(), []
    for key, why in DIFFUSION_ONLY.items():
        section, name = key.split(".")
        value, default = getattr(getattr(config, section), name), getattr(getattr(defaults, section), name)
        if value != default:
            p.append(f"{key}: not for detection: {why}; leave it at its default, {default!r}")
    return p


def _weights_problems(weights: str, row: Architecture | None, check_paths: bool) -> list[str]:
    if row is not None and weights == "coco" and not row.coco_weights:
        return [f"detection.weights: {row.name} has no COCO weights; use none (random init) or a local file"]
    if weights in WEIGHT_CHOICES:
        return []
    if row is not None and row.implementation == TRANSFORMERS:
        if is_hub_id(weights) or not check_paths:
            return []
        path = Path(weights).expanduser()
        if path.is_dir() and not (path / "config.json").is_file():
            return [f"detection.weights: folder '{weights}' has no config.json; give a folder written by "
                    "save_pretrained, a hub id, coco or none"]
        if path.is_file() and path.suffix != ".safetensors":
            return [f"detection.weights: '{weights}' is not a {row.model_type} checkpoint; {row.name} takes coco, "
                    "none, a hub id, a save_pretrained folder or a .safetensors written by a detection run"]
        if not path.exists():
            return [f"detection.weights: '{weights}' is neither coco, none, a hub id (org/name) nor an existing "
                    "folder or .safetensors file"]
        return []
    if check_paths and not Path(weights).expanduser().is_file():
        return [f"detection.weights: '{weights}' is not coco, none or an existing weights file (.pth/.safetensors)"]
    return []
