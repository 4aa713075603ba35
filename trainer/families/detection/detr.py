"""RT-DETR v2 and D-FINE through transformers, behind the interface of torchvision's detectors, so that training,
evaluation, samples and `load_detector(...).predict` treat them as they treat Faster R-CNN.

    model, info = build_detector("rtdetr_v2_r50vd", 3, weights="coco", resolution=640, class_names=[...])
    losses = model(images, targets)      # train(): {loss name: weighted term}; their sum is transformers' loss
    found = model(images)                # eval(): [{"boxes" (x1 y1 x2 y2 px), "scores", "labels" 1..K}]

Images are what torchvision's detectors take (float 0..1, any size); the checkpoint's image processor turns
them into pixel values (stretched to a square of `resolution`, normalised as the checkpoint was trained) and
turns predictions back into boxes in each image's pixels (`post_process_object_detection`). Labels 1..K are
transformers' classes 0..K-1, and boxes go in as normalised cx cy w h (`to_detr_labels`). Weights come from
the hub (`coco`: the row's checkpoint, or any hub id of the same model type), a `save_pretrained` folder,
random initialisation of the checkpoint's (or the demo's tiny) config, or a .safetensors written here.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from trainer.errors import UserError
from trainer.families.detection.architectures import ARCHITECTURES

BACKBONE_PREFIX = "detr.model.backbone."  # the CNN, which trains at detection.backbone_lr_scale
_CLASSES = {"rt_detr_v2": ("RTDetrV2Config", "RTDetrV2ForObjectDetection"),
            "d_fine": ("DFineConfig", "DFineForObjectDetection")}


def to_detr_labels(target: dict, height: int, width: int) -> dict:
    """torchvision's target (boxes x1 y1 x2 y2 in pixels, labels 1..K) as transformers' DETR label: class_labels
    0..K-1, boxes (center x, center y, width, height) as fractions of the image's width and height."""
    boxes = target["boxes"].float().reshape(-1, 4)
    centers, sizes = (boxes[:, :2] + boxes[:, 2:]) / 2, boxes[:, 2:] - boxes[:, :2]
    return {"class_labels": target["labels"] - 1,
            "boxes": torch.cat([centers, sizes], dim=1) / boxes.new_tensor([width, height, width, height])}


class TransformersDetector(nn.Module):
    def __init__(self, detr: nn.Module, processor, max_detections: int):
        super().__init__()
        self.detr = detr
        self.processor = processor
        self.max_detections = max_detections

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None):
        device = images[0].device
        # Images arrive as 0..1 floats, so the processor's 1/255 rescale is off; its resize and normalisation
        # are the checkpoint's.
        pixels = self.processor(images=list(images), do_rescale=False, return_tensors="pt",
                                device=device)["pixel_values"].to(device)
        if self.training:
            if targets is None:
                raise ValueError("a training forward needs targets")
            labels = [to_detr_labels(t, *image.shape[-2:]) for t, image in zip(targets, images)]
            return dict(self.detr(pixel_values=pixels, labels=labels).loss_dict)
        outputs = self.detr(pixel_values=pixels)
        # Threshold 0 keeps every query (COCO mAP ranks them all); the cap is COCOeval's 100 per image.
        found = self.processor.post_process_object_detection(
            outputs, threshold=0.0, target_sizes=[tuple(image.shape[-2:]) for image in images])
        k = self.max_detections
        return [{"boxes": r["boxes"][:k], "scores": r["scores"][:k], "labels": r["labels"][:k] + 1} for r in found]


@contextmanager
def seeded(model: nn.Module, seeds: list[int]):
    """The denoising queries' label and box noise (the only randomness of a training forward) drawn from the
    micro-batch's own seeds, so that a resumed run trains on the same noise."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seeds[0] if seeds else 0)
        yield


def tiny_config(model_type: str) -> dict:
    """The offline demo's architecture: a 4-stage CNN of 16-128 channels, a one-layer encoder and a two-layer
    decoder of width 64 with 50 queries (D-FINE's 0.5M parameters, RT-DETR v2's 1.2M)."""
    backbone: dict = ({"model_type": "rt_detr_resnet", "embedding_size": 16, "hidden_sizes": [16, 32, 64, 128],
                 "depths": [1, 1, 1, 1], "layer_type": "basic"} if model_type == "rt_detr_v2" else
                {"model_type": "hgnet_v2", "stem_channels": [3, 16, 16], "stage_in_channels": [16, 32, 64, 96],
                 "stage_mid_channels": [16, 16, 32, 32], "stage_out_channels": [32, 64, 96, 128],
                 "stage_num_blocks": [1, 1, 1, 1], "stage_numb_of_layers": [2, 2, 2, 2],
                 "hidden_sizes": [32, 64, 96, 128], "depths": [1, 1, 1, 1]})
    extra = {"hidden_expansion": 0.5, "depth_mult": 0.34, "lqe_hidden_dim": 16} if model_type == "d_fine" else {}
    return {"model_type": model_type, "backbone_config": {**backbone, "out_features": ["stage2", "stage3", "stage4"]},
            "encoder_in_channels": backbone["hidden_sizes"][1:], "encoder_hidden_dim": 64, "encoder_ffn_dim": 128,
            "encoder_attention_heads": 4, "d_model": 64, "decoder_in_channels": [64, 64, 64], "decoder_ffn_dim": 128,
            "decoder_layers": 2, "decoder_attention_heads": 4, "num_queries": 50, "num_denoising": 50, **extra}


def _classes(model_type: str):
    import transformers

    return tuple(getattr(transformers, name) for name in _CLASSES[model_type])


def _config_of(row, source: str) -> dict:
    """The config.json of `source` (a hub id or a save_pretrained folder), checked to be `row`'s model type."""
    from transformers import PretrainedConfig

    try:
        data, _ = PretrainedConfig.get_config_dict(source)
    except Exception as exc:  # OSError offline or for an unknown repo; ValueError for a bad folder
        raise UserError(
            f"detection.weights: cannot read the config of {source} ({type(exc).__name__}: {str(exc)[:200]}). "
            f"{row.name} reads its architecture (and its COCO weights) from the Hugging Face hub once, then from "
            "the cache; without network, copy a folder written by save_pretrained here and set detection.weights "
            "to it, or use a tiny architecture (rtdetr_v2_tiny, dfine_tiny) with detection.weights=none") from None
    if data.get("model_type") != row.model_type:
        raise UserError(f"detection.weights: {source} holds a {data.get('model_type')!r} model, not a "
                        f"{row.model_type!r} one as {row.name} is; use a {row.model_type} checkpoint or set "
                        "model.path to the architecture of this one")
    return data


