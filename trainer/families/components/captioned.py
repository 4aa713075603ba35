"""Turn scanned images into training tensors, with augmentation that is a pure function of (seed, epoch, index).

No global random state is touched: every random choice comes from the generator passed in, normally
`sample_rng(seed, epoch, index)`. That is what makes a run on 1 GPU, on 2 GPUs and after a resume see exactly the
same pixels for the same sample, whichever process or data-loader worker loads it.
"""

from __future__ import annotations

import random
from typing import Optional, Sequence, Union

import numpy as np
import torch
from PIL import Image, ImageOps

from trainer.core.data.buckets import cover_and_crop
from trainer.core.data.scan import DatasetScan, ImageItem
from trainer.errors import UserError

Rng = Union[random.Random, np.random.Generator]
CROPS = ("center", "random")
# Separates the python-random streams from the torch streams, so sample_rng(s, 1, 2) and
# torch_generator(s, 1, 2) are independent even with identical arguments.
_PYTHON_STREAM, _TORCH_STREAM = 0, 1


def _entropy(seed: int, parts: Sequence[int], stream: int) -> np.random.SeedSequence:
    # SeedSequence only takes non-negative integers; reduce modulo 2**64 so a negative seed still works.
    words = [int(v) % 2**64 for v in (seed, *parts)]
    return np.random.SeedSequence(words, spawn_key=(stream,))


def sample_rng(seed: int, *parts: int) -> random.Random:
    """An independent random stream for (seed, *parts), e.g. `sample_rng(seed, epoch, index)`."""
    state = _entropy(seed, parts, _PYTHON_STREAM).generate_state(4, dtype=np.uint32)
    return random.Random(int.from_bytes(state.tobytes(), "little"))


def torch_generator(seed: int, *parts: int) -> torch.Generator:
    """A CPU `torch.Generator` for (seed, *parts), e.g. per-sample noise and timesteps."""
    state = _entropy(seed, parts, _TORCH_STREAM).generate_state(1, dtype=np.uint64)
    # Keep it to 63 bits: manual_seed accepts that range on every torch version.
    return torch.Generator(device="cpu").manual_seed(int(state[0]) & (2**63 - 1))


def _uniform(rng: Rng) -> float:
    return rng.random()


def _integer(rng: Rng, high: int) -> int:
    """A uniform integer in [0, high]."""
    if isinstance(rng, np.random.Generator):
        return int(rng.integers(0, high + 1))
    return rng.randint(0, high)


def load_image_tensor(
    item_path: str,
    resolution: int | tuple[int, int],
    *,
    crop: str = "center",
    flip: bool = False,
    rng: Optional[Rng] = None,
) -> torch.Tensor:
    """Load an image as a float tensor of shape (3, resolution, resolution) with values in [-1, 1]; a
    `(width, height)` resolution (an aspect-ratio bucket) gives (3, height, width).

    The short side is resized to `resolution` (Lanczos; for a bucket: the image is resized to cover it, see
    `trainer.core.data.buckets.cover_and_crop`), then a square (the bucket) is cropped (centered, or at an
    `rng`-chosen place), then it is mirrored when `flip` is on and `rng` says so. The flip coin is always drawn
    first, even when `flip` is off, so turning flipping on or off never changes which crop a sample gets, and
    `flip_drawn(rng)` on a fresh equal generator predicts it (the engine uses that for cached latents).
    """
    if crop not in CROPS:
        raise ValueError(f"crop must be one of {CROPS}, not {crop!r}")
    if rng is None:
        if crop == "random" or flip:
            raise ValueError("random crop or flip needs an rng, e.g. sample_rng(seed, epoch, index)")
        rng = random.Random(0)
    flipped = flip and flip_drawn(rng)
    try:
        with Image.open(item_path) as img:
            _decode_at_least(img, resolution)
            rgb = _to_rgb(ImageOps.exif_transpose(img))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise UserError(
            f"The training image {item_path} cannot be read ({exc}). Remove or replace it, "
            f"or run the dataset check again to find all unreadable files."
        ) from exc

    rgb = place(rgb, resolution, crop=crop, flipped=flipped, rng=rng)
    pixels = torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1)
    return pixels.to(torch.float32).div_(127.5).sub_(1.0)


