"""The data side every captioned-image diffusion family shares (SD, SDXL, SD3, FLUX), as a component it holds.

`CaptionedLatents` scans the dataset (with its warnings), expands kohya repeats, assigns aspect-ratio buckets,
makes sure the prior-preservation class images exist, caches VAE latents (per bucket), and hands out each
sample's latent distribution with its augmentation. It knows nothing of the family holding it: it takes the
worker context, the VAE and, for prior preservation, a callback that draws images with the base model.

Every random choice is a function of (seed, epoch, expanded index) or of the stream position (see
trainer.core.data.stream), so a sample sees the same pixels and latents on any number of processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image

from trainer.core.data.buckets import BucketSpec, assign_buckets
from trainer.core.data.captions import CaptionAugment
from trainer.core.data.holdout import training_scan
from trainer.core.data.masks import check_masks
from trainer.core.data.scan import ImageItem
from trainer.families.components.captioned import load_image_tensor, sample_rng
from trainer.families.components.latent_cache import build_latent_cache, cache_key, weights_fingerprint
from trainer.families.components.mask_tensors import LatentMasks
from trainer.families.components.prior import ensure_class_images
from trainer.families.protocol import Sample, WorkerContext

Row = tuple[int, int, int, int, str]
"""One sample as the loss sees it: (stream position, epoch, image index, expanded index, kind), where kind is
"instance" (a training image), "class" (a prior-preservation image) or "val" (a held-out image: its index is its
position, its epoch 0; see trainer.families.components.validation)."""
Size = int | tuple[int, int]
"""A pixel size: the square resolution, or a bucket's (width, height)."""
LatentTable = dict[str, Any]
"""{"mean"/"std" (+"_flip"): per-image latents, indexable by image index}."""
DrawImages = Callable[..., list[Image.Image]]
"""`draw(prompts, seeds, *, steps, size) -> images` with the base model (a family's `sample`)."""


