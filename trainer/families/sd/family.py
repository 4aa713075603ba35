"""Stable Diffusion 1.x / 2.x: LoRA (peft through diffusers' adapter API) and DreamBooth full fine-tuning,
epsilon and v-prediction, optional prior preservation."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from diffusers import DDPMScheduler, DPMSolverMultistepScheduler, StableDiffusionPipeline

from trainer.core.data.buckets import BucketSpec, assign_buckets
from trainer.families.components.captioned import load_image_tensor, sample_rng, torch_generator
from trainer.core.data.scan import require_usable, scan_dataset
from trainer.core.data.stream import position_seed
from trainer.families.components import noise as diffusion
from trainer.families.protocol import WorkerContext
from trainer.families.components.latent_cache import build_latent_cache, cache_key
from trainer.families.components.prior import ensure_class_images
from trainer.families.components.sd_loading import load_sd_components
from trainer.families.components.base_weights import frozen_dtype, place_frozen_network


class StableDiffusionFamily:
    name = "sd"

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.cfg = ctx.config
        self.prepared: list[torch.nn.Module] = []

    # ---- models -------------------------------------------------------------------------------------------
    def load(self) -> None:
        cfg, device = self.cfg, self.ctx.device
        parts = load_sd_components(cfg.model)
        self.unet, self.vae, self.text_encoder, self.tokenizer = parts.unet, parts.vae, parts.text_encoder, parts.tokenizer
        self.scheduler_config = parts.scheduler_config
        self.prediction_type = parts.prediction_type
        self.noise_scheduler = DDPMScheduler.from_config(parts.scheduler_config, prediction_type=self.prediction_type)
        for module in (self.unet, self.vae, self.text_encoder):
            module.requires_grad_(False)

        self.train_text_encoder = cfg.lora.train_text_encoder if cfg.method == "lora" else cfg.full.train_text_encoder
        setup_models(cfg, self.ctx.plan, device, unet=self.unet, vae=self.vae, text_encoders=[self.text_encoder],
                     train_text_encoder=self.train_text_encoder)

    def trainable_modules(self) -> list[torch.nn.Module]:
        return [self.unet, self.text_encoder] if self.train_text_encoder else [self.unet]

    def set_prepared(self, modules: list[torch.nn.Module]) -> None:
        self.prepared = modules

    def param_groups(self) -> list[dict]:
        t = self.cfg.train
        groups = [{"params": [p for p in self.unet.parameters() if p.requires_grad], "lr": t.lr}]
        if self.train_text_encoder:
            params = [p for p in self.text_encoder.parameters() if p.requires_grad]
            groups.append({"params": params, "lr": t.text_encoder_lr or t.lr})
        return groups

    def _named_trainable(self):
        for prefix, module in (("unet", self.unet), ("text_encoder", self.text_encoder)):
            for name, p in self.ctx.unwrap(module).named_parameters():  # FSDP: the gathered full weights
                if p.requires_grad:
                    yield f"{prefix}.{name}", p

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().float().cpu().contiguous() for name, p in self._named_trainable()}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self._named_trainable())
        missing = sorted(set(params) - set(state))
        if missing:
            raise RuntimeError(f"checkpoint lacks {len(missing)} trainable tensors, e.g. {missing[0]}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name].to(p.device, p.dtype))

    # ---- data ---------------------------------------------------------------------------------------------
    def prepare_data(self) -> int:
        cfg, ctx = self.cfg, self.ctx
        scan = scan_dataset(cfg.data.path, instance_prompt=cfg.data.instance_prompt,
                            caption_extension=cfg.data.caption_extension,
                            resolution=None if cfg.data.bucketing else cfg.data.resolution)  # buckets: own check
        require_usable(scan)
        for warning in scan.warnings:
            ctx.log_warning(f"data: {warning}")
        self.images = scan.items
        self.expanded = [i for i, item in enumerate(scan.items) for _ in range(item.repeats)]
        self._assign_buckets()
        self.class_images = []
        if cfg.prior.enabled:
            self.class_images = ensure_class_images(self, ctx)
        self.tokens = {}
        self.latents = self.class_latents = None
        self.use_cache = cfg.data.cache_latents and cfg.data.center_crop
        if cfg.data.cache_latents and not cfg.data.center_crop:
            ctx.log_warning("data.cache_latents is off because data.center_crop is false (random crops)")
        if self.use_cache:
            self.latents = self._cache(self.images, "instance")
            if self.class_images:
                self.class_latents = self._cache(self.class_images, "class")
        return len(self.expanded)

    def _assign_buckets(self) -> None:
        """data.bucketing: each image's aspect-ratio bucket (trainer.core.data.buckets). Sets `buckets` ((width, height)
        per bucket), `image_bucket` (per image) and `item_buckets` (per expanded item: the stream then takes every
        optimizer step's batch from one bucket); all None without bucketing."""
        cfg, ctx = self.cfg, self.ctx
        self.buckets = self.image_bucket = self.item_buckets = None
        if not cfg.data.bucketing:
            return
        self.buckets, self.image_bucket = assign_buckets([(i.width, i.height) for i in self.images],
                                                         BucketSpec.from_config(cfg.data))
        self.item_buckets = [self.image_bucket[i] for i in self.expanded]
        for item, bucket in zip(self.images, self.image_bucket):
            w, h = self.buckets[bucket]
            if item.width < w or item.height < h:
                ctx.log_warning(f"data: {os.path.basename(item.path)}: {item.width}x{item.height} is smaller than its "
                                f"bucket {w}x{h}; it will be upscaled and may look blurry")
        total = ctx.plan.total
        for bucket, (w, h) in enumerate(self.buckets):
            count = self.item_buckets.count(bucket)
            if count < total:
                ctx.log_warning(f"data: bucket {w}x{h} holds {count} image{'s' if count != 1 else ''} (repeats "
                                f"included), fewer than batch.total {total}: its steps repeat some of them")

    def _target(self, image_index: int, kind: str):
        """The pixel size a sample is made at: its bucket's (width, height), or the square resolution."""
        if kind == "instance" and self.image_bucket is not None:
            return self.buckets[self.image_bucket[image_index]]
        return self.cfg.data.resolution

    def _cache(self, items, kind: str) -> dict:
        """{"mean"/"std"(+"_flip"): per-image latents, indexable by image index}. With buckets, each bucket has
        its own cache (chunks of one shape), and the rows are gathered per image."""
        if kind != "instance" or self.image_bucket is None:
            return self._cache_rows(items, kind, self.cfg.data.resolution)
        table: dict[str, list] = {}
        for bucket, size in enumerate(self.buckets):
            members = [i for i, b in enumerate(self.image_bucket) if b == bucket]
            rows = self._cache_rows([items[i] for i in members], kind, size)
            for name, values in rows.items():
                column = table.setdefault(name, [None] * len(items))
                for row, index in enumerate(members):
                    column[index] = values[row]
        return table

    def _cache_rows(self, items, kind: str, size) -> dict[str, torch.Tensor]:
        cfg, ctx = self.cfg, self.ctx
        parts = {"model": cfg.model.path, "vae": dict(self.vae.config), "res": cfg.data.resolution,
                 "flip": cfg.data.flip, "kind": kind}
        if not isinstance(size, int):
            parts["bucket"] = list(size)
        key = cache_key(parts, [i.path for i in items])
        flip = cfg.data.flip

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

    def _pixels(self, path: str, mirrored: bool, size=None) -> torch.Tensor:
        pixels = load_image_tensor(path, size or self.cfg.data.resolution, crop="center")
        return pixels.flip(-1) if mirrored else pixels

    def _token_ids(self, caption: str) -> torch.Tensor:
        if caption not in self.tokens:
            self.tokens[caption] = self.tokenizer(caption, padding="max_length", truncation=True,
                                                  max_length=self.tokenizer.model_max_length,
                                                  return_tensors="pt").input_ids[0]
        return self.tokens[caption]

    def _latent_dist(self, image_index: int, epoch: int, expanded_index: int, kind: str):
        """(mean, std) of the VAE latent distribution of one training sample, with its augmentation."""
        cfg = self.cfg
        items = self.images if kind == "instance" else self.class_images
        cached = self.latents if kind == "instance" else self.class_latents
        if self.use_cache and cached is not None:
            mirrored = cfg.data.flip and sample_rng(cfg.seed, epoch, expanded_index).random() < 0.5
            suffix = "_flip" if mirrored else ""
            return cached["mean" + suffix][image_index], cached["std" + suffix][image_index]
        pixels = load_image_tensor(items[image_index].path, self._target(image_index, kind),
                                   crop="center" if cfg.data.center_crop else "random", flip=cfg.data.flip,
                                   rng=sample_rng(cfg.seed, epoch, expanded_index))
        with torch.no_grad():
            dist = self.vae.encode(pixels[None].to(self.ctx.device, self.vae.dtype)).latent_dist
        return dist.mean[0].float().cpu(), dist.std[0].float().cpu()

    # ---- loss ---------------------------------------------------------------------------------------------
    def loss(self, samples) -> torch.Tensor:
        """samples: (position, epoch, expanded index) triples; see trainer.core.data.stream."""
        instance = [(pos, epoch, self.expanded[idx], idx, "instance") for pos, epoch, idx in samples]
        loss = self._diffusion_loss(instance, stream=0).mean()
        if self.class_images:
            n = len(self.class_images)
            prior = [(pos, pos // n, pos % n, pos % n, "class") for pos, _, _ in samples]
            loss = loss + self.cfg.prior.loss_weight * self._diffusion_loss(prior, stream=1).mean()
        return loss

    def _diffusion_loss(self, rows, *, stream: int) -> torch.Tensor:
        cfg, device = self.cfg, self.ctx.device
        latents, noises, timesteps, captions = [], [], [], []
        factor = self.vae.config.scaling_factor
        for position, epoch, image_index, expanded_index, kind in rows:
            mean, std = self._latent_dist(image_index, epoch, expanded_index, kind)
            gen = torch_generator(position_seed(cfg.seed, position, stream))
            d = diffusion.draw(gen, tuple(mean.shape), num_timesteps=self.noise_scheduler.config.num_train_timesteps,
                               noise_offset=cfg.train.noise_offset)
            latents.append((mean + std * d.latent_eps) * factor)
            noises.append(d.noise)
            timesteps.append(d.timestep)
            captions.append(self.images[image_index].caption if kind == "instance" else cfg.prior.class_prompt)
        latents, noise = torch.stack(latents).to(device), torch.stack(noises).to(device)
        t = torch.tensor(timesteps, device=device, dtype=torch.long)
        noisy = self.noise_scheduler.add_noise(latents, noise, t)
        pred = self._predict(noisy, t, captions, rows)
        target = diffusion.target_for(self.noise_scheduler, latents, noise, t, self.prediction_type)
        return diffusion.per_sample_loss(pred, target, scheduler=self.noise_scheduler, timesteps=t,
                                         prediction_type=self.prediction_type, min_snr_gamma=cfg.train.min_snr_gamma)

    def _predict(self, noisy, t, captions: list[str], rows) -> torch.Tensor:
        """The UNet's prediction for a noisy batch (SDXL overrides this with its own conditioning)."""
        device = self.ctx.device
        unet = self.prepared[0]
        text_encoder = self.prepared[1] if self.train_text_encoder else self.text_encoder
        ids = torch.stack([self._token_ids(c) for c in captions]).to(device)
        with torch.set_grad_enabled(self.train_text_encoder):
            hidden = text_encoder(ids, return_dict=False)[0]
        return unet(noisy.to(self.unet.dtype), t, hidden, return_dict=False)[0]

    # ---- samples and outputs ------------------------------------------------------------------------------
    def pipeline(self) -> StableDiffusionPipeline:
        unwrap = self.ctx.unwrap
        scheduler = DPMSolverMultistepScheduler.from_config(self.scheduler_config, prediction_type=self.prediction_type)
        return StableDiffusionPipeline(vae=self.vae, text_encoder=unwrap(self.text_encoder), tokenizer=self.tokenizer,
                                       unet=unwrap(self.unet), scheduler=scheduler, safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)

    def render_samples(self, step: int):
        cfg = self.cfg.sample
        if not cfg.prompts:
            return []
        seeds = [cfg.seed + i for i in range(len(cfg.prompts))]
        images = self.sample(list(cfg.prompts), seeds, size=cfg.size, steps=cfg.steps,
                             guidance_scale=cfg.guidance_scale, negative_prompt=cfg.negative_prompt)
        return list(zip(cfg.prompts, images))

    @torch.no_grad()
    def sample(self, prompts: list[str], seeds: list[int], *, size: int | None = None, steps: int = 25,
               guidance_scale: float = 7.5, negative_prompt: str = ""):
        pipe = self.pipeline()
        pipe.set_progress_bar_config(disable=True)
        size = size or self.cfg.data.resolution
        was_training = [m.training for m in (self.unet, self.text_encoder)]
        self.unet.eval(), self.text_encoder.eval()
        images = []
        try:
            for prompt, seed in zip(prompts, seeds):
                gen = torch.Generator(self.ctx.device).manual_seed(seed)
                dtype = pipe.unet.dtype  # the sampling copy's (FSDP: low precision, see FSDP.gathered)
                with torch.autocast(self.ctx.device.type, dtype=dtype, enabled=dtype != torch.float32):
                    out = pipe(prompt, negative_prompt=negative_prompt or None, height=size, width=size,
                               num_inference_steps=steps, guidance_scale=guidance_scale, generator=gen)
                images.append(out.images[0])
        finally:
            self.unet.train(was_training[0]), self.text_encoder.train(was_training[1])
        return images

    def save_outputs(self, out_dir: Path, *, step: int) -> list[str]:
        from trainer.families.sd.outputs import save_sd_outputs

        return save_sd_outputs(self, out_dir, step=step)


def setup_models(cfg, plan, device, *, unet, vae, text_encoders, train_text_encoder: bool, te_lora_kwargs=None) -> None:
    """Shared by the UNet families (SD 1.x/2.x, SDXL): move and cast the models, add LoRA layers (or unfreeze for a
    full fine-tune), keep trained weights fp32, gradient checkpointing, train/eval modes. `te_lora_kwargs[i]`:
    extra peft LoraConfig arguments for text encoder i (e.g. which layers)."""
    base_dtype = frozen_dtype(plan.precision, cfg.method)
    # The VAE stays fp32 under fp16: SD VAEs (SDXL's above all) overflow to NaN latents in fp16 (black samples).
    vae.to(device, dtype=torch.float32 if plan.precision == "fp16" else base_dtype)
    place_frozen_network(unet, cfg.model.base_weights, device, base_dtype)  # fp8 / nf4: LoRA only (validated)
    for text_encoder in text_encoders:
        text_encoder.to(device, dtype=base_dtype)
    if plan.attention == "xformers":
        unet.enable_xformers_memory_efficient_attention()

    torch.manual_seed(cfg.seed)  # identical adapter init on every rank and every world size
    if cfg.method == "lora":
        from peft import LoraConfig

        def adapter(targets, **extra):
            return LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                              init_lora_weights="gaussian", target_modules=list(targets), **extra)

        unet.add_adapter(adapter(cfg.lora.unet_targets))
        if train_text_encoder:
            from peft import inject_adapter_in_model

            # transformers' own add_adapter refuses peft < 0.22; injecting directly works with every peft
            for i, text_encoder in enumerate(text_encoders):
                extra = (te_lora_kwargs or {}).get(i, {})
                inject_adapter_in_model(adapter(cfg.lora.text_encoder_targets, **extra), text_encoder)
    else:
        unet.requires_grad_(True)
        for text_encoder in text_encoders:
            text_encoder.requires_grad_(train_text_encoder)
    trained = [unet] + (list(text_encoders) if train_text_encoder else [])
    for module in trained:
        for p in module.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # trained weights stay fp32 whatever the precision
    if cfg.train.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        if train_text_encoder:
            for text_encoder in text_encoders:
                enable = getattr(text_encoder, "activation_checkpointing_enable", None)
                (enable or text_encoder.gradient_checkpointing_enable)()
    unet.train()
    for text_encoder in text_encoders:
        text_encoder.train(train_text_encoder)
    vae.eval()
