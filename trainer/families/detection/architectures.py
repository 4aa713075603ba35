"""The detectors on offer, in one table (torch-free: validation and the UI read it; models.py builds from it).

A new torchvision detector is one row here; its builder is torchvision's `get_model(name)` unless the row says
otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    name: str
    backbone: str
    """`resnet50` (stages conv1 + layer1-4), `mobilenet_v3` (6 stages), `tiny` (the demo's 4 convolutions)."""
    max_trainable_layers: int | None
    """Backbone stages that may train with pretrained weights (`detection.trainable_backbone_layers`); None:
    the whole backbone always trains."""
    coco_weights: bool = True
    """torchvision publishes COCO weights for it (`detection.weights: coco`)."""
    fixed_square: bool = False
    """Resizes every image to a square of `data.resolution` (SSDlite) instead of keeping the aspect ratio."""


ARCHITECTURES = {a.name: a for a in (
    Architecture("fasterrcnn_resnet50_fpn_v2", "resnet50", 5),
    Architecture("fasterrcnn_mobilenet_v3_large_fpn", "mobilenet_v3", 6),
    Architecture("retinanet_resnet50_fpn_v2", "resnet50", 5),
    Architecture("fcos_resnet50_fpn", "resnet50", 5),
    Architecture("ssdlite320_mobilenet_v3_large", "mobilenet_v3", None, fixed_square=True),
    Architecture("fcos_tiny", "tiny", None, coco_weights=False),  # a 4-conv backbone for the offline demo
)}
NAMES = tuple(ARCHITECTURES)
