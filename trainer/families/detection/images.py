"""Detection images as tensors: loaded, resized so the longest side is `resolution`, augmented with torchvision
transforms v2 (boxes follow every flip, zoom and crop), as a pure function of (record, seed).

Every random draw of a training sample comes from `torch.manual_seed(seed)` inside a forked RNG, with the seed
derived from the sample's stream position, so 1-process, N-process and resumed runs see identical pixels and
boxes. Resized images are kept in memory when the whole dataset fits in `CACHE_BYTES`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch
from PIL import Image, ImageOps
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from trainer.families.detection.records import DetRecord

CACHE_BYTES = 512 << 20  # per dataset and process


class DetectionImages:
    def __init__(self, records: list[DetRecord], resolution: int, *, flip: bool = False, augment=(),
                 warn=lambda message: None):
        self.records = records
        self.resolution = resolution
        self.warn = warn
        self.cache: dict[int, tuple] | None = {} if len(records) * 3 * resolution**2 <= CACHE_BYTES else None
        steps = []
        if "color" in augment:
            steps.append(v2.RandomPhotometricDistort(p=0.5))
        if "zoom_out" in augment:
            steps.append(v2.RandomZoomOut(fill={tv_tensors.Image: (124, 116, 104), "others": 0}, p=0.5))
        if "iou_crop" in augment:
            steps.append(v2.RandomIoUCrop())
        if flip:
            steps.append(v2.RandomHorizontalFlip(p=0.5))
        self.resizes = bool({"zoom_out", "iou_crop"} & set(augment))
        if self.resizes:  # zoom/crop change the size: back to the longest side = resolution
            steps.append(v2.Resize(size=None, max_size=resolution))
        self.augment = v2.Compose(steps + [v2.SanitizeBoundingBoxes(min_size=1.0)]) if steps else None
        self._pool: tuple[int, ThreadPoolExecutor] | None = None

    def __len__(self) -> int:
        return len(self.records)

    # ---- loading ------------------------------------------------------------------------------------------
    def _load(self, index: int):
        """(uint8 image (3, h, w) with longest side = resolution, boxes (n, 4) float32, labels (n,) int64, crowd
        boxes (m, 4) float32, crowd labels (m,) int64)."""
        if self.cache is not None and index in self.cache:
            return self.cache[index]
        record = self.records[index]
        with Image.open(record.path) as opened:
            img = ImageOps.exif_transpose(opened) if record.exif else opened
            img = img.convert("RGB")
            width, height = img.size
            scale = self.resolution / max(width, height)
            size = (max(1, round(width * scale)), max(1, round(height * scale)))
            img = img.resize(size, Image.Resampling.BILINEAR, reducing_gap=None) if size != img.size else img
            pixels = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size[1], size[0], 3)
        boxes = torch.tensor(record.boxes, dtype=torch.float32).reshape(-1, 4)
        crowd = torch.tensor(record.crowd_boxes, dtype=torch.float32).reshape(-1, 4)
        box_scale = torch.tensor([size[0] / width, size[1] / height] * 2)
        if (width, height) != (record.width, record.height):
            self.warn(f"{record.path}: is {width}x{height} but annotated as {record.width}x{record.height}; "
                      "its boxes are scaled to the image")
            box_scale = box_scale * torch.tensor([width / record.width, height / record.height] * 2)
        item = (pixels.permute(2, 0, 1).contiguous(), boxes * box_scale,
                torch.tensor(record.labels, dtype=torch.int64), crowd * box_scale,
                torch.tensor(record.crowd_labels, dtype=torch.int64))
        if self.cache is not None:
            self.cache[index] = item
        return item

    def load_many(self, indices: list[int]) -> list[tuple]:
        """Decode in threads (PIL releases the GIL) when not cached; no randomness is involved here."""
        if self.cache is not None or len(indices) < 2:
            return [self._load(i) for i in indices]
        return list(self._threads().map(self._load, indices))

    def _threads(self) -> ThreadPoolExecutor:
        """This process's decoding threads: a DataLoader worker forked from a process whose pool had started
        threads would inherit the pool without them and wait on it forever (trainer.engine.input)."""
        if self._pool is None or self._pool[0] != os.getpid():
            self._pool = (os.getpid(), ThreadPoolExecutor(max_workers=4))
        return self._pool[1]

    # ---- samples ------------------------------------------------------------------------------------------
    def train_sample(self, loaded: tuple, seed: int):
        """(float image in [0, 1], {"boxes", "labels"}) with this sample's augmentation (crowd regions are not
        trained on)."""
        pixels, boxes, labels = loaded[:3]
        if self.augment is not None:
            image = tv_tensors.Image(pixels)
            target = {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=tuple(pixels.shape[-2:])),
                      "labels": labels}
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                image, target = self.augment(image, target)
            pixels, boxes = image.as_subclass(torch.Tensor), target["boxes"].as_subclass(torch.Tensor)
            labels = target["labels"]
        return F.to_dtype(pixels, torch.float32, scale=True), {"boxes": boxes.reshape(-1, 4).float(), "labels": labels}

    def eval_sample(self, index: int):
        """(float image, target) with the crowd regions as `iscrowd` boxes, as COCO evaluates them."""
        pixels, boxes, labels, crowd, crowd_labels = self._load(index)
        target = {"boxes": torch.cat([boxes, crowd]), "labels": torch.cat([labels, crowd_labels]),
                  "iscrowd": torch.cat([torch.zeros(len(labels), dtype=torch.int64),
                                        torch.ones(len(crowd_labels), dtype=torch.int64)])}
        return F.to_dtype(pixels, torch.float32, scale=True), target

    def pixels(self, index: int) -> torch.Tensor:
        return self._load(index)[0]