def place(img: Image.Image, resolution: int | tuple[int, int], *, crop: str, flipped: bool, rng: Rng,
          resample: Image.Resampling = Image.Resampling.LANCZOS) -> Image.Image:
    """Resize to cover the target, crop it (drawing left, then top, from `rng` for a random crop), mirror: the
    geometry `load_image_tensor` gives an image, which a loss mask of the image gets too."""
    target = (resolution, resolution) if isinstance(resolution, int) else resolution
    size, (room_x, room_y) = cover_and_crop(*img.size, target)
    if size != img.size:
        img = img.resize(size, resample, reducing_gap=3.0 if resample == Image.Resampling.LANCZOS else None)
    if crop == "random":
        left, top = _integer(rng, room_x), _integer(rng, room_y)
    else:
        left, top = room_x // 2, room_y // 2
    img = img.crop((left, top, left + target[0], top + target[1]))
    return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flipped else img


def flip_drawn(rng: Rng) -> bool:
    """The flip decision: the first draw from a sample's rng (see `load_image_tensor`)."""
    return _uniform(rng) < 0.5


def _decode_at_least(img: Image.Image, resolution) -> None:
    """Let JPEG decode at 1/2, 1/4 or 1/8 size when that still covers the target size: much faster."""
    if img.format != "JPEG":
        return
    target = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
    size, _ = cover_and_crop(*img.size, target)
    img.draft("RGB", (max(1, size[0]), max(1, size[1])))


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB with transparency composited onto white (dropping alpha would expose arbitrary hidden colours)."""
    if img.mode in ("I", "I;16", "I;16L", "I;16B", "I;16N", "F"):
        values = np.asarray(img, dtype=np.float64)
        # 16-bit greyscale arrives as "I" or "I;16" depending on the Pillow version; scale it down to 8 bits.
        if values.max(initial=0) > 255:
            values = values / 257.0
        img = Image.fromarray(np.clip(values, 0, 255).astype(np.uint8))  # 2-D uint8 -> mode "L"
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


class ImageCaptionDataset(torch.utils.data.Dataset):
    """One epoch of a scanned dataset (kohya repeats expanded), with deterministic augmentation.

    Use `get(index, epoch, seed)`. Indexing with `dataset[(index, epoch)]` does the same with the dataset's own
    seed, so a sampler that yields (index, epoch) pairs drives a DataLoader with any number of workers;
    `dataset[index]` uses `self.epoch` (set it with `set_epoch`, as with DistributedSampler).
    """

    def __init__(
        self,
        scan: DatasetScan | Sequence[ImageItem],
        resolution: int,
        *,
        crop: str = "center",
        flip: bool = False,
        seed: int = 0,
    ):
        if crop not in CROPS:
            raise ValueError(f"crop must be one of {CROPS}, not {crop!r}")
        self.items: list[ImageItem] = scan.expanded() if isinstance(scan, DatasetScan) else list(scan)
        self.resolution = resolution
        self.crop = crop
        self.flip = flip
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.items)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        index, epoch = key if isinstance(key, tuple) else (key, self.epoch)
        return self.get(index, epoch, self.seed)

    def get(self, index: int, epoch: int, seed: int) -> dict:
        """Sample `index` as seen in `epoch`: the same arguments give the same pixels in every process."""
        if not 0 <= index < len(self.items):
            raise IndexError(f"index {index} out of range for a dataset of {len(self.items)} samples")
        item = self.items[index]
        pixels = load_image_tensor(
            item.path, self.resolution, crop=self.crop, flip=self.flip, rng=sample_rng(seed, epoch, index)
        )
        flipped = self.will_flip(index, epoch, seed)
        return {"pixel_values": pixels, "caption": item.caption, "index": index, "path": item.path, "flipped": flipped}

    def will_flip(self, index: int, epoch: int, seed: int) -> bool:
        """Whether `get(index, epoch, seed)` mirrors its image, without loading it (for cached latents)."""
        return self.flip and flip_drawn(sample_rng(seed, epoch, index))


def collate(samples: list[dict]) -> dict:
    """Stack pixel values into one (B, 3, R, R) tensor; keep captions, indices, paths and flips as lists."""
    batch: dict[str, torch.Tensor | list] = {"pixel_values": torch.stack([s["pixel_values"] for s in samples])}
    for key, plural in (("caption", "captions"), ("index", "indices"), ("path", "paths"), ("flipped", "flipped")):
        if all(key in s for s in samples):
            batch[plural] = [s[key] for s in samples]
    return batch