def _processor(source: str, resolution: int, saved: str | None, keep_size: bool):
    """The checkpoint's image processor (RT-DETR's defaults where it has none), resizing to `resolution`."""
    from transformers import RTDetrImageProcessor

    if saved:
        processor = RTDetrImageProcessor.from_dict(json.loads(saved))
    else:
        try:
            processor = RTDetrImageProcessor.from_pretrained(source) if source else RTDetrImageProcessor()
        except OSError:  # no preprocessor_config.json: RT-DETR's defaults are every published checkpoint's
            processor = RTDetrImageProcessor()
    if not keep_size:
        processor.size = {"height": resolution, "width": resolution}
    return processor


def build_detector(arch: str, num_classes: int, *, weights: str = "none", resolution: int = 640,
                   trainable_backbone_layers: int | None = None, max_detections: int = 100,
                   frozen_bn: bool | None = None, class_names: list[str] | None = None,
                   saved: dict[str, str] | None = None) -> tuple[nn.Module, dict]:
    """A transformers detector for labels 1..num_classes (see the module's docstring). `saved`: the metadata of
    a .safetensors written here, rebuilt exactly as it was (the caller loads its weights)."""
    from trainer.families.detection.models import load_matching, read_weights

    row = ARCHITECTURES[arch]
    config_class, model_class = _classes(row.model_type)
    pretrained = weights != "none"
    source = row.hub_id if weights in ("coco", "none") else weights
    from_file = saved is None and pretrained and Path(weights).suffix == ".safetensors"
    if from_file:  # a detector trained here, going on with (maybe) other classes
        saved = _metadata_of(Path(weights).expanduser())
    if saved is not None:
        data, source = json.loads(saved["hf_config"]), ""
    elif source:
        data = _config_of(row, source)
    else:
        data = tiny_config(row.model_type)
    config = config_class.from_dict({k: v for k, v in data.items() if k not in ("architectures", "transformers_version")})
    if saved is None or from_file:
        names = class_names or [str(i + 1) for i in range(num_classes)]
        config.num_labels = num_classes
        config.id2label, config.label2id = dict(enumerate(names)), {name: i for i, name in enumerate(names)}
        config.freeze_backbone_batch_norms = pretrained if frozen_bn is None else frozen_bn
        # Anchors and encoder positions precomputed for one size would break other resolutions: computed per input.
        config.anchor_image_size, config.eval_size = None, None
    fresh: list[str] = []
    if pretrained and saved is None:  # the fine-tuning guide's call: a hub id or a save_pretrained folder
        detr, loading = model_class.from_pretrained(source, config=config, ignore_mismatched_sizes=True,
                                                    output_loading_info=True)
        fresh = sorted(set(loading["missing_keys"]) | {k[0] for k in loading["mismatched_keys"]})
    else:
        detr = model_class(config)
    processor = _processor(source, resolution, saved.get("image_processor") if saved else None,
                           keep_size=saved is not None and not from_file)
    model = TransformersDetector(detr, processor, max_detections)
    if from_file:
        fresh = load_matching(model, read_weights(arch, weights), weights)
    info = {"architecture": arch, "weights": weights, "fresh": fresh, "frozen_bn": config.freeze_backbone_batch_norms,
            "trainable_bn": sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()),
            "metadata": {"hf_config": config.to_json_string(use_diff=False),
                         "image_processor": processor.to_json_string()}}
    return model, info


def _metadata_of(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "hf_config" not in meta:
        raise UserError(f"detection.weights: {path} is not a transformers detector written by this trainer; give "
                        "a hub id, a folder written by save_pretrained, or a .safetensors of a detection run")
    return meta