class CaptionedLatents:
    """A folder of captioned images as VAE latents. Call `prepare` once (after the VAE is placed); then
    `rows`, `latent_dist`, `caption`, `item` and `target` serve the loss. The images held out for the validation
    loss (`held_out`) are served the same way, as kind "val": center-cropped, never flipped, in their own
    buckets, and never part of an epoch."""

    def __init__(self, ctx: WorkerContext, vae: Any, *, draw_class_images: DrawImages | None = None):
        self.ctx = ctx
        self.cfg = ctx.config
        self.vae = vae
        self.draw_class_images = draw_class_images
        self.images: list[ImageItem] = []
        self.expanded: list[int] = []
        """The image index of every item of an epoch (repeats expanded)."""
        self.buckets: list[tuple[int, int]] | None = None
        self.image_bucket: list[int] | None = None
        self.item_buckets: list[int] | None = None
        self.class_images: list[ImageItem] = []
        self.use_cache = False
        self.latents: LatentTable | None = None
        self.class_latents: LatentTable | None = None
        self._fingerprint: str | None = None
        self.held_out: list[ImageItem] = []
        self.held_out_buckets: list[tuple[int, int]] | None = None
        self.held_out_bucket: list[int] | None = None
        self.held_out_latents: LatentTable | None = None
        self.augment = CaptionAugment.from_config(self.cfg.data)
        self.masks: LatentMasks | None = None

    @property
    def vae_fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint(self.vae)
        return self._fingerprint

    def prepare(self) -> int:
        """Scan, check, bucket and cache; return the number of items per epoch (repeats included)."""
        cfg, ctx = self.cfg, self.ctx
        # Held-out images are gone from `scan.items`: neither an epoch, nor buckets, nor the cache sees them.
        scan = training_scan(cfg, resolution=None if cfg.data.bucketing else cfg.data.resolution)  # buckets: own check
        for warning in scan.warnings:
            ctx.log_warning(f"data: {warning}")
        self.images, self.held_out = scan.items, scan.held_out
        for warning in check_masks(cfg, scan):
            ctx.log_warning(warning)
        self.masks = LatentMasks(self, cfg.data.masks, [scan.root, cfg.data.val_path]) if cfg.data.masks else None
        self.expanded = [i for i, item in enumerate(scan.items) for _ in range(item.repeats)]
        self._assign_buckets()
        self.class_images = []
        if cfg.prior.enabled:
            if self.draw_class_images is None:
                raise ValueError("prior.enabled needs a way to draw class images")
            self.class_images = ensure_class_images(self.draw_class_images, ctx)
        self.latents = self.class_latents = self.held_out_latents = None
        self.use_cache = cfg.data.cache_latents and cfg.data.center_crop
        if cfg.data.cache_latents and not cfg.data.center_crop:
            ctx.log_warning("data.cache_latents is off because data.center_crop is false (random crops)")
        if self.use_cache:
            self.latents = self._cache(self.images, "instance", self.buckets, self.image_bucket, cfg.data.flip)
            if self.class_images:
                self.class_latents = self._cache(self.class_images, "class", None, None, cfg.data.flip)
        if self.held_out and cfg.data.cache_latents:  # always center-cropped and unflipped: cached whatever the crop
            self.held_out_latents = self._cache(self.held_out, "val", self.held_out_buckets, self.held_out_bucket,
                                                False)
        return len(self.expanded)

    def _assign_buckets(self) -> None:
        """data.bucketing: each image's aspect-ratio bucket (trainer.core.data.buckets). Sets `buckets` ((width,
        height) per bucket), `image_bucket` (per image) and `item_buckets` (per expanded item: the stream then
        takes every optimizer step's batch from one bucket); all None without bucketing."""
        cfg, ctx = self.cfg, self.ctx
        self.buckets = self.image_bucket = self.item_buckets = None
        self.held_out_buckets = self.held_out_bucket = None
        if not cfg.data.bucketing:
            return
        spec = BucketSpec.from_config(cfg.data)
        if self.held_out:  # each held-out image in the bucket it would train in; their own list, not the stream's
            self.held_out_buckets, self.held_out_bucket = assign_buckets([(i.width, i.height) for i in self.held_out],
                                                                         spec)
        buckets, image_bucket = assign_buckets([(i.width, i.height) for i in self.images], spec)
        self.buckets, self.image_bucket = buckets, image_bucket
        self.item_buckets = item_buckets = [image_bucket[i] for i in self.expanded]
        for item, bucket in zip(self.images, image_bucket):
            w, h = buckets[bucket]
            if item.width < w or item.height < h:
                ctx.log_warning(f"data: {os.path.basename(item.path)}: {item.width}x{item.height} is smaller than its "
                                f"bucket {w}x{h}; it will be upscaled and may look blurry")
        total = ctx.plan.total
        for bucket, (w, h) in enumerate(buckets):
            count = item_buckets.count(bucket)
            if count < total:
                ctx.log_warning(f"data: bucket {w}x{h} holds {count} image{'s' if count != 1 else ''} (repeats "
                                f"included), fewer than batch.total {total}: its steps repeat some of them")

    # ---- what the loss asks -------------------------------------------------------------------------------
    def item(self, image_index: int, kind: str) -> ImageItem:
        return {"instance": self.images, "class": self.class_images, "val": self.held_out}[kind][image_index]

    def caption(self, image_index: int, kind: str) -> str:
        """An image's caption with `data.caption_prefix`, without the per-sample draws. Class images are captioned
        with the class prompt whatever their .txt says: that is what the prior means."""
        return self.cfg.prior.class_prompt if kind == "class" else self.augment.fixed(self.item(image_index, kind).caption)

    def row_caption(self, row: Row) -> str:
        """The caption a sample trains on: a training image's is augmented (dropped, tags shuffled) as a function
        of its stream position (trainer.core.data.captions); held-out and class images keep theirs."""
        position, _, image_index, _, kind = row
        if kind != "instance":
            return self.caption(image_index, kind)
        return self.augment.draw(self.images[image_index].caption, seed=self.cfg.seed, position=position)

    def captions(self) -> list[str]:
        """Every caption a loss may ask for (training and held-out images with the prefix, the empty caption when
        captions are dropped, the class prompt): the text caches'. Shuffled tags are not among them: a run that
        shuffles encodes per step (`augment.cacheable`)."""
        out = self.augment.cached_captions(item.caption for item in self.images + self.held_out)
        return out + [self.cfg.prior.class_prompt] if self.class_images else out

    def loss_masks(self, rows: Sequence[Row], latent_hw: tuple[int, int]) -> torch.Tensor | None:
        """(B, 1, h, w) loss weights of `rows` from `data.masks`, or None: every sample trains whole."""
        return self.masks.batch(rows, latent_hw) if self.masks is not None else None

    def target(self, image_index: int, kind: str) -> Size:
        """The pixel size a sample is made at: its bucket's (width, height), or the square resolution."""
        if kind == "instance" and self.buckets is not None and self.image_bucket is not None:
            return self.buckets[self.image_bucket[image_index]]
        if kind == "val" and self.held_out_buckets is not None and self.held_out_bucket is not None:
            return self.held_out_buckets[self.held_out_bucket[image_index]]
        return self.cfg.data.resolution

    def center_cropped(self, kind: str) -> bool:
        """Whether a sample of `kind` is cropped at the center (held-out ones always are)."""
        return kind == "val" or self.cfg.data.center_crop

    def rows(self, samples: Sequence[Sample]) -> tuple[list[Row], list[Row]]:
        """The micro-batch's instance rows and, with prior preservation, its class rows: the class image of a
        position cycles through the class images, one "epoch" per pass."""
        instance = [(pos, epoch, self.expanded[idx], idx, "instance") for pos, epoch, idx in samples]
        n = len(self.class_images)
        prior = [(pos, pos // n, pos % n, pos % n, "class") for pos, _, _ in samples] if n else []
        return instance, prior

    def loss(self, samples: Sequence[Sample], rows_loss: Callable[[list[Row], int], torch.Tensor]) -> torch.Tensor:
        """Mean loss of a micro-batch: `rows_loss(rows, stream)` gives per-sample losses; the class rows (their
        own random stream, 1) add `prior.loss_weight` times theirs."""
        instance, prior = self.rows(samples)
        loss = rows_loss(instance, 0).mean()
        if prior:
            loss = loss + self.cfg.prior.loss_weight * rows_loss(prior, 1).mean()
        return loss

    def latent_dist(self, image_index: int, epoch: int, expanded_index: int, kind: str):
        """(mean, std) of the VAE latent distribution of one training sample, with its augmentation."""
        cfg = self.cfg
        cached = {"instance": self.latents, "class": self.class_latents, "val": self.held_out_latents}[kind]
        flip = cfg.data.flip and kind != "val"
        if cached is not None:
            mirrored = flip and sample_rng(cfg.seed, epoch, expanded_index).random() < 0.5
            suffix = "_flip" if mirrored else ""
            return cached["mean" + suffix][image_index], cached["std" + suffix][image_index]
        pixels = load_image_tensor(self.item(image_index, kind).path, self.target(image_index, kind),
                                   crop="center" if self.center_cropped(kind) else "random", flip=flip,
                                   rng=sample_rng(cfg.seed, epoch, expanded_index))
        with torch.no_grad():
            dist = self.vae.encode(pixels[None].to(self.ctx.device, self.vae.dtype)).latent_dist
        return dist.mean[0].float().cpu(), dist.std[0].float().cpu()

    # ---- the latent cache ---------------------------------------------------------------------------------
    def _cache(self, items: list[ImageItem], kind: str, buckets: list[tuple[int, int]] | None,
               image_bucket: list[int] | None, flip: bool) -> LatentTable:
        """With buckets, each bucket has its own cache (chunks of one shape), and the rows are gathered per
        image."""
        if buckets is None or image_bucket is None:
            return self._cache_rows(items, kind, self.cfg.data.resolution, flip)
        table: dict[str, list] = {}
        for bucket, size in enumerate(buckets):
            members = [i for i, b in enumerate(image_bucket) if b == bucket]
            rows = self._cache_rows([items[i] for i in members], kind, size, flip)
            for name, values in rows.items():
                column = table.setdefault(name, [None] * len(items))
                for row, index in enumerate(members):
                    column[index] = values[row]
        return table

    def _cache_rows(self, items: list[ImageItem], kind: str, size: Size, flip: bool) -> dict[str, torch.Tensor]:
        cfg, ctx = self.cfg, self.ctx
        # The key's parts are those of the first runs' caches: changing them orphans every cache on disk.
        parts: dict[str, Any] = {"model": cfg.model.path, "vae": dict(self.vae.config), "res": cfg.data.resolution,
                                 "flip": flip, "kind": kind, "weights": self.vae_fingerprint}
        if not isinstance(size, int):
            parts["bucket"] = list(size)
        key = cache_key(parts, [i.path for i in items])

        @torch.no_grad()
        def encode(indices):
            out = {}
            for suffix, mirrored in (("", False), ("_flip", True)) if flip else (("", False),):
                pixels = torch.stack([self._pixels(items[i].path, mirrored, size) for i in indices])
                dist = self.vae.encode(pixels.to(ctx.device, self.vae.dtype)).latent_dist
                out["mean" + suffix], out["std" + suffix] = dist.mean, dist.std
            return out

        return build_latent_cache(ctx.cache_dir / "latents" / key, len(items), encode, rank=ctx.rank,
                                  world_size=ctx.world_size, barrier=ctx.accelerator.wait_for_everyone,
                                  device=ctx.device)

    def _pixels(self, path: str, mirrored: bool, size: Size | None = None) -> torch.Tensor:
        pixels = load_image_tensor(path, size or self.cfg.data.resolution, crop="center")
        return pixels.flip(-1) if mirrored else pixels
