"""Stable Diffusion 1.x / 2.x: LoRA (peft through diffusers' adapter API) and DreamBooth full fine-tuning,
epsilon and v-prediction, optional prior preservation.

Composed of shared parts: the captioned data and latent cache (`CaptionedLatents`), model setup and the DDPM
loss (`unet_training`), checkpoint tensors and sample prompts (`trained_weights`), the validation loss on
held-out images (`validation`)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from diffusers import DDPMScheduler, DPMSolverMultistepScheduler, StableDiffusionPipeline

from trainer.families.components import trained_weights
from trainer.families.components.captioned_latents import CaptionedLatents, Row
from trainer.families.components.noise import zero_terminal_snr
from trainer.families.components.sd_loading import load_sd_components
from trainer.families.components.unet_training import ddpm_loss, setup_models
from trainer.families.components.validation import held_out_loss
from trainer.families.components.transfer import on_device
from trainer.families.protocol import Evaluates, Sample, WorkerContext


class StableDiffusionFamily:
    name = "sd"

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.cfg = ctx.config
        self.prepared: list[torch.nn.Module] = []
        self.ema: Any = None
        self.item_buckets: list[int] | None = None
        self.tokens: dict[str, torch.Tensor] = {}
        self.evaluator: Evaluates | None = None

    # ---- models -------------------------------------------------------------------------------------------
    def load(self) -> None:
        cfg, device = self.cfg, self.ctx.device
        parts = load_sd_components(cfg.model)
        self.unet: Any = parts.unet
        self.vae: Any = parts.vae
        self.text_encoder: Any = parts.text_encoder
        self.tokenizer: Any = parts.tokenizer
        self.prediction_type = parts.prediction_type
        self.scheduler_config = zero_terminal_snr(parts.scheduler_config, enabled=cfg.model.zero_terminal_snr,
                                                  prediction_type=self.prediction_type)
        self.noise_scheduler = DDPMScheduler.from_config(self.scheduler_config, prediction_type=self.prediction_type)
        for module in (self.unet, self.vae, self.text_encoder):
            module.requires_grad_(False)

        self.train_text_encoder = cfg.lora.train_text_encoder if cfg.method == "lora" else cfg.full.train_text_encoder
        setup_models(cfg, self.ctx.plan, device, unet=self.unet, vae=self.vae, text_encoders=[self.text_encoder],
                     train_text_encoder=self.train_text_encoder, pipeline=self.pipeline)
        self.data = CaptionedLatents(self.ctx, self.vae, draw_class_images=self.sample)
        self.evaluator = held_out_loss(self.ctx, self.data, self._plain_rows_loss, self.trainable_modules)

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

    def _checkpoint_modules(self):
        return (("unet", self.unet), ("text_encoder", self.text_encoder))

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return trained_weights.trainable_state(self.ctx, self._checkpoint_modules())

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        trained_weights.load_trainable_state(self.ctx, self._checkpoint_modules(), state)

    # ---- data ---------------------------------------------------------------------------------------------
    def prepare_data(self) -> int:
        count = self.data.prepare()
        self.item_buckets = self.data.item_buckets
        self.tokens = {}
        return count

    def _token_ids(self, caption: str) -> torch.Tensor:
        """Token ids, kept per caption unless shuffled tags make almost every caption new (they would pile up)."""
        if caption in self.tokens:
            return self.tokens[caption]
        ids = self.tokenizer(caption, padding="max_length", truncation=True, max_length=self.tokenizer.model_max_length,
                             return_tensors="pt").input_ids[0]
        if self.data.cacheable:
            self.tokens[caption] = ids
        return ids

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
                         predict=lambda noisy, t, captions, rows: self._predict(noisy, t, captions, modules))

    def _plain_rows_loss(self, rows: list[Row], stream: int) -> torch.Tensor:
        return self._rows_loss(rows, stream, plain=True)

    @functools.cached_property
    def _input_dtype(self) -> torch.dtype:
        """The denoiser's input dtype, read once (the first step, after any wrapping): diffusers' `ModelMixin.dtype`
        walks every submodule, 1.5 ms of each micro-step on the demo's LoRA UNet (bench/README.md)."""
        return self.unet.dtype

    def _predict(self, noisy: torch.Tensor, t: torch.Tensor, captions: list[str], modules) -> torch.Tensor:
        device = self.ctx.device
        unet = modules[0]
        text_encoder = modules[1] if self.train_text_encoder else self.text_encoder
        ids = on_device(torch.stack([self._token_ids(c) for c in captions]), device)
        with torch.set_grad_enabled(self.train_text_encoder and torch.is_grad_enabled()):
            hidden = text_encoder(ids, return_dict=False)[0]
        return unet(noisy.to(self._input_dtype), t, hidden, return_dict=False)[0]

    # ---- samples and outputs ------------------------------------------------------------------------------
    def pipeline(self) -> Any:
        def unwrap(module):
            return trained_weights.unwrapped(self.ctx, module)

        scheduler = DPMSolverMultistepScheduler.from_config(self.scheduler_config, prediction_type=self.prediction_type)
        return StableDiffusionPipeline(vae=self.vae, text_encoder=unwrap(self.text_encoder), tokenizer=self.tokenizer,
                                       unet=unwrap(self.unet), scheduler=scheduler, safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)

    def render_samples(self, step: int):
        shape = trained_weights.sample_shape(self.cfg.sample, self.cfg.data.resolution, self.data.buckets,
                                             self.data.item_buckets)
        return trained_weights.render_prompt_samples(self.cfg.sample, self.sample, shape)

    @torch.no_grad()
    def sample(self, prompts: list[str], seeds: list[int], *, size: int | tuple[int, int] | None = None, steps: int = 25,
               guidance_scale: float = 7.5, negative_prompt: str = ""):
        pipe = self.pipeline()
        pipe.set_progress_bar_config(disable=True)
        width, height = trained_weights.pixel_size(size, self.cfg.data.resolution)
        was_training = [m.training for m in (self.unet, self.text_encoder)]
        self.unet.eval(), self.text_encoder.eval()
        images = []
        try:
            for prompt, run_seeds in trained_weights.prompt_runs(prompts, seeds, width, height):
                gens = [torch.Generator(self.ctx.device).manual_seed(seed) for seed in run_seeds]
                dtype = pipe.unet.dtype  # the sampling copy's (FSDP: low precision, see FSDP.gathered)
                with torch.autocast(self.ctx.device.type, dtype=dtype, enabled=dtype != torch.float32):
                    latents = pipe(prompt, negative_prompt=negative_prompt or None, height=height, width=width,
                                   num_inference_steps=steps, guidance_scale=guidance_scale, generator=gens,
                                   num_images_per_prompt=len(gens), output_type="latent").images
                    for one in latents.split(1):  # decoded one at a time: the VAE's memory stays one image's
                        decoded = pipe.vae.decode(one / pipe.vae.config.scaling_factor, return_dict=False)[0]
                        images.extend(pipe.image_processor.postprocess(decoded, output_type="pil"))
        finally:
            self.unet.train(was_training[0]), self.text_encoder.train(was_training[1])
        return images

    def save_outputs(self, out_dir: Path, *, step: int) -> list[str]:
        from trainer.families.sd.outputs import save_sd_outputs

        return save_sd_outputs(self, out_dir, step=step)
