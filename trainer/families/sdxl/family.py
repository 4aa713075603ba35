"""SDXL (base and fine-tunes): LoRA on the UNet and optionally both text encoders, or a full fine-tune;
epsilon and v-prediction; size/crop micro-conditioning; cached latents and cached text embeddings.

Composed of the parts it shares with SD 1.x/2.x (the captioned data and latent cache: `CaptionedLatents`; model
setup, noise draws and loss maths: `unet_training`; checkpoint tensors: `trained_weights`), with what SDXL does
its own way: two text encoders (penultimate hidden states of both, concatenated, and the pooled projection of the
second), `add_time_ids` = (original height, width, crop top, left, target height, width) from each image's real
size and crop, the XL pipeline for samples and its LoRA file layout.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from diffusers import DDPMScheduler, DPMSolverMultistepScheduler, StableDiffusionXLPipeline

from trainer.core.data.buckets import cover_and_crop
from trainer.families.components.latent_cache import weights_fingerprint
from trainer.families.components import text_cache, trained_weights
from trainer.families.components.captioned import _integer, flip_drawn, sample_rng
from trainer.families.components.captioned_latents import CaptionedLatents, Row
from trainer.families.components.noise import zero_terminal_snr
from trainer.families.components.sd_loading import load_pipeline
from trainer.families.components.unet_training import ddpm_loss, setup_models
from trainer.families.components.validation import held_out_loss
from trainer.families.components.transfer import on_device, tensor_on
from trainer.families.protocol import Evaluates, Sample, WorkerContext

CACHE_TEXT_DEFAULT = True


class StableDiffusionXLFamily:
    name = "sdxl"

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.cfg = ctx.config
        self.prepared: list[torch.nn.Module] = []
        self.ema: Any = None
        self.item_buckets: list[int] | None = None
        self.text_embeddings: text_cache.TextEmbeddings | None = None
        self.evaluator: Evaluates | None = None

    # ---- models -------------------------------------------------------------------------------------------
    def load(self) -> None:
        cfg, device = self.cfg, self.ctx.device
        pipe = load_pipeline(cfg.model, StableDiffusionXLPipeline,
                             folder_hint="unet/, vae/, text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/")
        self.unet: Any = pipe.unet
        self.vae: Any = pipe.vae
        self.text_encoder: Any = pipe.text_encoder
        self.text_encoder_2: Any = pipe.text_encoder_2
        self.tokenizer: Any = pipe.tokenizer
        self.tokenizer_2: Any = pipe.tokenizer_2
        self.prediction_type = cfg.model.prediction_type
        if self.prediction_type == "auto":
            self.prediction_type = pipe.scheduler.config.get("prediction_type", "epsilon")
        self.scheduler_config = zero_terminal_snr(dict(pipe.scheduler.config), enabled=cfg.model.zero_terminal_snr,
                                                  prediction_type=self.prediction_type)
        self.noise_scheduler = DDPMScheduler.from_config(self.scheduler_config, prediction_type=self.prediction_type)
        for module in (self.unet, self.vae, self.text_encoder, self.text_encoder_2):
            module.requires_grad_(False)
        self.train_text_encoder = cfg.lora.train_text_encoder if cfg.method == "lora" else cfg.full.train_text_encoder
        # Only the penultimate layer of text_encoder is used: its last layer would get no gradient (and DDP
        # would wait for one forever), so it is neither adapted nor trained.
        last = self.text_encoder.config.num_hidden_layers - 1
        te_lora = {0: {"layers_to_transform": list(range(last)), "layers_pattern": "layers"}}
        setup_models(cfg, self.ctx.plan, device, unet=self.unet, vae=self.vae,
                     text_encoders=[self.text_encoder, self.text_encoder_2],
                     train_text_encoder=self.train_text_encoder, te_lora_kwargs=te_lora,
                     pipeline=self.pipeline)
        if cfg.method == "full" and self.train_text_encoder:
            te = self.text_encoder
            for module in (_encoder_layers(te)[last], _final_norm(te)):
                module.requires_grad_(False)
        self.text_embeddings = None
        self.data = CaptionedLatents(self.ctx, self.vae, draw_class_images=self.sample)
        self.evaluator = held_out_loss(self.ctx, self.data, self._plain_rows_loss, self.trainable_modules)

    def trainable_modules(self) -> list[torch.nn.Module]:
        return [self.unet, self.text_encoder, self.text_encoder_2] if self.train_text_encoder else [self.unet]

    def set_prepared(self, modules: list[torch.nn.Module]) -> None:
        self.prepared = modules

    def param_groups(self) -> list[dict]:
        t = self.cfg.train
        groups = [{"params": [p for p in self.unet.parameters() if p.requires_grad], "lr": t.lr}]
        if self.train_text_encoder:
            params = [p for te in (self.text_encoder, self.text_encoder_2) for p in te.parameters() if p.requires_grad]
            groups.append({"params": params, "lr": t.text_encoder_lr or t.lr})
        return groups

    def _checkpoint_modules(self):
        return (("unet", self.unet), ("text_encoder", self.text_encoder), ("text_encoder_2", self.text_encoder_2))

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return trained_weights.trainable_state(self.ctx, self._checkpoint_modules())

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        trained_weights.load_trainable_state(self.ctx, self._checkpoint_modules(), state)

    # ---- data ---------------------------------------------------------------------------------------------
    def prepare_data(self) -> int:
        count = self.data.prepare()
        self.item_buckets = self.data.item_buckets
        cfg, ctx = self.cfg, self.ctx
        wanted = text_cache.cache_text_embeddings(cfg, CACHE_TEXT_DEFAULT, ctx.log_warning)
        if wanted and self.train_text_encoder:
            ctx.log_warning("data.cache_text_embeddings is off because the text encoders are trained")
        if wanted and not self.train_text_encoder:
            captions = self.data.captions()
            model = {"family": self.name, "path": cfg.model.path, "revision": cfg.model.revision,
                     "te1": self.text_encoder.config.to_dict(), "te2": self.text_encoder_2.config.to_dict(),
                     "max_length": (self.tokenizer.model_max_length, self.tokenizer_2.model_max_length),
                     "dtype": str(self.text_encoder.dtype),
                     "weights": weights_fingerprint(self.text_encoder, self.text_encoder_2)}
            folder = ctx.cache_dir / "text" / text_cache.text_cache_key(model, captions)
            encode = lambda batch: dict(zip(("hidden", "pooled"), self.encode_prompts(batch)))  # noqa: E731
            self.text_embeddings = text_cache.build_text_cache(
                folder, captions, encode, rank=ctx.rank, world_size=ctx.world_size,
                barrier=ctx.accelerator.wait_for_everyone, device=ctx.device)
            text_cache.offload(self.text_encoder, self.text_encoder_2)
        return count

    def encode_prompts(self, captions: list[str], text_encoders=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states (n, 77, d1 + d2), pooled (n, p)) as SDXL's pipeline computes them."""
        te1, te2 = text_encoders or (self.text_encoder, self.text_encoder_2)
        device = next(te1.parameters()).device
        hidden = []
        for tokenizer, te in ((self.tokenizer, te1), (self.tokenizer_2, te2)):
            ids = tokenizer(captions, padding="max_length", truncation=True, max_length=tokenizer.model_max_length,
                            return_tensors="pt").input_ids.to(device)
            out = te(ids, output_hidden_states=True, return_dict=True)
            hidden.append(out.hidden_states[-2])
        return torch.cat(hidden, dim=-1), out.text_embeds

    def time_ids(self, row: Row) -> list[float]:
        """(original h, w, crop top, left, target h, w) of a training sample, as its pixels were made."""
        cfg = self.cfg
        _, epoch, image_index, expanded_index, kind = row
        item = self.data.item(image_index, kind)
        target = self.data.target(image_index, kind)  # the square resolution, or the image's bucket
        tw, th = (target, target) if isinstance(target, int) else target
        _, (room_x, room_y) = cover_and_crop(item.width, item.height, (tw, th))
        if self.data.center_cropped(kind):
            left, top = room_x // 2, room_y // 2
        else:  # replays load_image_tensor's draws: the flip coin (when flipping), then left, then top
            rng = sample_rng(cfg.seed, epoch, expanded_index)
            if self.data.flips(image_index, kind):
                flip_drawn(rng)
            left, top = _integer(rng, room_x), _integer(rng, room_y)
        return [item.height, item.width, top, left, th, tw]

    # ---- loss ---------------------------------------------------------------------------------------------
    def loss(self, samples: list[Sample]) -> torch.Tensor:
        return self.data.loss(samples, self._rows_loss)

    def fetch(self, samples: list[Sample]) -> list[dict[str, torch.Tensor]]:
        return self.data.fetch(samples)  # in a DataLoader worker with data.workers > 0 (trainer.engine.input)

    def loss_of(self, samples: list[Sample], fetched: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        with self.data.fetched(samples, fetched):
            return self.loss(samples)

    def _rows_loss(self, rows: list[Row], stream: int, *, plain: bool = False) -> torch.Tensor:
        """Per-sample losses through the wrapped modules the loop accumulates on; `plain` (the validation loss,
        without gradients): through the modules themselves, which no DDP wrapper expects a backward of."""
        modules = self.trainable_modules() if plain else self.prepared
        return ddpm_loss(rows, stream, data=self.data, vae=self.vae, noise_scheduler=self.noise_scheduler,
                         prediction_type=self.prediction_type,
                         predict=lambda noisy, t, captions, rows: self._predict(noisy, t, captions, rows, modules))

    def _plain_rows_loss(self, rows: list[Row], stream: int) -> torch.Tensor:
        return self._rows_loss(rows, stream, plain=True)

    @functools.cached_property
    def _input_dtype(self) -> torch.dtype:
        """The denoiser's input dtype, read once (the first step, after any wrapping): diffusers' `ModelMixin.dtype`
        walks every submodule, 1.5 ms of each micro-step on the demo's LoRA UNet (bench/README.md)."""
        return self.unet.dtype

    def _predict(self, noisy: torch.Tensor, t: torch.Tensor, captions: list[str], rows: list[Row],
                 modules) -> torch.Tensor:
        device = self.ctx.device
        if self.text_embeddings is not None:
            cached = self.text_embeddings.stack(captions)
            hidden, pooled = cached["hidden"], cached["pooled"]
        else:
            encoders = tuple(modules[1:3]) if self.train_text_encoder else None
            with torch.set_grad_enabled(self.train_text_encoder and torch.is_grad_enabled()):
                hidden, pooled = self.encode_prompts(captions, encoders)
        dtype = self._input_dtype
        time_ids = tensor_on([self.time_ids(row) for row in rows], device, torch.float32)
        added = {"text_embeds": on_device(pooled, device, dtype), "time_ids": time_ids.to(dtype)}
        return modules[0](noisy.to(dtype), t, on_device(hidden, device, dtype), added_cond_kwargs=added,
                          return_dict=False)[0]

    # ---- samples and outputs ------------------------------------------------------------------------------
    def pipeline(self) -> Any:
        def unwrap(module):
            return trained_weights.unwrapped(self.ctx, module)

        scheduler = DPMSolverMultistepScheduler.from_config(self.scheduler_config, prediction_type=self.prediction_type)
        return StableDiffusionXLPipeline(vae=self.vae, text_encoder=unwrap(self.text_encoder),
                                         text_encoder_2=unwrap(self.text_encoder_2), tokenizer=self.tokenizer,
                                         tokenizer_2=self.tokenizer_2, unet=unwrap(self.unet), scheduler=scheduler)

    def render_samples(self, step: int):
        shape = trained_weights.sample_shape(self.cfg.sample, self.cfg.data.resolution, self.data.buckets,
                                             self.data.item_buckets)
        return trained_weights.render_prompt_samples(self.cfg.sample, self.sample, shape)

    @torch.no_grad()
    def sample(self, prompts: list[str], seeds: list[int], *, size: int | tuple[int, int] | None = None, steps: int = 25,
               guidance_scale: float = 7.5, negative_prompt: str = ""):
        device = self.ctx.device
        offloaded = self.text_embeddings is not None
        if offloaded:
            text_cache.onload(device, self.text_encoder, self.text_encoder_2)
        pipe = self.pipeline()
        pipe.set_progress_bar_config(disable=True)
        width, height = trained_weights.pixel_size(size, self.cfg.data.resolution)
        modules = (self.unet, self.text_encoder, self.text_encoder_2)
        was_training = [m.training for m in modules]
        for m in modules:
            m.eval()
        images: list = []
        try:
            for prompt, run_seeds in trained_weights.prompt_runs(prompts, seeds, width, height):
                gens = [torch.Generator(device).manual_seed(seed) for seed in run_seeds]
                dtype = pipe.unet.dtype  # the sampling copy's (FSDP: low precision, see FSDP.gathered)
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    latents = pipe(prompt, negative_prompt=negative_prompt or None, height=height, width=width,
                                   num_inference_steps=steps, guidance_scale=guidance_scale, generator=gens,
                                   num_images_per_prompt=len(gens), output_type="latent").images
                images.extend(self._decode(pipe, one) for one in latents.split(1))  # one at a time: the fp32 VAE
        finally:
            for m, mode in zip(modules, was_training):
                m.train(mode)
            if offloaded:
                text_cache.offload(self.text_encoder, self.text_encoder_2)
        return images

    def _decode(self, pipe, latents):
        """Latents -> PIL outside autocast, in the VAE's own dtype (fp32 under fp16: SDXL's VAE NaNs in fp16)."""
        vae = self.vae
        with torch.autocast(self.ctx.device.type, enabled=False):
            latents = latents.to(vae.dtype)
            mean, std = vae.config.get("latents_mean"), vae.config.get("latents_std")
            if mean is not None and std is not None:
                mean = torch.tensor(mean).view(1, -1, 1, 1).to(latents)
                std = torch.tensor(std).view(1, -1, 1, 1).to(latents)
                latents = latents * std / vae.config.scaling_factor + mean
            else:
                latents = latents / vae.config.scaling_factor
            image = vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]

    def save_outputs(self, out_dir: Path, *, step: int) -> list[str]:
        from trainer.families.sdxl.outputs import save_sdxl_outputs

        return save_sdxl_outputs(self, out_dir, step=step)


def _encoder_layers(text_encoder):
    model = getattr(text_encoder, "text_model", text_encoder)
    return model.encoder.layers


def _final_norm(text_encoder):
    return getattr(text_encoder, "text_model", text_encoder).final_layer_norm
