"""The detectors on offer, in one table (torch-free: validation and the UI read it; the row's `implementation`
builds it).

A new detector is rows here plus, for a new kind of model, one module that implements
`trainer.families.detection.detectors.Implementation` (models.py for torchvision, detr.py for transformers'
RT-DETR v2 and D-FINE): the family, the checks, `load_detector` and the presets reach it through its row.
"""

from __future__ import annotations

from dataclasses import dataclass

TORCHVISION = "trainer.families.detection.models"
TRANSFORMERS = "trainer.families.detection.detr"


@dataclass(frozen=True)
class Architecture:
    name: str
    backbone: str
    """`resnet50` (stages conv1 + layer1-4), `mobilenet_v3` (6 stages), `tiny` (the demo's 4 convolutions);
    for the transformers detectors a description (their backbone always trains, at `backbone_lr_scale`)."""
    max_trainable_layers: int | None
    """Backbone stages that may train with pretrained weights (`detection.trainable_backbone_layers`); None:
    the whole backbone always trains."""
    coco_weights: bool = True
    """COCO weights are published for it (`detection.weights: coco`)."""
    fixed_square: bool = False
    """Resizes every image to a square of `data.resolution` (SSDlite, the DETRs' image processor) instead of
    keeping the aspect ratio."""
    implementation: str = TORCHVISION
    """The module that builds it (see trainer.families.detection.detectors)."""
    hub_id: str = ""
    """transformers detectors: the hub checkpoint behind `detection.weights: coco` (also the architecture that
    `none` initialises at random); empty for the demo's tiny ones, whose config is written in code."""
    model_type: str = ""
    """transformers detectors: the `model_type` of their config.json (other checkpoints must match it)."""
    backbone_lr_scale: float = 1.0
    """The backbone's learning rate relative to `train.lr` when `detection.backbone_lr_scale` is unset."""
    resolution_multiple: int = 1
    """`data.resolution` must be a multiple of this."""
    micro_batch_note: str = ""
    """Why accumulated micro-batches are close to, not exactly, one big batch (empty: they are exact)."""


_FOREGROUND = "normalises each micro-batch's losses by its own foreground count"
_HUNGARIAN = ("matches its queries to each micro-batch's boxes (Hungarian) and normalises the losses by that "
              "micro-batch's box count, with denoising groups sized by its most crowded image")


def _detr(name: str, backbone: str, hub_id: str, model_type: str) -> Architecture:
    # The RT-DETR / D-FINE recipes: the backbone learns at a tenth of the rate of the rest; the image processor
    # stretches every image to a square, and the encoder's strides go to 32.
    return Architecture(name, backbone, None, coco_weights=bool(hub_id), fixed_square=True,
                        implementation=TRANSFORMERS, hub_id=hub_id, model_type=model_type, backbone_lr_scale=0.1,
                        resolution_multiple=32, micro_batch_note=_HUNGARIAN)


ARCHITECTURES = {a.name: a for a in (
    Architecture("fasterrcnn_resnet50_fpn_v2", "resnet50", 5),
    Architecture("fasterrcnn_mobilenet_v3_large_fpn", "mobilenet_v3", 6),
    Architecture("retinanet_resnet50_fpn_v2", "resnet50", 5, micro_batch_note=_FOREGROUND),
    Architecture("fcos_resnet50_fpn", "resnet50", 5, micro_batch_note=_FOREGROUND),
    Architecture("ssdlite320_mobilenet_v3_large", "mobilenet_v3", None, fixed_square=True),
    Architecture("fcos_tiny", "tiny", None, coco_weights=False,  # a 4-conv backbone for the offline demo
                 micro_batch_note=_FOREGROUND),
    _detr("rtdetr_v2_r18vd", "ResNet-18-vd", "PekingU/rtdetr_v2_r18vd", "rt_detr_v2"),
    _detr("rtdetr_v2_r34vd", "ResNet-34-vd", "PekingU/rtdetr_v2_r34vd", "rt_detr_v2"),
    _detr("rtdetr_v2_r50vd", "ResNet-50-vd", "PekingU/rtdetr_v2_r50vd", "rt_detr_v2"),
    _detr("rtdetr_v2_r101vd", "ResNet-101-vd", "PekingU/rtdetr_v2_r101vd", "rt_detr_v2"),
    _detr("rtdetr_v2_tiny", "tiny ResNet", "", "rt_detr_v2"),  # the offline demo's, config in detr.py
    _detr("dfine_n", "HGNetV2-B0", "ustc-community/dfine-nano-coco", "d_fine"),
    _detr("dfine_s", "HGNetV2-B0", "ustc-community/dfine-small-coco", "d_fine"),
    _detr("dfine_m", "HGNetV2-B2", "ustc-community/dfine-medium-coco", "d_fine"),
    _detr("dfine_l", "HGNetV2-B4", "ustc-community/dfine-large-coco", "d_fine"),
    _detr("dfine_x", "HGNetV2-B5", "ustc-community/dfine-xlarge-coco", "d_fine"),
    _detr("dfine_tiny", "tiny HGNetV2", "", "d_fine"),  # the offline demo's, config in detr.py
)}
NAMES = tuple(ARCHITECTURES)
