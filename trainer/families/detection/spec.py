"""Object detection with torchvision detectors and transformers' RT-DETR v2 / D-FINE (COCO / YOLO data, mAP), as
the torch-free side sees it."""

from trainer.core.family_spec import FamilySpec
from trainer.families.detection.architectures import NAMES

SPEC = FamilySpec(
    name="detection",
    title="object detectors: torchvision's and transformers' RT-DETR v2 / D-FINE; see `detection.*`",
    implementation="trainer.families.detection.family:DetectionFamily",
    generates=False,
    methods=("full",),
    method_note="a detector is trained whole; set method=full (LoRA is for the diffusion families)",
    sharding=("ddp",),
    sharding_note="a detector (the largest, RT-DETR v2 R101, has 76M parameters) fits on one GPU; use sharding=auto or ddp",
    block_swap_note="a detector (76M parameters at most) fits on one GPU whole; set model.block_swap=0",
    section="detection",
    section_title="Object detection",
    checks="trainer.families.detection.checks:detection_problems",
    data_check="trainer.families.detection.data:check_detection_data",
    dataset_paths="trainer.families.detection.descriptors:descriptor_paths",
    hub_upload_note="uploads diffusion LoRAs and fine-tunes (with their model card); detection runs are not "
                    "uploaded yet: leave output.push_to_hub unset",
    xformers=False,  # torchvision detectors have no attention; the DETRs' deformable attention is their own
    resolution_multiple=None,  # checks.py: at least 32, any size (images keep their aspect ratio)
    bucket_multiple=None,
    # model.path is an architecture name (architectures.py), not a file; detection.weights may be a hub id,
    # which the workspace check lets through as it does for model.path elsewhere.
    path_help="Detection: the architecture (torchvision's, or transformers' RT-DETR v2 / D-FINE), one of "
              + ", ".join(f"`{a}`" for a in NAMES) + " (starting weights: `detection.weights`).",
    path_keys=("data.path", "detection.images", "detection.val_path", "detection.weights"),
    path_exceptions={"detection.weights": ("coco", "none")},
    # The starting weights decide frozen BatchNorm and frozen stages (the optimizer's parameters); the
    # validation split decides which images train.
    frozen_on_resume=("detection.weights", "detection.trainable_backbone_layers", "detection.val_path",
                      "detection.val_fraction", "detection.images"),
    exports=("output/model.safetensors (final) and output/best.safetensors (best evaluation), with the classes and model config in their metadata: trainer.detect.load_detector reloads them",),
    demo_preset="detection-demo.yaml",
    demo_assets={"shapes-coco": "trainer.families.detection.demo:ensure_detection_demo"},
)
