"""Use a detector trained here: load its `.safetensors` and predict boxes on images.

    from trainer.families.detection.predict import load_detector

    detector = load_detector("runs/my-run/output/best.safetensors")   # or model.safetensors, or a
    boxes = detector.predict("photo.jpg")                             # checkpoints/*/trainable.safetensors
    # [{"box": [x1, y1, x2, y2], "label": 2, "name": "dog", "score": 0.93}, ...] in the image's pixels
    detector.draw("photo.jpg", boxes).save("photo-boxes.png")

The file's metadata holds everything needed: the architecture (for RT-DETR v2 / D-FINE also transformers' model
config and image processor, so nothing is downloaded), the class names (label i is classes[i - 1]), the
resolution the detector was trained at (the image's longest side is resized to it, and the boxes scaled back),
and the detection settings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps

from trainer.errors import UserError


class Detector:
    def __init__(self, model: torch.nn.Module, classes: list[str], resolution: int, score_threshold: float,
                 metadata: dict[str, str]):
        self.model = model.eval()
        self.classes = classes
        self.resolution = resolution
        self.score_threshold = score_threshold
        self.metadata = metadata

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @staticmethod
    def _image(image) -> Image.Image:
        # As a person sees it: a phone photo is stored sideways with an EXIF orientation (YOLO training applies
        # it too, trainer.families.detection.images), so boxes are predicted on the upright image.
        if isinstance(image, (str, Path)):
            with Image.open(image) as img:
                return (ImageOps.exif_transpose(img) or img).convert("RGB")
        if isinstance(image, Image.Image):
            return (ImageOps.exif_transpose(image) or image).convert("RGB")
        if isinstance(image, torch.Tensor):  # (3, H, W), float in [0, 1] or uint8
            t = image if image.dtype == torch.uint8 else (image.clamp(0, 1) * 255).round().to(torch.uint8)
            return Image.fromarray(t.permute(1, 2, 0).cpu().numpy())
        return Image.fromarray(image).convert("RGB")  # a numpy array (H, W, 3)

    @torch.no_grad()
    def predict(self, image, score_threshold: float | None = None) -> list[dict]:
        """Boxes on one image (a path, PIL image, (H, W, 3) array or (3, H, W) tensor), best first, in fp32."""
        from torchvision.transforms.v2 import functional as F

        img = self._image(image)
        scale = self.resolution / max(img.size)
        resized = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.Resampling.BILINEAR)
        x = F.to_dtype(F.pil_to_tensor(resized), torch.float32, scale=True).to(self.device)
        with torch.autocast(self.device.type, enabled=False):
            det = self.model([x])[0]
        threshold = self.score_threshold if score_threshold is None else score_threshold
        sx, sy = img.width / resized.width, img.height / resized.height
        out = []
        for box, label, score in zip(det["boxes"].cpu(), det["labels"].cpu(), det["scores"].cpu()):
            if score < threshold:
                continue
            x1, y1, x2, y2 = box.tolist()
            label = int(label)
            out.append({"box": [x1 * sx, y1 * sy, x2 * sx, y2 * sy], "label": label, "score": float(score),
                        "name": self.classes[label - 1] if 1 <= label <= len(self.classes) else str(label)})
        return out

    def draw(self, image, predictions: list[dict] | None = None) -> Image.Image:
        """The image with `predictions` (default: predict(image)) drawn on it."""
        from torchvision.transforms.v2 import functional as F

        from trainer.families.detection.eval import draw_boxes

        img = self._image(image)
        predictions = self.predict(img) if predictions is None else predictions
        boxes = torch.tensor([p["box"] for p in predictions], dtype=torch.float32).reshape(-1, 4)
        texts = [f"{p['name']} {p['score']:.2f}" for p in predictions]
        drawn = draw_boxes(F.pil_to_tensor(img), boxes, [p["label"] for p in predictions], texts)
        return Image.fromarray(drawn.permute(1, 2, 0).numpy())


def load_detector(path: str | Path, device: str | torch.device = "cpu") -> Detector:
    """Load a detector written by this trainer: `output/model.safetensors`, `output/best.safetensors` or a
    checkpoint's `trainable.safetensors` (a run folder or its output/ folder also work: best, else model)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from trainer.families.detection.architectures import ARCHITECTURES
    from trainer.families.detection.detectors import build_detector

    path = Path(path).expanduser()
    if path.is_dir():
        for candidate in ("output/best.safetensors", "best.safetensors", "output/model.safetensors",
                          "model.safetensors", "trainable.safetensors"):
            if (path / candidate).is_file():
                path = path / candidate
                break
    if not path.is_file():
        raise UserError(f"{path}: no detector weights there (expected a .safetensors file written by a detection run)")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != "imagetune-detector":
        raise UserError(f"{path}: is not a detector written by this trainer (its metadata has no format "
                        "'imagetune-detector')")
    if meta.get("architecture") not in ARCHITECTURES:
        raise UserError(f"{path}: holds a {meta.get('architecture')!r} detector, which this version of the trainer "
                        f"does not know (it knows {', '.join(ARCHITECTURES)}); load it with the version that wrote it")
    classes = json.loads(meta["classes"])
    model, _ = build_detector(meta["architecture"], len(classes), weights="none", resolution=int(meta["resolution"]),
                              max_detections=int(meta.get("max_detections", 100)),
                              frozen_bn=meta.get("frozen_bn") == "1", class_names=classes, saved=meta)
    model.load_state_dict(load_file(str(path)))
    return Detector(model.to(device), classes, int(meta["resolution"]), float(meta.get("score_threshold", 0.3)), meta)


def export_transformers(path: str | Path, folder: str | Path) -> Path:
    """An RT-DETR v2 / D-FINE weights file written here as a `save_pretrained` folder (config.json with the class
    names as id2label, model.safetensors, preprocessor_config.json resizing to the trained resolution), which
    transformers' `AutoModelForObjectDetection`, `AutoImageProcessor` and object-detection pipeline load as they
    load a hub checkpoint, and which `detection.weights` takes to fine-tune further."""
    detector = load_detector(path)
    detr: Any = getattr(detector.model, "detr", None)  # a transformers PreTrainedModel
    if detr is None:
        raise UserError(f"{path}: holds a torchvision {detector.metadata['architecture']} detector, which has no "
                        "transformers form; load it with load_detector")
    folder = Path(folder)
    detr.save_pretrained(folder)
    processor: Any = detector.model.processor
    processor.save_pretrained(folder)
    return folder
