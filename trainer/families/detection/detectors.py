"""The one door to a detector's implementation: the family and `load_detector` build detectors, seed their
training randomness and find their backbone through the module their architecture's row names
(trainer.families.detection.architectures), so that a new kind of detector is one module and its rows.

Every built detector speaks torchvision's interface: `model(images, targets)` in train mode returns a dict of
loss terms (summed for the loss), `model(images)` in eval mode returns per image {"boxes" (x1 y1 x2 y2 in the
image's pixels), "scores", "labels" 1..K}.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from typing import Protocol, cast

from torch import nn

from trainer.families.detection.architectures import ARCHITECTURES


class Implementation(Protocol):
    BACKBONE_PREFIX: str
    """Parameter names starting with it are the backbone's (its learning rate is `detection.backbone_lr_scale`)."""

    def build_detector(self, arch: str, num_classes: int, *, weights: str = "none", resolution: int = 800,
                       trainable_backbone_layers: int | None = None, max_detections: int = 100,
                       frozen_bn: bool | None = None, class_names: list[str] | None = None,
                       saved: dict[str, str] | None = None) -> tuple[nn.Module, dict]:
        """(detector, info): info has `fresh` (tensors left at initialisation: the new head), `frozen_bn`,
        `trainable_bn` (BatchNorm layers that normalise each micro-batch) and `metadata` (what a .safetensors
        needs besides the common keys to rebuild it: handed back as `saved` by load_detector)."""

    def seeded(self, model: nn.Module, seeds: list[int]) -> AbstractContextManager:
        """The randomness of one training forward drawn from its samples' seeds (one per image)."""


def implementation(arch: str) -> Implementation:
    return cast(Implementation, importlib.import_module(ARCHITECTURES[arch].implementation))


def build_detector(arch: str, num_classes: int, **kwargs) -> tuple[nn.Module, dict]:
    return implementation(arch).build_detector(arch, num_classes, **kwargs)
